"""SASS schedule report: what ptxas made of a kernel's tensor-core loops, read from a built library (no GPU).

Per loop (a backward branch and the instructions it jumps over) that issues HMMA:
- counts of instructions, HMMA, shared-memory fragment loads (LDSM, LDS) and NOP;
- the accumulator chain: for each HMMA, how many HMMAs back the one that produced its accumulator input was
  issued (across the loop's back edge too). The smallest distances tell how many chains ptxas keeps in
  flight: at 2, a dependent HMMA every second one, and the warp waits out an HMMA latency per pair;
- the load lead: how many instructions separate an HMMA from the load that produced its A or B fragment.
  A short lead is the ldmatrix latency the warp must cover with other warps' work;
- the shared-memory wavefronts (128 B) the body's instructions move per warp, and so per HMMA: an SM serves one
  wavefront per cycle and issues an HMMA.16816 every ~1.7 cycles at the H200's mma.sync peak, so a hot path above
  ~1.7 per HMMA is bound by shared memory there (kernels/NOTES.md). Estimates from the code alone, accesses taken as
  conflict-free: every instruction of the body once (rare branches, the mask's or a fallback copy's, included), and
  the hot path's (rare_stretches and guarded instructions left out); the JSON splits the first by opcode.
These are the figures that explained flash v9 without a GPU (kernels/NOTES.md, "where v9 waits"): the
source kept four S chains, the SASS two.

Per loop that issues warpgroup MMA (HGMMA, sm_90a): the HGMMA of each shape and the FLOPs a warpgroup issues per
iteration, the waits for them (WARPGROUP.DEPBAR: at least one per HGMMA means ptxas serialized them, each waited for
before the next issues), the block barriers (BAR) and the mbarrier waits (SYNCS.PHASECHK) per iteration.

And the machine code of two builds side by side (`compare`): per kernel and arch, whether the SASS is identical,
and if not how many instructions differ. A refactor or a comment edit is proven harmless by identical SASS without a
GPU run; a variant shows which kernels it really changed before GPU time is spent on it.
"""

from __future__ import annotations

import difflib
import os
import re
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kdev.build import find_cuobjdump, find_nvcc
from kdev.resources import demangle
from kdev.errors import BadInput, EnvironmentMissing

_RE_ARCH = re.compile(r"^\s*code for (sm_\w+)")
_RE_FUNC = re.compile(r"^\s*Function : (\S+)")
_RE_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_RE_REG = re.compile(r"^R(\d+)$")
_LOADS = ("LDSM", "LDS")  # shared-memory loads that feed mma fragments
# nvcc names a file's anonymous namespace after the file and a hash that changes between builds of the same source
# (in the mangled kernel names, and in any instruction that addresses a symbol inside it)
_RE_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}(?=\d)")
_RE_HEX = re.compile(r"\b0x[0-9a-f]+\b")
_RE_REGNUM = re.compile(r"\b(U?R|U?P|B)(\d+)\b")  # R7, UR4, P0, UP1, B0 (RZ, PT, URZ have no number)
_JUMPS = ("BRA", "BRX", "JMP", "JMX", "CALL", "BSSY", "SSY", "PBK", "PCNT")  # instructions whose operand is an address


@dataclass
class Instr:
    addr: int
    opcode: str  # full opcode with modifiers, e.g. HMMA.16816.F32.BF16
    operands: list[str]
    predicated: bool
    text: str = ""  # as printed, guard predicate included (without the address and the encoding)

    @property
    def op(self) -> str:
        return self.opcode.split(".")[0]


@dataclass
class Function:
    arch: str
    name: str
    instrs: list[Instr] = field(default_factory=list)


def parse_instr(text: str, addr: int) -> Instr:
    full = _RE_ANON.sub("_GLOBAL__N_", " ".join(text.split()))
    pred = text.startswith("@")
    if pred:
        text = text.split(None, 1)[1]
    opcode, _, rest = text.partition(" ")
    ops = [o.strip() for o in rest.split(",")] if rest.strip() else []
    return Instr(addr=addr, opcode=opcode, operands=ops, predicated=pred, text=full)


