"""The C ABI, once: kernels/include/kdev/kdtree.h read into ctypes (no torch, no GPU needed).

The header is the one statement of the contract. This module parses it (its `#define KDTREE_*` constants, its params
structs, its function prototypes) instead of restating any of it, so a field added or moved in C reaches Python by
itself; tests/test_cabi.py compiles the header and compares every field's offset and size with the structs made here.
Everything that loads the library goes through `load()`: every function the header declares and the library exports
gets its argtypes and restype here and nowhere else. kdev/abi.py adds the torch-facing side (tensor checks, calls on
the current stream).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kdev.errors import BadInput
from kdev.project import REPO_ROOT

HEADER = REPO_ROOT / "kernels" / "include" / "kdev" / "kdtree.h"  # the project's own (kdev/project.py)

_SCALARS = {"uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32, "uint64_t": ctypes.c_uint64,
            "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double, "size_t": ctypes.c_size_t}
# out-parameters of the plan entry points, written through a pointer the caller passes with ctypes.byref
_OUT_POINTERS = {"int": ctypes.c_int, "size_t": ctypes.c_size_t, "double": ctypes.c_double,
                 "unsigned long long": ctypes.c_uint64, "long long": ctypes.c_int64}


class HeaderError(BadInput):
    """kdtree.h holds something this reader does not take: fix the header or the reader, never work around it."""


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _eval_define(expr: str, known: dict):
    expr = expr.strip()
    if expr.startswith('"'):
        return json.loads(expr)
    if re.fullmatch(r"-?\d+", expr):
        return int(expr)
    if expr in known:
        return known[expr]
    raise HeaderError(f"{HEADER.name}: #define value {expr!r} is neither a number, a string nor a known name")


@dataclass(frozen=True)
class Contract:
    constants: dict          # KDTREE_NAME -> int or str (object-like macros only)
    status: dict             # code -> what it means (the status codes' comments)
    structs: dict            # name -> ctypes.Structure subclass, fields in the header's order
    functions: dict          # name -> (restype, [argtypes])
    variant_functions: frozenset  # the names only a variant's library exports (#ifdef KDTREE_VARIANT_EXPORTS)
    arg_names: dict = None   # name -> (argument names, in order)
    sha256: str = ""         # of the header's bytes


def _parse_constants(raw: str) -> tuple[dict, dict]:
    constants, status = {}, {}
    for m in re.finditer(r"^#define (KDTREE_\w+)(\([^)]*\))?[ \t]+(.+?)[ \t]*$", raw, flags=re.M):
        name, params, value = m.groups()
        if params:  # function-like macros (the page rule's test, the slot formula) are C's; Python has its own
            continue
        comment = re.search(r"/\*\s*(.*?)\s*\*/", value)
        value = re.sub(r"/\*.*?\*/", "", value).strip()
        constants[name] = _eval_define(value, constants)
        if name == "KDTREE_OK" or name.startswith("KDTREE_ERR_"):
            status[constants[name]] = comment.group(1).split(":")[0] if comment else name
    return constants, status


def _field_type(decl: str, structs: dict, where: str):
    decl = decl.replace("const ", "").strip()
    if decl.endswith("*"):
        return ctypes.c_void_p  # device pointers travel as integers
    if decl in _SCALARS:
        return _SCALARS[decl]
    raise HeaderError(f"{HEADER.name}: {where}: type {decl!r} is not one this reader maps")


def _parse_structs(text: str) -> dict:
    structs = {}
    for m in re.finditer(r"typedef struct (\w+) \{(.*?)\} (\w+);", text, flags=re.S):
        name, body, alias = m.groups()
        if name != alias:
            raise HeaderError(f"{HEADER.name}: struct {name} is typedef'd as {alias}")
        fields = []
        for line in filter(None, (x.strip() for x in body.split("\n"))):
            f = re.fullmatch(r"([\w ]+?\**)\s*(\w+);", line)
            if f is None:
                raise HeaderError(f"{HEADER.name}: struct {name}: cannot read the field {line!r}")
            fields.append((f.group(2), _field_type(f.group(1), structs, f"{name}.{f.group(2)}")))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"{name} of kdtree.h"})
    return structs


def _arg_type(decl: str, structs: dict, where: str):
    decl = decl.strip()
    base = decl.replace("const ", "").replace("*", "").strip()
    stars = decl.count("*")
    if decl == "void":
        return None
    if base == "kdtree_stream_t" and not stars:
        return ctypes.c_void_p
    if stars == 0 and base in _SCALARS:
        return _SCALARS[base]
    if stars == 1 and base in structs:
        return ctypes.POINTER(structs[base])
    if stars == 1 and base == "char":
        return ctypes.c_char_p
    if stars == 2 and base == "char":
        return ctypes.POINTER(ctypes.c_char_p)
    if stars == 1 and base in _OUT_POINTERS and "const" not in decl:
        return ctypes.POINTER(_OUT_POINTERS[base])
    if stars == 1:
        return ctypes.c_void_p  # a data pointer (device memory)
    raise HeaderError(f"{HEADER.name}: {where}: type {decl!r} is not one this reader maps")


def _parse_functions(text: str, structs: dict) -> tuple[dict, dict]:
    functions, names = {}, {}
    for m in re.finditer(r"^([\w ]+?\**)\s*(kdtree_\w+)\(([^)]*)\);", text, flags=re.M | re.S):
        ret, name, args = m.groups()
        argtypes, argnames = [], []
        for a in (x.strip() for x in args.replace("\n", " ").split(",")):
            if a == "void":
                continue
            decl = re.fullmatch(r"(.+?[\s*])(\w+)", a)
            if decl is None:
                raise HeaderError(f"{HEADER.name}: {name}: cannot read the argument {a!r}")
            argtypes.append(_arg_type(decl.group(1), structs, f"{name}({decl.group(2)})"))
            argnames.append(decl.group(2))
        functions[name] = (_arg_type(ret, structs, f"{name} (return)"), argtypes)
        names[name] = tuple(argnames)
    if not functions:
        raise HeaderError(f"{HEADER.name}: no kdtree_* prototypes found")
    return functions, names


def read_contract(header: Path = HEADER) -> Contract:
    """The contract a header states (parsed once per distinct text: a library's own header is read beside it)."""
    try:
        data = header.read_bytes()
        raw = data.decode("utf-8")
    except OSError as e:
        raise HeaderError(f"{header}: cannot read the C interface: {e.strerror}") from None
    except UnicodeDecodeError:
        raise HeaderError(f"{header}: not UTF-8 text") from None
    return _contract_of(raw, hashlib.sha256(data).hexdigest())


@functools.lru_cache(maxsize=None)
def _contract_of(raw: str, sha256: str) -> Contract:
    constants, status = _parse_constants(raw)
    text = _strip_comments(raw)
    structs = _parse_structs(text)
    variant = "".join(re.findall(r"^#ifdef KDTREE_VARIANT_EXPORTS\n(.*?)^#endif", text, flags=re.M | re.S))
    functions, arg_names = _parse_functions(text, structs)
    return Contract(constants, status, structs, functions, frozenset(re.findall(r"\b(kdtree_\w+)\(", variant)),
                    arg_names, sha256)


CONTRACT = read_contract()
C = CONTRACT.constants
ABI_VERSION = C["KDTREE_ABI_VERSION"]
STATUS = CONTRACT.status
OK, ERR_INVALID, ERR_CUDA = C["KDTREE_OK"], C["KDTREE_ERR_INVALID"], C["KDTREE_ERR_CUDA"]
ERR_WORKSPACE, ERR_UNSUPPORTED = C["KDTREE_ERR_WORKSPACE"], C["KDTREE_ERR_UNSUPPORTED"]
VerifyAttnParams = CONTRACT.structs["VerifyAttnParams"]
DDTreeBuildParams = CONTRACT.structs["DDTreeBuildParams"]
AcceptParams = CONTRACT.structs["AcceptParams"]
CompactParams = CONTRACT.structs["CompactParams"]

# the contract's numbers, under the names the rest of kdev uses
LATENT_DIM, ROPE_DIM, QK_DIM = C["KDTREE_LATENT_DIM"], C["KDTREE_ROPE_DIM"], C["KDTREE_QK_DIM"]
MAX_QLEN, MAX_HEADS, MAX_PREFIX = C["KDTREE_MAX_QLEN"], C["KDTREE_MAX_HEADS"], C["KDTREE_MAX_PREFIX"]
MAX_BUDGET = MAX_QLEN - 1  # the root is a row too
MAX_DEPTH, MAX_TOPK, MAX_PAGE_SIZE = C["KDTREE_MAX_DEPTH"], C["KDTREE_MAX_TOPK"], C["KDTREE_MAX_PAGE_SIZE"]
BLOCK_M, BLOCK_N = C["KDTREE_FLASH_BLOCK_M"], C["KDTREE_FLASH_BLOCK_N"]
NARROW_ROWS, MAX_SPLITS = C["KDTREE_FLASH_NARROW_ROWS"], C["KDTREE_FLASH_MAX_SPLITS"]
FLASH_THREADS, TENSOR_COPY_MIN_PAGE = C["KDTREE_FLASH_THREADS"], C["KDTREE_FLASH_TENSOR_COPY_MIN_PAGE"]


# --------------------------------------------------------------------------------------------- the page rule
def page_size_problem(page_size) -> str | None:
    """None for a page size the kernels take, else the library's own words for why not (KDTREE_PAGE_SIZE_RULE)."""
    n = page_size
    if isinstance(n, bool) or not isinstance(n, int) or not (1 <= n <= MAX_PAGE_SIZE and n & (n - 1) == 0):
        return f"page_size {page_size} {C['KDTREE_PAGE_SIZE_RULE']}"
    return None


def shape_problem(batch: int, prefix: int, budget: int, heads: int, page_size: int) -> str | None:
    """None for a call shape inside the contract's limits (kdtree.h), else one line naming the first value outside:
    batch >= 1, prefix 0..MAX_PREFIX tokens per request, budget 1..MAX_BUDGET nodes besides the root, heads
    1..MAX_HEADS, and the page rule."""
    if batch < 1:
        return f"batch {batch} < 1"
    if not 0 <= prefix <= MAX_PREFIX:
        return f"prefix {prefix} outside 0..{MAX_PREFIX} tokens"
    if not 1 <= budget <= MAX_BUDGET:
        return f"budget {budget} outside 1..{MAX_BUDGET} nodes (a tree of at most {MAX_QLEN} rows with its root)"
    if not 1 <= heads <= MAX_HEADS:
        return f"heads {heads} outside 1..{MAX_HEADS}"
    return page_size_problem(page_size)


def kv_page_offset(page_row, pos, page_size: int):
    """(page, offset in the page) of logical position(s) `pos` of a request whose page-table row is `page_row`: the slot
    rule of kdtree.h, the one Python statement of it. Works on ints, numpy and torch alike (index a cache of
    [pages, page_size, 576] with the pair)."""
    return page_row[pos // page_size], pos % page_size


def kv_slot(page_row, pos, page_size: int):
    """The pool row of logical position(s) `pos`: page * page_size + offset (kv_page_offset)."""
    page, offset = kv_page_offset(page_row, pos, page_size)
    return page * page_size + offset


# ------------------------------------------------------------------------------------------------- loading
class LoadError(RuntimeError):
    """The library does not load, or its ABI does not match this binding."""


Params = ctypes.Structure  # the type of a params struct of one library's binding (make's result)
HEADER_BESIDE = "kdtree.h"  # `kdev build` keeps the header a library was built from beside it, under this name


def make(struct: type, **fields) -> Params:
    """A params struct of `struct` (one library's binding) filled by field name, struct_size set. A field its header
    does not declare is refused unless its value is 0 or None (a field that came later, left at its default): an
    argument is never put in another field's place."""
    names = {name for name, _ in struct._fields_}
    known = {name for name, _ in CONTRACT.structs[struct.__name__]._fields_}
    unknown = [k for k in fields if k not in names | known]
    if unknown:  # a name no header of this checkout declares: a caller's mistake, never dropped
        raise TypeError(f"{struct.__name__} has no field {unknown[0]!r} (kdtree.h)")
    missing = [k for k, v in fields.items() if k not in names and v not in (0, None, False)]
    if missing:
        raise LoadError(f"{struct.__name__} of this library's kdtree.h has no field {missing[0]!r}: rebuild with "
                        f"'kdev build'")
    return struct(struct_size=ctypes.sizeof(struct), **{k: v for k, v in fields.items() if k in names})


def header_sha256_of(info: dict) -> str | None:
    """The sha256 of the kdtree.h a library was built from, as its build record (kdtree_build_info) states it."""
    return next((d for rel, d in (info.get("sources") or {}).items() if rel.endswith("include/kdev/kdtree.h")), None)


def library_contract(lib: ctypes.CDLL, path: Path, header: Path | None = None) -> Contract:
    """The contract of the header the library was built from: the one `kdev build` kept beside it (or `header`, a
    build's own before its library is in place), whose sha256 must be the one the library's build record states (a
    header of another build is refused, never bound)."""
    header = path.parent / HEADER_BESIDE if header is None else Path(header)
    if not hasattr(lib, "kdtree_build_info"):
        raise LoadError(f"{path}: exports no kdtree_build_info: not a kdev library")
    lib.kdtree_build_info.restype = ctypes.c_char_p
    try:
        built = header_sha256_of(json.loads(lib.kdtree_build_info().decode()))
    except ValueError as e:
        raise LoadError(f"{path}: its build record is not readable: {e}") from None
    if built is None:
        raise LoadError(f"{path}: its build record names no kdtree.h: rebuild with 'kdev build'")
    if not header.is_file():
        raise LoadError(f"{path}: no {HEADER_BESIDE} beside it (the C interface it was built with): rebuild with "
                        f"'kdev build'")
    try:
        contract = read_contract(header)
    except HeaderError as e:
        raise LoadError(str(e)) from None
    if contract.sha256 != built:
        raise LoadError(f"{path} was built from kdtree.h {built[:12]}, but {header} is {contract.sha256[:12]}: "
                        f"rebuild with 'kdev build'")
    return contract


def load(path: str | Path, header: Path | None = None) -> ctypes.CDLL:
    """The library at `path`, every kdtree_* function its own header declares (and it exports) typed by that header
    (library_contract: kept beside it at build time, checked against the sha256 the library states), the contract on
    `lib.kdev_contract`. Raises LoadError where it does not load, where its header is missing or another build's, or
    where its VerifyAttnParams is another size than its header's."""
    path = Path(path)
    try:
        lib = ctypes.CDLL(str(path.resolve()))  # a bare name would be looked up on the loader's path
    except OSError as e:
        raise LoadError(f"{path}: does not load: {e}") from None
    contract = library_contract(lib, path, header)
    for name, (restype, argtypes) in contract.functions.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    lib.kdev_contract = contract
    params = contract.structs["VerifyAttnParams"]
    if hasattr(lib, "kdtree_params_size") and lib.kdtree_params_size() != ctypes.sizeof(params):
        raise LoadError(f"{path}: VerifyAttnParams is {lib.kdtree_params_size()} B in the library, "
                        f"{ctypes.sizeof(params)} B in its kdtree.h: rebuild with 'kdev build'")
    return lib


def takes_argument(lib: ctypes.CDLL, function: str, argument: str) -> bool:
    """Whether the library's `function` takes `argument`, by its own header's prototype."""
    return argument in (lib.kdev_contract.arg_names.get(function) or ())


def last_error(lib: ctypes.CDLL) -> str:
    return (lib.kdtree_last_error() or b"").decode(errors="replace")


def build_info(lib: ctypes.CDLL) -> dict:
    """The provenance JSON the build embedded (kdtree_build_info)."""
    return json.loads(lib.kdtree_build_info().decode())


def status_text(status: int) -> str:
    return STATUS.get(status, "unknown status")
