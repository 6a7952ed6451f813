"""The C ABI's one binding against its one header: kernels/include/kdev/kdtree.h compiled by the host compiler (as C and
as C++) says where every field of every params struct lies, and kdev/cabi.py's structs must say the same; every function
the header declares is exported by the built library and nothing else is; the page rule and the slot formula agree
between C and Python; no module declares the ABI a second time."""

import ctypes
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kdev import cabi

REPO = Path(__file__).resolve().parent.parent
INCLUDE = REPO / "kernels" / "include"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _compile_and_run(tmp_path: Path, compiler: str | None, source: str, suffix: str, stdin: str = "") -> str:
    if compiler is None:
        pytest.skip("no host compiler")
    src = tmp_path / f"probe{suffix}"
    src.write_text(source)
    exe = tmp_path / f"probe{suffix.replace('.', '_')}"
    build = subprocess.run([compiler, "-Wall", "-Werror", f"-I{INCLUDE}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout


def _layout_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kdev/kdtree.h"', "int main(void) {"]
    for name, st in cabi.CONTRACT.structs.items():
        lines.append(f'  printf("{name} . %zu\\n", sizeof({name}));')
        for field, _ in st._fields_:
            lines.append(f'  printf("{name} {field} %zu %zu\\n", offsetof({name}, {field}), '
                         f'sizeof((({name}*)0)->{field}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _c_layout(text: str) -> dict:
    """{struct: {"": sizeof, field: (offset, size)}} from the probe's output."""
    out: dict = {}
    for line in text.splitlines():
        parts = line.split()
        if parts[1] == ".":
            out.setdefault(parts[0], {})[""] = int(parts[2])
        else:
            out.setdefault(parts[0], {})[parts[1]] = (int(parts[2]), int(parts[3]))
    return out


def layout_mismatches(st: type, c: dict) -> list[str]:
    """Every difference between a ctypes struct and the compiler's layout of the C struct of the same name."""
    problems = []
    if ctypes.sizeof(st) != c[""]:
        problems.append(f"{st.__name__}: sizeof {ctypes.sizeof(st)} here, {c['']} in C")
    for field, _ in st._fields_:
        here = (getattr(st, field).offset, getattr(st, field).size)
        if field not in c:
            problems.append(f"{st.__name__}.{field}: not in the C struct")
        elif here != c[field]:
            problems.append(f"{st.__name__}.{field}: offset/size {here} here, {c[field]} in C")
    return problems


@pytest.fixture(scope="module")
def c_layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layout")
    as_c = _c_layout(_compile_and_run(tmp, CC, _layout_program(), ".c"))
    as_cpp = _c_layout(_compile_and_run(tmp, CXX, _layout_program(), ".cpp"))
    assert as_c == as_cpp  # one header, one layout, whichever language includes it
    return as_c


def test_every_params_struct_matches_the_header_field_by_field(c_layouts):
    assert set(c_layouts) == {"VerifyAttnParams", "DDTreeBuildParams", "AcceptParams", "CompactParams"}
    for name, st in cabi.CONTRACT.structs.items():
        assert layout_mismatches(st, c_layouts[name]) == []
        assert len(st._fields_) == len(c_layouts[name]) - 1


def test_a_binding_with_two_fields_swapped_is_caught(c_layouts):
    """The negative control: the same fields, two of the same type in each other's place, as a hand-written mirror
    could have them; the total size alone would not tell."""
    fields = list(cabi.VerifyAttnParams._fields_)
    i, j = [n for n, _ in fields].index("batch"), [n for n, _ in fields].index("total_q")
    fields[i], fields[j] = fields[j], fields[i]
    swapped = type("VerifyAttnParams", (ctypes.Structure,), {"_fields_": fields})
    assert ctypes.sizeof(swapped) == ctypes.sizeof(cabi.VerifyAttnParams)
    problems = layout_mismatches(swapped, c_layouts["VerifyAttnParams"])
    assert len(problems) == 2 and any("batch" in p for p in problems) and any("total_q" in p for p in problems)
    # and a pointer field moved among pointers
    fields = list(cabi.VerifyAttnParams._fields_)
    fields.insert(fields.index(("out", ctypes.c_void_p)), fields.pop([n for n, _ in fields].index("lse")))
    moved = type("VerifyAttnParams", (ctypes.Structure,), {"_fields_": fields})
    assert layout_mismatches(moved, c_layouts["VerifyAttnParams"])


def test_the_reader_refuses_what_it_cannot_map(tmp_path):
    header = tmp_path / "kdtree.h"
    header.write_text(cabi.HEADER.read_text().replace("int32_t batch;\n  int32_t total_q;",
                                                      "int32_t batch;\n  __int128 total_q;", 1))
    with pytest.raises(cabi.HeaderError, match="VerifyAttnParams"):
        cabi.read_contract(header)


def test_page_rule_and_slot_formula_agree_with_c(tmp_path):
    sizes = list(range(-2, 70)) + [127, 128, 129, 4095, 4096, 4097, 8192, 1 << 30]
    program = """#include <stdio.h>
#include "kdev/kdtree.h"
int main(void) {
  long long n, pos, page;
  while (scanf("%lld", &n) == 1) {
    if (n == -99) break;
    printf("%d\\n", KDTREE_PAGE_SIZE_OK(n) ? 1 : 0);
  }
  while (scanf("%lld %lld %lld", &n, &pos, &page) == 3) {
    int row[1] = {(int)page};
    long long p0 = pos % n;  /* position within the only page of this probe's row */
    printf("%zu\\n", KDTREE_KV_SLOT(row, p0, n));
  }
  return 0;
}
"""
    rng = random.Random(1234)
    slots = [(1 << rng.randrange(0, 13), rng.randrange(0, 1 << 20), rng.randrange(0, 1 << 16)) for _ in range(200)]
    stdin = " ".join(map(str, sizes)) + " -99\n" + "\n".join(f"{n} {p} {g}" for n, p, g in slots)
    out = _compile_and_run(tmp_path, CC, program, ".c", stdin).split()
    c_ok, c_slots = out[:len(sizes)], out[len(sizes):]
    assert [cabi.page_size_problem(n) is None for n in sizes] == [v == "1" for v in c_ok]
    assert [cabi.kv_slot([g], p % n, n) for n, p, g in slots] == [int(v) for v in c_slots]
    assert cabi.page_size_problem(3) == "page_size 3 is not a power of two in 1..4096"
    assert cabi.page_size_problem(True) is not None


def _exported(library: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r"\sT (kdtree_\w+)$", out, flags=re.M)}


@pytest.mark.nvcc
def test_the_library_exports_exactly_what_the_header_declares(sm90_library):
    assert _exported(sm90_library) == set(cabi.CONTRACT.functions) - cabi.CONTRACT.variant_functions
    assert cabi.CONTRACT.variant_functions == {"kdtree_cta_probe_read"}
    lib = cabi.load(sm90_library)
    assert lib.kdtree_max_qlen() == cabi.MAX_QLEN
    assert lib.kdtree_params_size() == ctypes.sizeof(cabi.VerifyAttnParams)
    # a refusal carries the status the header names and the page rule's words
    full, size = ctypes.c_char_p(), ctypes.c_int()
    assert lib.kdtree_flash_launch_plan(7, 0, 0, 0, 0, ctypes.byref(full), ctypes.byref(size), ctypes.byref(full),
                                        ctypes.byref(size)) == cabi.ERR_INVALID
    assert "sm_80" in cabi.last_error(lib)
    compact = cabi.make(lib.kdev_contract.structs["CompactParams"], batch=1, t_stride=1, page_size=3, max_pages=1,
                        num_pages=1)
    assert lib.kdtree_compact_kv(ctypes.byref(compact), None) == cabi.ERR_INVALID
    assert cabi.last_error(lib) == cabi.page_size_problem(3)


def test_no_module_declares_the_abi_again():
    """argtypes / restype are set in kdev/cabi.py alone, the probe variant's function too (kdtree.h declares it); every
    module of the package and the scripts, at any depth."""
    offenders = []
    for path in sorted((REPO / "kdev").rglob("*.py")) + sorted((REPO / "scripts").rglob("*.py")):
        if path.name == "cabi.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.(argtypes|restype)\s*=", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
            if "ctypes.Structure" in line or "ctypes.CDLL(" in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert offenders == []


# ------------------------------------------------------------------------------------- params by name, bound by header
def _reversed_fields(text: str) -> str:
    """kdtree.h with the fields of every params struct after struct_size in reverse order (a scratch copy)."""
    def flip(m: re.Match) -> str:
        lines = m.group(2).split("\n")
        first = next(i for i, line in enumerate(lines) if "struct_size;" in line)
        fields = [line for line in lines[first + 1:] if line.strip()]
        return m.group(1) + "\n".join(lines[:first + 1] + fields[::-1]) + "\n" + m.group(3)
    return re.sub(r"(typedef struct \w+ \{)(.*?)\n(\} \w+;)", flip, text, flags=re.S)


def _echo_library(tmp_path: Path, header: Path) -> ctypes.CDLL:
    """A library compiled against `header` whose echo_<Struct>(p, out) writes each field of p, read by its name, into
    out in the tree's field order: what a kernel reading its params sees."""
    if CC is None:
        pytest.skip("no host compiler")
    lines = ["#include <stdint.h>", f'#include "{header}"']
    for name, st in cabi.CONTRACT.structs.items():
        lines.append(f"void echo_{name}(const {name}* p, uint64_t* out) {{")
        for i, (field, _) in enumerate(st._fields_):
            lines.append(f"  out[{i}] = (uint64_t)(uintptr_t)p->{field};")
        lines.append("}")
    src, lib = tmp_path / "echo.c", tmp_path / "libecho.so"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([CC, "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def _echo(echo: ctypes.CDLL, name: str, p: ctypes.Structure) -> dict:
    fields = [f for f, _ in cabi.CONTRACT.structs[name]._fields_]
    out = (ctypes.c_uint64 * len(fields))()
    getattr(echo, f"echo_{name}")(ctypes.byref(p), out)
    return dict(zip(fields, out))


@pytest.mark.parametrize("reverse", [False, True])
def test_every_params_struct_is_filled_by_field_name(tmp_path, reverse):
    """Each field's value reaches the C field of its name, with the header as it is and with every struct's fields in
    reverse order (a scratch copy); the negative control: filled by position, the reversed header gets values in the
    wrong fields."""
    header = tmp_path / "kdtree.h"
    text = cabi.HEADER.read_text()
    header.write_text(_reversed_fields(text) if reverse else text)
    contract = cabi.read_contract(header)
    echo = _echo_library(tmp_path, header)
    for name, tree_struct in cabi.CONTRACT.structs.items():
        fields = [f for f, _ in tree_struct._fields_ if f != "struct_size"]
        values = {f: 1000 + i for i, f in enumerate(fields)}
        struct = contract.structs[name]
        got = _echo(echo, name, cabi.make(struct, **values))
        assert got == {"struct_size": ctypes.sizeof(struct), **values}, name
        by_position = _echo(echo, name, struct(ctypes.sizeof(struct), *values.values()))
        assert (by_position == got) != reverse, name


def test_the_tree_kernels_fill_their_params_by_name(tmp_path):
    """abi.TreeKernels' params, as the C side reads them by name, whatever order the header declares the fields in:
    each pointer is its own tensor's (parents never the depths, max_pages never num_pages)."""
    import torch

    from kdev import abi

    header = tmp_path / "kdtree.h"
    header.write_text(_reversed_fields(cabi.HEADER.read_text()))
    contract = cabi.read_contract(header)
    echo = _echo_library(tmp_path, header)

    class Bound:  # a Library's make(), bound with the reversed header
        def make(self, struct, **fields):
            return cabi.make(contract.structs[struct], **fields)

    tk = abi.TreeKernels(Bound())
    B, D, K, N = 2, 3, 4, 9
    lp = torch.randn(B, D, K)
    ids = torch.randint(0, 100, (B, D, K), dtype=torch.int32)
    p, out = tk.prepare_build(lp, ids, torch.zeros(B, dtype=torch.int32), torch.ones(B, dtype=torch.int32), N)
    got = _echo(echo, "DDTreeBuildParams", p)
    for k in ("node_tokens", "parents", "depths", "positions", "tree_mask", "node_count"):
        assert got[k] == out[k].data_ptr(), k
    assert (got["batch"], got["depth"], got["topk"], got["budget"], got["mask_words"]) == (B, D, K, N, 1)
    assert got["log_probs"] == lp.data_ptr() and got["token_ids"] == ids.data_ptr()
    T = N + 1
    tokens, parents, count, argmax = (torch.zeros(B, T, dtype=torch.int32), torch.zeros(B, T, dtype=torch.int32),
                                      torch.zeros(B, dtype=torch.int32), torch.zeros(B, T, dtype=torch.int32))
    p, (accepted, length, bonus) = tk.prepare_accept(tokens, parents, count, argmax)
    got = _echo(echo, "AcceptParams", p)
    assert (got["parents"], got["node_tokens"], got["target_argmax"]) == (parents.data_ptr(), tokens.data_ptr(),
                                                                         argmax.data_ptr())
    assert (got["accepted"], got["accept_len"], got["bonus_token"]) == (accepted.data_ptr(), length.data_ptr(),
                                                                        bonus.data_ptr())
    cache = torch.zeros(5, 4, cabi.QK_DIM, dtype=torch.bfloat16)
    table = torch.zeros(B, 3, dtype=torch.int32)
    p = tk.prepare_compact(cache, table, count, accepted, length)
    got = _echo(echo, "CompactParams", p)
    assert (got["page_size"], got["max_pages"], got["num_pages"], got["t_stride"]) == (4, 3, 5, T)


def test_a_field_no_header_declares_is_a_mistake_and_a_later_one_must_stay_zero():
    st = cabi.VerifyAttnParams
    with pytest.raises(TypeError, match="no field 'bacth'"):
        cabi.make(st, bacth=1)
    older = type("VerifyAttnParams", (ctypes.Structure,),
                 {"_fields_": [f for f in st._fields_ if f[0] != "plan_sm_count"]})
    assert cabi.make(older, batch=3, plan_sm_count=0).batch == 3
    with pytest.raises(cabi.LoadError, match="no field 'plan_sm_count'"):
        cabi.make(older, plan_sm_count=188)


@pytest.mark.nvcc
def test_a_library_binds_only_with_the_header_it_was_built_from(default_build, tmp_path):
    """`kdev build` keeps the header beside the library and the library states its sha256: bound with it, its ABI
    version the header's; a library whose header beside it is another's, or missing, is refused in one line naming
    both (the negative control: one comment changed in the header)."""
    _, res = default_build
    built = Path(res.library)
    beside = built.parent / cabi.HEADER_BESIDE
    assert beside.read_bytes() == cabi.HEADER.read_bytes()
    lib = cabi.load(built)
    assert lib.kdev_contract.sha256 == cabi.CONTRACT.sha256
    assert lib.kdtree_abi_version() == cabi.ABI_VERSION == lib.kdev_contract.constants["KDTREE_ABI_VERSION"]
    copy = tmp_path / "other" / built.name
    copy.parent.mkdir()
    shutil.copy(built, copy)
    with pytest.raises(cabi.LoadError, match="no kdtree.h beside it"):
        cabi.load(copy)
    (copy.parent / cabi.HEADER_BESIDE).write_text(cabi.HEADER.read_text().replace("/* libkdtree:", "/* libkdtree (x):"))
    with pytest.raises(cabi.LoadError) as e:
        cabi.load(copy)
    msg = str(e.value)
    assert "\n" not in msg and cabi.CONTRACT.sha256[:12] in msg and msg.count("kdtree.h") >= 2
    from kdev import abi
    from kdev.errors import EnvironmentMissing

    with pytest.raises(EnvironmentMissing, match="was built from kdtree.h"):
        abi.Library(copy)
    shutil.copy(beside, copy.parent / cabi.HEADER_BESIDE)
    assert cabi.load(copy).kdev_contract.sha256 == cabi.CONTRACT.sha256