def parse(text: str) -> list[Function]:
    """cuobjdump -sass output -> one Function per (arch, kernel), instructions in address order."""
    funcs: list[Function] = []
    arch, cur = None, None
    for line in text.splitlines():
        m = _RE_ARCH.match(line)
        if m:
            arch, cur = m.group(1), None
            continue
        m = _RE_FUNC.match(line)
        if m:
            cur = Function(arch=arch or "?", name=m.group(1))
            funcs.append(cur)
            continue
        m = _RE_INSTR.match(line)
        if m and cur is not None:
            cur.instrs.append(parse_instr(m.group(2), int(m.group(1), 16)))
    return funcs


def _reg(operand: str) -> int | None:
    m = _RE_REG.match(operand.split(".")[0].lstrip("-|"))
    return int(m.group(1)) if m else None


def _dest_regs(ins: Instr) -> range:
    """Registers a fragment load writes: LDSM .x1/.x2/.x4 one to four, LDS.32/.64/.128 one to four."""
    base = _reg(ins.operands[0]) if ins.operands else None
    if base is None:
        return range(0)
    mods = ins.opcode.split(".")
    if ins.op == "LDSM":
        n = int(mods[-1]) if mods[-1].isdigit() else 1
    else:
        n = {"64": 2, "128": 4}.get(mods[-1], 1)
    return range(base, base + n)


# Shared-memory instructions and the 128-byte wavefronts one warp-wide issue of each moves when it is free of bank
# conflicts: an ldmatrix 8x8 b16 matrix is 128 B (.x1 / .x2 / .x4: 1 / 2 / 4); a 32 / 64 / 128-bit access by 32 lanes
# is 128 / 256 / 512 B. cp.async (LDGSTS) writes shared memory too; tensor copies (UTMALDG) go through the async
# proxy without an instruction per byte, so they are not counted.
_SMEM_OPS = ("LDSM", "LDS", "STS", "ATOMS", "LDGSTS")


def smem_wavefronts(ins: Instr) -> int:
    """Wavefronts one warp-wide issue of `ins` moves through the shared-memory pipe (0 for other instructions)."""
    if ins.op not in _SMEM_OPS:
        return 0
    mods = ins.opcode.split(".")[1:]
    if ins.op == "LDSM":
        return int(mods[-1]) if mods and mods[-1].isdigit() else 1
    return 4 if "128" in mods else 2 if "64" in mods else 1


def _wavefronts_by_op(body: list[Instr]) -> dict[str, int]:
    """Wavefronts per opcode (a guarded instruction under its opcode + " (guarded)"): which accesses make the total."""
    out: dict[str, int] = {}
    for ins in body:
        w = smem_wavefronts(ins)
        if w:
            key = ins.opcode + (" (guarded)" if ins.predicated else "")
            out[key] = out.get(key, 0) + w
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def rare_stretches(body: list[Instr]) -> list[bool]:
    """Per instruction of a loop body: True where it sits in a stretch a forward branch of the body jumps over and
    that stretch issues no HMMA (a mask path, a fallback copy: taken on some iterations only). A skipped stretch
    with HMMA is taken as the hot path (a tile's tensor work is what the loop is for). A heuristic from the code
    alone: work under a branch that runs on most iterations (a copy of the next tile behind a bounds test) counts
    as rare."""
    at = {ins.addr: k for k, ins in enumerate(body)}
    rare = [False] * len(body)
    for k, ins in enumerate(body):
        if ins.op != "BRA" or not ins.operands:
            continue
        try:
            target = int(ins.operands[-1], 16)
        except ValueError:
            continue
        if target > ins.addr and target in at and not any(x.op == "HMMA" for x in body[k + 1:at[target]]):
            for j in range(k + 1, at[target]):
                rare[j] = True
    return rare


