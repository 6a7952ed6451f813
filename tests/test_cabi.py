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
    compact = cabi.CompactParams(struct_size=ctypes.sizeof(cabi.CompactParams), batch=1, t_stride=1, page_size=3,
                                 max_pages=1, num_pages=1)
    assert lib.kdtree_compact_kv(ctypes.byref(compact), None) == cabi.ERR_INVALID
    assert cabi.last_error(lib) == cabi.page_size_problem(3)


def test_no_module_declares_the_abi_again():
    """argtypes / restype are set in kdev/cabi.py alone, the probe variant's function too (kdtree.h declares it)."""
    offenders = []
    for path in sorted((REPO / "kdev").glob("*.py")) + sorted((REPO / "scripts").glob("*.py")):
        if path.name == "cabi.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.(argtypes|restype)\s*=", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
            if "ctypes.Structure" in line or "ctypes.CDLL(" in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert offenders == []
