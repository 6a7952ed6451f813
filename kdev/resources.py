"""What a build's machine code takes, and the gate on it: the `-Xptxas -v` report as a row per kernel and arch (a
spill, or static shared memory above the arch's limit, fails the build unless build.yaml allows it; so does a kernel
whose wgmma ptxas serialized: each one waited for before the next issues, the tensor pipe idle between); what the flash
calls launch on each arch and the dynamic shared memory per block that takes (asked of the library: the launcher's own
rule), gated on the same limits; and the archs cuobjdump finds in the library (an arch without SASS fails too).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kdev import cabi, registry
from kdev.config import WGMMA_ARCH, BuildConfig
from kdev.errors import CheckFailed


# ------------------------------------------------------------------------------------ ptxas report
@dataclass
class KernelResources:
    kernel: str
    arch: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    smem: int = 0
    wgmma_serialized: str = ""  # why ptxas serialized the kernel's wgmma (its C7520 note), or ""


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
# printed before the function's entry line, naming it: e.g. "due to program dependence on compiler-inserted WG.AR in
# divergent path" (a branch between a wgmma fence and its commit)
_RE_WGMMA_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized due to (.+?) in the function '([^']+)'")


def parse_ptxas(text: str) -> list[KernelResources]:
    """Entries of `-Xptxas -v` output, one per (kernel, arch), in the order ptxas printed them."""
    rows: list[KernelResources] = []
    cur = None
    serialized = {}  # kernel -> reason, for its next entry line
    for line in text.splitlines():
        m = _RE_WGMMA_SERIAL.search(line)
        if m:
            serialized[m.group(2)] = m.group(1)
            continue
        m = _RE_ENTRY.search(line)
        if m:
            cur = KernelResources(kernel=m.group(1), arch=m.group(2), wgmma_serialized=serialized.pop(m.group(1), ""))
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = _RE_FRAME.search(line)
        if m:
            cur.stack_frame, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        m = _RE_USED.search(line)
        if m:
            cur.registers = int(m.group(1))
            s = _RE_SMEM.search(line)
            cur.smem = int(s.group(1)) if s else 0
    return rows


def demangle(names: list[str]) -> dict[str, str]:
    """Readable kernel names (c++filt where present), stripped to the function name."""
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    out = {}
    demangled = names
    if tool and names:
        r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
        if r.returncode == 0 and len(r.stdout.splitlines()) == len(names):
            demangled = r.stdout.splitlines()
    for raw, nice in zip(names, demangled):
        out[raw] = short_kernel_name(nice)
    return out


def short_kernel_name(demangled: str) -> str:
    """A demangled kernel signature as the function name with its template arguments, without the kdtree and
    anonymous namespaces (c++filt writes "(anonymous namespace)", Nsight Compute "<unnamed>")."""
    # a template kernel demangles with its return type ("void kdtree::k<true>(...)"); kernels return void
    name = demangled.removeprefix("void ").replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    return name.split("(")[0].removeprefix("kdtree::")


def resource_problems(rows: list[KernelResources], cfg: BuildConfig) -> list[str]:
    problems = []
    for r in rows:
        if not cfg.allow_spills and (r.spill_stores or r.spill_loads):
            problems.append(f"{r.kernel} [{r.arch}]: spills {r.spill_stores} B stores / {r.spill_loads} B loads")
        limit = cfg.smem_limit_bytes.get(r.arch.rstrip("a"))
        if limit is not None and r.smem > limit:
            problems.append(f"{r.kernel} [{r.arch}]: {r.smem} B static shared memory > {limit} B limit")
        if r.wgmma_serialized:
            problems.append(f"{r.kernel} [{r.arch}]: ptxas serialized its wgmma ({r.wgmma_serialized})")
    return problems



def embedded_archs(lib: Path, cuobjdump: str | None) -> dict:
    """{'sass': [...], 'ptx': [...]} as cuobjdump lists them, or None values without cuobjdump."""
    if cuobjdump is None:
        return {"sass": None, "ptx": None, "tool": None}
    res = {"tool": cuobjdump}
    for kind, flag in (("sass", "--list-elf"), ("ptx", "--list-ptx")):
        r = subprocess.run([cuobjdump, flag, str(lib)], capture_output=True, text=True)
        res[kind] = sorted(set(re.findall(r"\.(sm_\d+a?)\.(?:cubin|ptx)", r.stdout)), key=lambda a: int(a[3:].rstrip("a")))
    return res


def launch_plan_entry(L: ctypes.CDLL, error: type = CheckFailed):
    """The loaded library's kdtree_flash_launch_plan (L from cabi.load) as ask(major, smem_optin, tensor_copy, portable,
    wgmma_built) -> {full, full_smem, narrow, narrow_smem}: which kernels the flash (or portable) call launches on such
    a GPU from code with the wgmma kernel or without, and the dynamic shared memory per block of each. A refusal raises
    `error` with the library's message. None for a library without the entry point; one whose own header declares it
    without wgmma_built (an older build) is asked without it."""
    fn = getattr(L, "kdtree_flash_launch_plan", None)
    if fn is None:
        return None
    takes_wgmma = cabi.takes_argument(L, "kdtree_flash_launch_plan", "wgmma_built")  # ABI 6 added it

    def ask(major: int, smem_optin: int, tensor_copy: bool, portable: bool, wgmma_built: bool = False) -> dict:
        full, full_smem, narrow, narrow_smem = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_char_p(), ctypes.c_int()
        flags = (major, smem_optin, tensor_copy, portable) + ((wgmma_built,) if takes_wgmma else ())
        if fn(*flags, ctypes.byref(full), ctypes.byref(full_smem), ctypes.byref(narrow), ctypes.byref(narrow_smem)):
            raise error(f"kdtree_flash_launch_plan(major {major}): {cabi.last_error(L)}")
        return {"full": full.value.decode(), "full_smem": full_smem.value, "narrow": narrow.value.decode(),
                "narrow_smem": narrow_smem.value}

    return ask


def flash_launches(lib: Path | str, cfg: BuildConfig, header: Path | None = None) -> list[dict] | None:
    """What the flash calls launch on each arch of cfg and the dynamic shared memory per block each kernel takes
    (which the ptxas report cannot show: it is set at launch), by the library's own rule (kdtree_flash_launch_plan,
    the launcher's choice, asked with the arch's opt-in limit from build.yaml): one row per arch and kernel, with the
    calls that launch it. None for a library from sources without that entry point."""
    try:
        L = cabi.load(lib, header)
    except cabi.LoadError as e:  # what verify and bench would meet too: the build is not usable
        raise CheckFailed(f"the built library does not load: {e}") from None
    ask = launch_plan_entry(L)
    if ask is None:
        return None
    rows: dict[tuple, dict] = {}
    for arch in cfg.archs:
        major, limit = int(arch[3:].rstrip("a")) // 10, cfg.smem_limit_bytes.get(arch.rstrip("a"))
        if limit is None or major < 8:  # no opt-in limit to ask with, or an arch without the flash kernels
            continue
        for portable in (False, True):
            for tensor_copy in ((True, False) if major >= 9 else (False,)):
                k = ask(major, limit, tensor_copy, portable, wgmma_built=arch == WGMMA_ARCH)
                call = ((registry.PORTABLE if portable else registry.HOPPER)
                        + (" (pages >= 32)" if tensor_copy else " (pages < 32)" if major >= 9 else ""))
                for kernel, smem in ((k["full"], k["full_smem"]), (k["narrow"], k["narrow_smem"])):
                    row = rows.setdefault((arch, kernel), {"arch": arch, "kernel": kernel, "dynamic_smem": smem,
                                                           "limit": limit, "calls": []})
                    row["calls"].append(call)
    return list(rows.values())


def launch_problems(rows: list[dict]) -> list[str]:
    return [f"{r['kernel']} [{r['arch']}]: {r['dynamic_smem']} B dynamic shared memory per block > {r['limit']} B "
            f"limit" for r in rows if r["dynamic_smem"] > r["limit"]]



def gate_settings(cfg: BuildConfig) -> dict:
    """What the resource gate judges a build by, for the archs it holds: a build record keeps it, so that a cached
    build is judged anew when build.yaml's gate changes."""
    return {"allow_spills": cfg.allow_spills,
            "smem_limit_bytes": {a: cfg.smem_limit_bytes.get(a.rstrip("a")) for a in cfg.archs}}


def gate_problems(resources: list[dict], launches: list[dict] | None, embedded: dict, cfg: BuildConfig,
                  lib: Path) -> list[str]:
    """The resource gate: spills and static shared memory (ptxas), dynamic shared memory (the launcher's choice),
    and an arch whose SASS the library lacks."""
    problems = resource_problems([KernelResources(**r) for r in resources], cfg) + launch_problems(launches or [])
    if embedded.get("sass") is not None:
        problems += [f"{a}: no SASS embedded in {lib.name}" for a in cfg.archs if a not in embedded["sass"]]
    return problems