def loops(fn: Function) -> list[tuple[int, int]]:
    """(first, last) instruction indexes of each loop: a branch back to an earlier address."""
    index = {ins.addr: i for i, ins in enumerate(fn.instrs)}
    out = []
    for i, ins in enumerate(fn.instrs):
        if ins.op == "BRA" and ins.operands:
            try:
                target = int(ins.operands[-1], 16)
            except ValueError:
                continue
            # a back edge, unless it jumps over an unconditional EXIT: that is a retry stub placed after the
            # function's end (an mbarrier wait) jumping back into the code, not a loop
            if target <= ins.addr and target in index and not any(
                    x.op == "EXIT" and not x.predicated for x in fn.instrs[index[target]:i]):
                out.append((index[target], i))
    return sorted(set(out))


def loop_report(fn: Function, first: int, last: int) -> dict:
    body = fn.instrs[first:last + 1]
    hmma = [(k, ins) for k, ins in enumerate(body) if ins.op == "HMMA"]
    # accumulator chains: the HMMA that last wrote this HMMA's C register, earlier in the body or (for a
    # value carried around the loop) later in it, counted in HMMAs
    writer = {}  # base register -> position in the HMMA sequence of its last writer so far
    last_writer = {}
    for j, (_, ins) in enumerate(hmma):
        last_writer[_reg(ins.operands[0])] = j
    chain = []
    for j, (_, ins) in enumerate(hmma):
        c = _reg(ins.operands[3]) if len(ins.operands) > 3 else None
        if c is not None:
            if c in writer:
                chain.append(j - writer[c])
            elif c in last_writer:
                chain.append(j + len(hmma) - last_writer[c])
        writer[_reg(ins.operands[0])] = j
    # load lead: instructions from the load that wrote an HMMA's A or B fragment to the HMMA
    loaded = {}  # register -> body position of the load that wrote it last
    lead = []
    for k, ins in enumerate(body):
        if ins.op in _LOADS:
            for r in _dest_regs(ins):
                loaded[r] = k
        elif ins.op == "HMMA":
            srcs = [_reg(o) for o in ins.operands[1:3]]
            ks = [loaded[r] for r in srcs if r is not None and r in loaded]
            if ks:
                lead.append(k - max(ks))
            d = _reg(ins.operands[0])
            for r in range(d, d + 4) if d is not None else ():
                loaded.pop(r, None)
        else:
            d = _reg(ins.operands[0]) if ins.operands else None
            if d is not None:
                loaded.pop(d, None)  # overwritten by something else
    return {
        "address": f"{body[0].addr:#06x}",
        "instructions": len(body),
        "hmma": len(hmma),
        "loads": sum(ins.op in _LOADS for ins in body),
        "nop": sum(ins.op == "NOP" for ins in body),
        # every shared-memory instruction of the body once (rare branches included), per warp and iteration
        "smem_wavefronts": sum(smem_wavefronts(ins) for ins in body),
        # the same without rare stretches (rare_stretches) and guarded instructions: the hot path's, estimated
        "smem_wavefronts_hot": sum(smem_wavefronts(ins) for ins, rare in zip(body, rare_stretches(body))
                                   if not rare and not ins.predicated),
        "smem_wavefronts_by_op": _wavefronts_by_op(body),
        "chain_min": min(chain) if chain else None,
        "chain_median": statistics.median(chain) if chain else None,
        "chains": {str(d): chain.count(d) for d in sorted(set(chain))},
        "lead_min": min(lead) if lead else None,
        "lead_median": statistics.median(lead) if lead else None,
    }


_RE_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.")


def wgmma_loop_report(fn: Function, first: int, last: int) -> dict:
    """A loop's warpgroup MMA: HGMMA by shape (an HGMMA on RZ, which ptxas issues to close an empty group, does no
    work and is not counted), the waits for them, and the barriers per iteration."""
    body = fn.instrs[first:last + 1]
    shapes: dict[str, int] = {}
    flop = 0
    for ins in body:
        m = _RE_HGMMA_SHAPE.match(ins.opcode)
        if m and ins.operands and ins.operands[0] != "RZ":
            mm, nn, kk = map(int, m.groups())
            shapes[f"{mm}x{nn}x{kk}"] = shapes.get(f"{mm}x{nn}x{kk}", 0) + 1
            flop += 2 * mm * nn * kk
    hgmma = sum(shapes.values())
    waits = sum(ins.opcode.startswith("WARPGROUP.DEPBAR") for ins in body)
    return {
        "address": f"{body[0].addr:#06x}",
        "instructions": len(body),
        "hgmma": hgmma,
        "hgmma_by_shape": shapes,
        "flop_per_warpgroup": flop,
        "wgmma_waits": waits,
        "serialized": hgmma > 1 and waits >= hgmma,
        "block_barriers": sum(ins.op == "BAR" for ins in body),
        "mbarrier_waits": sum(ins.opcode.startswith("SYNCS.PHASECHK") for ins in body),
    }


def _check_archs(functions: list[Function], archs: list[str] | None, have_what: str) -> None:
    """An arch asked for that the build has no SASS for is refused, not left out of the rows without a word."""
    built = sorted({f.arch for f in functions}, key=lambda a: int(a[3:].rstrip("a")))
    absent = [a for a in archs or [] if a not in built]
    if absent:
        raise BadInput(f"no SASS for {', '.join(absent)} ({have_what}: {', '.join(built) or 'none'})")


def _no_kernel(functions: list[Function], kernel: str, archs: list[str] | None, where: str, have_what: str):
    have = sorted(set(demangle(sorted({f.name for f in functions})).values()))
    return BadInput(f"no kernel matching '{kernel}'" + (f" for {', '.join(archs)}" if archs else "")
                    + f"{where}; {have_what}: {', '.join(have) or 'none'}")


def report(functions: list[Function], kernel: str, archs: list[str] | None = None) -> list[dict]:
    """One row per (arch, kernel, HMMA loop) of the functions whose readable name contains `kernel`."""
    _check_archs(functions, archs, "the library has")
    picked = _by_kernel(functions, kernel, archs)
    if not picked:
        raise _no_kernel(functions, kernel, archs, "", "the library has")
    rows = []
    for (arch, name), f in picked.items():
        for first, last in loops(f):
            r = loop_report(f, first, last)
            if r["hmma"]:
                rows.append({"arch": arch, "kernel": name, **r})
    return rows


def wgmma_report(functions: list[Function], kernel: str, archs: list[str] | None = None) -> list[dict]:
    """One row per (arch, kernel, loop with HGMMA) of the functions whose readable name contains `kernel`."""
    rows = []
    for (arch, name), f in _by_kernel(functions, kernel, archs).items():
        for first, last in loops(f):
            r = wgmma_loop_report(f, first, last)
            if r["hgmma"]:
                rows.append({"arch": arch, "kernel": name, **r})
    return rows


def dump(library: Path) -> str:
    """The library's SASS as cuobjdump prints it."""
    if not library.is_file():
        raise BadInput(f"{library}: no such library")
    try:
        nvcc = find_nvcc()
    except EnvironmentMissing:
        nvcc = None
    tool = find_cuobjdump(nvcc)
    if tool is None:
        raise EnvironmentMissing("cuobjdump not found (pip install 'kdev[build]', or put the CUDA toolkit on PATH)")
    # cuobjdump hands the disassembly to nvdisasm, which it finds on PATH or through NVDISASM_PATH: point it
    # at the one beside it (the wheels install both into one folder)
    env = dict(os.environ)
    if (Path(tool).parent / "nvdisasm").is_file():
        env.setdefault("NVDISASM_PATH", str(Path(tool).parent))
    r = subprocess.run([tool, "-sass", str(library)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        if "nvdisasm" in last:
            raise EnvironmentMissing(f"cuobjdump needs nvdisasm for SASS: {last} (pip install 'kdev[build]')")
        raise BadInput(f"cuobjdump could not read {library}: {last}")
    return r.stdout


def _by_kernel(functions: list[Function], kernel: str, archs: list[str] | None) -> dict[tuple[str, str], Function]:
    """(arch, readable name) -> function, for the functions whose readable name contains `kernel`."""
    names = demangle(sorted({f.name for f in functions}))
    out = {}
    for f in functions:
        if kernel in names[f.name] and (not archs or f.arch in archs):
            key = (f.arch, names[f.name])
            n = 2
            while key in out:  # overloads that share a readable name: keep them apart, in dump order
                key, n = (f.arch, f"{names[f.name]} #{n}"), n + 1
            out[key] = f
    return out


def _changed_instructions(base: Function, this: Function) -> int:
    """Instructions that differ, counted on the larger side of each differing stretch. Branch targets are masked
    first: one inserted instruction moves every target behind it, which is not a change of those branches."""
    def masked(fn: Function) -> list[str]:
        return [_RE_HEX.sub("0x_", i.text) if i.op in _JUMPS else i.text for i in fn.instrs]

    a, b = masked(base), masked(this)
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def _register_numbers_aside(fn: Function) -> list[str]:
    return [_RE_REGNUM.sub(r"\1", i.text) for i in fn.instrs]


def _hmma_loops(fn: Function) -> list[list[Instr]]:
    return [fn.instrs[first:last + 1] for first, last in loops(fn)
            if any(ins.op == "HMMA" for ins in fn.instrs[first:last + 1])]


def _hmma_loop_sizes(fn: Function) -> list[int]:
    return [len(body) for body in _hmma_loops(fn)]


def _hmma_loop_wavefronts(fn: Function) -> list[int]:
    return [sum(smem_wavefronts(ins) for ins in body) for body in _hmma_loops(fn)]


def _likeness(a: Function, b: Function) -> str | None:
    """same (identical instructions), registers (identical but for register numbers), or None."""
    if [i.text for i in a.instrs] == [i.text for i in b.instrs]:
        return "same"
    return "registers" if _register_numbers_aside(a) == _register_numbers_aside(b) else None


def compare(base: list[Function], this: list[Function], kernel: str = "",
            archs: list[str] | None = None) -> list[dict]:
    """One row per (arch, kernel) in either build whose readable name contains `kernel`: status same (identical
    instructions), registers (identical but for register numbers: ptxas allocated them differently; the numbers are
    not checked against each other, so this says "look at the allocation", not "the same program"), changed, added
    (only in this build) or removed (only in the base); instruction counts, the number of instructions that differ,
    and the sizes of the loops that issue HMMA in each with their shared-memory wavefronts. A kernel added under a
    new name whose code is a removed kernel's (a template argument added, a kernel renamed) names it in `code_of`,
    how alike in `code_likeness`."""
    _check_archs(base, archs, "the base has")
    _check_archs(this, archs, "this build has")
    old, new = _by_kernel(base, kernel, archs), _by_kernel(this, kernel, archs)
    if not old and not new:
        raise _no_kernel(base + this, kernel, archs, " in either library", "they have")
    removed = [k for k in old if k not in new]
    rows = []
    for key in sorted(old.keys() | new.keys(), key=lambda k: (k[1], k[0])):
        a, b = old.get(key), new.get(key)
        code_of = likeness = None
        if a is None or b is None:
            status, changed = ("added", len(b.instrs)) if a is None else ("removed", len(a.instrs))
            for k in removed if a is None else ():
                if k[0] == key[0] and (likeness := _likeness(old[k], b)):
                    code_of = k[1]
                    break
        else:
            status = _likeness(a, b) or "changed"
            changed = _changed_instructions(a, b) if status == "changed" else 0
        rows.append({
            "arch": key[0], "kernel": key[1], "status": status,
            "base_instructions": len(a.instrs) if a else None, "instructions": len(b.instrs) if b else None,
            "changed_instructions": changed,
            "base_hmma_loops": _hmma_loop_sizes(a) if a else [], "hmma_loops": _hmma_loop_sizes(b) if b else [],
            # shared-memory wavefronts of those loops per warp and iteration (loop_report's smem_wavefronts)
            "base_hmma_loop_wavefronts": _hmma_loop_wavefronts(a) if a else [],
            "hmma_loop_wavefronts": _hmma_loop_wavefronts(b) if b else [],
            "code_of": code_of, "code_likeness": likeness,
        })
    return rows
