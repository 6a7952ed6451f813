"""nvcc driver: per-arch compile into one shared library, content-hash cache, ptxas resource gate, provenance.

A configuration (archs + flags) builds into build/kdtree-<archs>-<flags hash>/libkdtree.so with SASS for
every arch and PTX for the newest. The cache key is the hash of the kernel sources, the flags, the archs
and the nvcc version: when it matches the last build's, nothing is compiled. Provenance (git sha and dirty
flag, source hash, nvcc version, archs, flags) is embedded through a generated source file that defines
kdtree_build_info(). The `-Xptxas -v` report becomes a table per kernel and arch; a spill, or static shared
memory above the arch's limit, fails the build unless build.yaml allows it. Beside it, what the flash calls launch
on each arch and the dynamic shared memory per block that takes (asked of the library: the launcher's own rule),
gated on the same limits. cuobjdump confirms which archs the library really carries.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kdev import __version__
from kdev import cabi
from kdev.config import REPO_ROOT, BuildConfig
from kdev.errors import BadInput, CheckFailed, EnvironmentMissing
from kdev.fsutil import (atomic_write_bytes, make_temp_dir, normal_mode, read_json_record,
                         remove_dead_writers_temps, temp_name)

KERNEL_DIR = REPO_ROOT / "kernels"
LIB_NAME = "libkdtree.so"
LATEST = "latest.json"
MIN_ARCH = 80  # the oldest arch the kernels compile for


# ------------------------------------------------------------------------------------------- sources
def kernel_sources(kernel_dir: Path = KERNEL_DIR) -> list[Path]:
    exts = {".cu", ".cuh", ".h", ".hpp", ".cpp"}
    return sorted(p for p in kernel_dir.rglob("*") if p.is_file() and p.suffix in exts)


def source_hashes(kernel_dir: Path = KERNEL_DIR) -> dict[str, str]:
    """Per-file sha256, keyed by path relative to the repository root."""
    root = kernel_dir.parent
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in kernel_sources(kernel_dir)}


def source_hash(kernel_dir: Path = KERNEL_DIR) -> str:
    h = hashlib.sha256()
    for rel, digest in source_hashes(kernel_dir).items():
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- tools
CUDA_HOMES = ["/usr/local/cuda"]


def run_tool_group(cmd: list[str], env: dict) -> tuple[int, str]:
    """Run a compiler driver in a process group of its own and return (exit status, stdout + stderr). If kdev is
    interrupted or terminated meanwhile, the whole group (nvcc and the cicc / ptxas it started) is killed before the
    exception goes on: no compiler runs on as an orphan."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    return proc.returncode, out


def find_nvcc() -> str:
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *CUDA_HOMES):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise EnvironmentMissing("nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", out)
    if m is None:
        raise EnvironmentMissing(f"{nvcc}: not nvcc (its --version names no CUDA release)")
    return m.group(1)


def nvcc_archs(nvcc: str) -> list[str] | None:
    """The sm_XX this nvcc builds (--list-gpu-code); None where it cannot say (an nvcc before CUDA 11)."""
    run = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True)
    archs = run.stdout.split() if run.returncode == 0 else []
    return archs if archs and all(a.startswith("sm_") for a in archs) else None


def find_cuobjdump(nvcc: str | None = None) -> str | None:
    """On PATH, beside nvcc, or from the nvidia-cuda-cuobjdump wheel (the `build` extra)."""
    candidates = [shutil.which("cuobjdump")]
    if nvcc:
        candidates.append(str(Path(nvcc).parent / "cuobjdump"))
    try:
        import nvidia  # namespace package of NVIDIA's wheels

        for base in nvidia.__path__:
            candidates += [str(p) for p in Path(base).glob("cu*/bin/cuobjdump")]
    except ImportError:
        pass
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def git_state(repo: Path = REPO_ROOT) -> dict:
    def git(*args):
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


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


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> list[KernelResources]:
    """Entries of `-Xptxas -v` output, one per (kernel, arch), in the order ptxas printed them."""
    rows: list[KernelResources] = []
    cur = None
    for line in text.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            cur = KernelResources(kernel=m.group(1), arch=m.group(2))
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
    return problems


# ------------------------------------------------------------------------------------------ compile
def gencode_flags(archs: tuple) -> list[str]:
    """SASS for every arch; PTX of the newest too, so newer GPUs can JIT it."""
    def num(a):
        return int(a[3:].rstrip("a"))

    newest = max(archs, key=num)
    flags = []
    for a in archs:
        cc = a.replace("sm_", "compute_")
        code = f"[{a},{cc}]" if a == newest else a
        flags.append(f"-gencode=arch={cc},code={code}")
    return flags


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
    """The loaded library's kdtree_flash_launch_plan (L from cabi.load) as ask(major, smem_optin, tensor_copy, portable)
    -> {full, full_smem, narrow, narrow_smem}: which kernels the flash (or portable) call launches on such a GPU and the
    dynamic shared memory per block of each. A refusal raises `error` with the library's message. None for a library
    without the entry point."""
    fn = getattr(L, "kdtree_flash_launch_plan", None)
    if fn is None:
        return None

    def ask(major: int, smem_optin: int, tensor_copy: bool, portable: bool) -> dict:
        full, full_smem, narrow, narrow_smem = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_char_p(), ctypes.c_int()
        if fn(major, smem_optin, tensor_copy, portable, ctypes.byref(full), ctypes.byref(full_smem),
              ctypes.byref(narrow), ctypes.byref(narrow_smem)):
            raise error(f"kdtree_flash_launch_plan(major {major}): {cabi.last_error(L)}")
        return {"full": full.value.decode(), "full_smem": full_smem.value, "narrow": narrow.value.decode(),
                "narrow_smem": narrow_smem.value}

    return ask


def flash_launches(lib: Path | str, cfg: BuildConfig) -> list[dict] | None:
    """What the flash calls launch on each arch of cfg and the dynamic shared memory per block each kernel takes
    (which the ptxas report cannot show: it is set at launch), by the library's own rule (kdtree_flash_launch_plan,
    the launcher's choice, asked with the arch's opt-in limit from build.yaml): one row per arch and kernel, with the
    calls that launch it. None for a library from sources without that entry point."""
    try:
        L = cabi.load(lib)
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
                k = ask(major, limit, tensor_copy, portable)
                call = (("flash-portable" if portable else "flash")
                        + (" (pages >= 32)" if tensor_copy else " (pages < 32)" if major >= 9 else ""))
                for kernel, smem in ((k["full"], k["full_smem"]), (k["narrow"], k["narrow_smem"])):
                    row = rows.setdefault((arch, kernel), {"arch": arch, "kernel": kernel, "dynamic_smem": smem,
                                                           "limit": limit, "calls": []})
                    row["calls"].append(call)
    return list(rows.values())


def launch_problems(rows: list[dict]) -> list[str]:
    return [f"{r['kernel']} [{r['arch']}]: {r['dynamic_smem']} B dynamic shared memory per block > {r['limit']} B "
            f"limit" for r in rows if r["dynamic_smem"] > r["limit"]]


@dataclass
class BuildResult:
    library: Path
    folder: Path
    cached: bool
    key: str
    build_info: dict
    resources: list = field(default_factory=list)
    embedded: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    seconds: float = 0.0
    # the flash calls' kernels and dynamic shared memory per arch (flash_launches); None: the sources predate it
    launches: list | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["library"], d["folder"] = str(self.library), str(self.folder)
        return d


def config_folder(cfg: BuildConfig) -> Path:
    flags_hash = hashlib.sha256("\0".join(cfg.flags).encode()).hexdigest()[:8]
    return cfg.output_dir / f"kdtree-{'-'.join(cfg.archs)}-{flags_hash}"


def cache_key(cfg: BuildConfig, src_hash: str, nvcc_ver: str) -> str:
    h = hashlib.sha256(json.dumps({"sources": src_hash, "flags": cfg.flags, "archs": cfg.archs, "nvcc": nvcc_ver},
                                  sort_keys=True).encode())
    return h.hexdigest()


def _build_info_source(info: dict) -> str:
    text = json.dumps(info, sort_keys=True)
    assert ")KDEV\"" not in text
    return ("// Generated by kdev build: provenance of this library. Do not edit.\n"
            f'extern "C" const char* kdtree_build_info(void) {{ return R"KDEV({text})KDEV"; }}\n')


_RE_DIAG = re.compile(r"^(.+?)\((\d+)\): (error|warning)[^:]*: (.*)$")
# the host compiler's (g++) form, for errors in the host pass of a .cu file: file:line:col: error: message
_RE_HOST_DIAG = re.compile(r"^(.+?):(\d+):(?:\d+:)? (?:fatal )?error: (.*)$")


def _compiler_errors(text: str) -> list[str]:
    """nvcc / cicc and host-compiler diagnostics as 'file:line: error: message' lines (errors only)."""
    def located(path: str, line_no: str, message: str) -> str:
        try:
            path = str(Path(path).resolve().relative_to(Path.cwd()))
        except ValueError:
            pass
        return f"{path}:{line_no}: error: {message}"

    out = []
    for line in text.splitlines():
        m = _RE_DIAG.match(line.strip())
        h = _RE_HOST_DIAG.match(line.strip())
        if m and m.group(3) == "error":
            out.append(located(m.group(1), m.group(2), m.group(4)))
        elif h:
            out.append(located(h.group(1), h.group(2), h.group(3)))
        elif " error" in line.lower() and ("ptxas" in line or "nvlink" in line or "fatal" in line.lower()):
            out.append(line.strip())
    return out


def build(cfg: BuildConfig, force: bool = False, log=None, kernel_dir: Path = KERNEL_DIR,
          variant: bool = False) -> BuildResult:
    """Build (or reuse) the library for cfg. Raises CheckFailed on compiler errors and EnvironmentMissing
    without nvcc; resource-gate failures are returned in result.problems (the library is kept for study,
    but latest.json is not pointed at it).

    variant: kernel_dir is an edited copy of the kernels under study (an A/B candidate). Its library gets a
    folder of its own, named by its source hash, and latest.json (what verify, bench and deploy-check load
    by default) is left alone: the candidate is loaded only where asked for, with --library."""
    import time

    log = log or (lambda msg: None)
    nvcc = find_nvcc()
    ver = nvcc_version(nvcc)
    known = nvcc_archs(nvcc)
    unknown = [a for a in cfg.archs if known is not None and a.rstrip("a") not in known]  # sm_90a: sm_90's features
    if unknown:  # refused here in one line rather than as nvcc's fatal error after a compile started
        raise BadInput(f"nvcc {ver} does not build {unknown[0]} (it builds {', '.join(known)})")
    older = [a for a in cfg.archs if int(a[3:].rstrip("a")) < MIN_ARCH]
    if older:
        raise BadInput(f"{older[0]}: the kernels need sm_{MIN_ARCH} or newer (bf16 mma.sync, cp.async, warp "
                       f"reductions)")
    ungated = [a for a in cfg.archs if a.rstrip("a") not in cfg.smem_limit_bytes]
    if ungated:  # its shared memory would pass unjudged, and the flash launches would not be asked for it
        raise BadInput(f"{ungated[0]}: {cfg.path.name} has no smem_limit_bytes for it: the resource gate needs the "
                       f"arch's per-block opt-in limit")
    src_hash = source_hash(kernel_dir)
    key = cache_key(cfg, src_hash, ver)
    folder = config_folder(cfg)
    if variant:
        own = read_json_record(folder / "build.json", ("key",))
        if not (own is not None and own["key"] == key and (folder / LIB_NAME).is_file()):
            # not the same sources as this checkout's build of the config: a folder of its own
            folder = folder.with_name(f"{folder.name}-variant-{src_hash[:12]}")
    lib = folder / LIB_NAME
    record = folder / "build.json"
    # a damaged record, or one from before the launch table, is rebuilt
    old = read_json_record(record, ("key", "launches", "build_info", "resources", "embedded", "problems"))
    if not force and lib.is_file() and old is not None:
        if old["key"] == key:
            launches, gate_changed = old["launches"], old.get("gate") != gate_settings(cfg)
            if gate_changed:
                # build.yaml's gate changed since this build (the key holds only what the compile depends on): the
                # launcher is asked again with the new limits, and the stored report judged anew
                launches = flash_launches(lib, cfg)
            res = BuildResult(library=lib, folder=folder, cached=True, key=key, build_info=old["build_info"],
                              resources=old["resources"], embedded=old["embedded"],
                              problems=gate_problems(old["resources"], launches, old["embedded"], cfg, lib),
                              launches=launches)
            if gate_changed or res.problems != old["problems"]:
                _write_record(record, res, cfg)
            if not variant:
                _point_latest(cfg, res)
            return res

    t0 = time.time()
    folder.mkdir(parents=True, exist_ok=True)
    info = {
        **git_state(kernel_dir.parent),
        "source_hash": src_hash,
        "sources": source_hashes(kernel_dir),
        "nvcc_version": ver,
        "archs": list(cfg.archs),
        "flags": list(cfg.flags),
        "kdev_version": __version__,
        "variant": variant,  # built from another kernels/ tree on purpose: its sources differ from kernels/
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    gen = folder / "build_info.gen.cpp"
    atomic_write_bytes(gen, _build_info_source(info).encode())
    remove_dead_writers_temps(folder)  # what a killed build left: its temp library and nvcc's temp folder
    fd, tmp_lib = tempfile.mkstemp(prefix=temp_name("libkdtree"), suffix=".so", dir=folder)
    os.close(fd)
    scratch = make_temp_dir(folder, "nvcc")  # nvcc's own temp files (TMPDIR): removed whatever happens
    cu = [str(p) for p in kernel_sources(kernel_dir) if p.suffix == ".cu"]
    cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", *cfg.flags, "-Xptxas", "-v", f"-I{kernel_dir / 'include'}",
           *gencode_flags(cfg.archs), "--threads", "0", "-o", tmp_lib, *cu, str(gen)]
    log(f"nvcc {ver}: {len(cu)} sources for {', '.join(cfg.archs)}")
    try:
        returncode, text = run_tool_group(cmd, {**os.environ, "TMPDIR": str(scratch)})
        if returncode != 0:
            errors = _compiler_errors(text) or [line for line in text.splitlines() if line.strip()][-5:]
            for e in errors:
                log(e)
            detail = f"first: {errors[0]}" if errors else f"exit status {returncode}, no output"
            raise CheckFailed(f"nvcc failed ({len(errors)} error line(s)); {detail}")
        # asked of the new library under its own (unique) name: a process that loaded an earlier build from `lib`
        # would get that one back from the loader
        launches = flash_launches(tmp_lib, cfg)
        os.chmod(tmp_lib, normal_mode(executable=True))  # mkstemp's 0600: a server's account could not load it
        os.replace(tmp_lib, lib)
    finally:
        Path(tmp_lib).unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    rows = parse_ptxas(text)
    names = demangle(sorted({r.kernel for r in rows}))
    for r in rows:
        r.kernel = names.get(r.kernel, r.kernel)
    rows.sort(key=lambda r: (r.kernel, int(r.arch[3:].rstrip("a"))))
    embedded = embedded_archs(lib, find_cuobjdump(nvcc))
    resources = [asdict(r) for r in rows]
    res = BuildResult(library=lib, folder=folder, cached=False, key=key, build_info=info, resources=resources,
                      embedded=embedded, problems=gate_problems(resources, launches, embedded, cfg, lib),
                      seconds=round(time.time() - t0, 1), launches=launches)
    _write_record(record, res, cfg)
    if not variant:
        _point_latest(cfg, res)
    return res


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


def _write_record(record: Path, res: BuildResult, cfg: BuildConfig) -> None:
    doc = {k: v for k, v in res.to_dict().items() if k not in ("library", "folder", "cached", "seconds")}
    atomic_write_bytes(record, json.dumps({**doc, "gate": gate_settings(cfg)}, indent=2).encode())


def latest_record(archs) -> str:
    """The record naming the last good build of one arch set: latest-sm_90-sm_120.json."""
    return f"latest-{'-'.join(archs)}.json"


def _point_latest(cfg: BuildConfig, res: BuildResult) -> None:
    """latest-<archs>.json names the last build of that arch set that passes the gate, and latest.json (what verify,
    bench, plan and deploy-check load by default) the last of build.yaml's own set: a one-arch build (--arch sm_90)
    leaves the default library alone. Neither ever names a build that fails the gate: a library that fails a gate made
    stricter since it was built is no longer named."""
    default = not cfg.default_archs or tuple(cfg.archs) == tuple(cfg.default_archs)
    paths = [cfg.output_dir / latest_record(cfg.archs)] + ([cfg.output_dir / LATEST] if default else [])
    doc = {"library": str(res.library), "key": res.key, "archs": list(cfg.archs),
           "source_hash": res.build_info["source_hash"]}
    for path in paths:
        if not res.problems:
            atomic_write_bytes(path, json.dumps(doc, indent=2).encode())
            continue
        named = read_json_record(path, ("library",))
        if named is not None and Path(named["library"]) == res.library:
            path.unlink(missing_ok=True)


def library_file(library: Path) -> Path:
    """A build folder stands for the library in it."""
    return library / LIB_NAME if library.is_dir() and (library / LIB_NAME).is_file() else library


def latest_library(output_dir: Path | None = None, archs=None) -> Path | None:
    """The library the last successful `kdev build` of build.yaml's archs produced, or of `archs` where named
    (KDEV_LIB overrides)."""
    env = os.environ.get("KDEV_LIB")
    if env:
        return Path(env)
    out = output_dir or (REPO_ROOT / "build")
    f = out / (latest_record(archs) if archs else LATEST)
    record = read_json_record(f, ("library",))
    if record is None or not isinstance(record["library"], str):
        return None
    lib = Path(record["library"])
    return lib if lib.is_file() else None


# ------------------------------------------------------------------------------ another build, by reference
def git_revision(ref: str, repo: Path = REPO_ROOT) -> str | None:
    """The full commit id `ref` names in repo (a branch, a tag, a sha, HEAD~1), or None."""
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def is_kernel_tree(path: Path) -> bool:
    """A copy of kernels/ (an A/B base or candidate): its include/ folder and at least one .cu file."""
    return path.is_dir() and (path / "include").is_dir() and any(path.glob("*.cu"))


PATCH_SUFFIXES = (".patch", ".diff")
NO_LIBRARY_REF = "no library, build folder, copy of kernels/, git revision or kernels patch"


def describe_library_ref(ref: str, repo: Path = REPO_ROOT) -> str | None:
    """What `ref` names for a library to load: "library" (a .so or a build folder), "kernels" (a copy of
    kernels/ to build), "revision" (a git revision whose kernels/ to build), "patch" (a .patch or .diff file, as
    variants/ holds: this checkout's kernels/ with it applied, to build), or None."""
    p = Path(ref)
    if p.is_file() and p.suffix in PATCH_SUFFIXES:
        return "patch"
    if p.is_file() or (p.is_dir() and (p / LIB_NAME).is_file()):
        return "library"
    if is_kernel_tree(p):
        return "kernels"
    return "revision" if git_revision(ref, repo) else None


def revision_kernels(ref: str, repo: Path = REPO_ROOT, output_dir: Path | None = None) -> Path:
    """kernels/ as commit `ref` has it, extracted once into build/ab-<commit>/kernels (named by the commit, so a
    second call finds it; written into a temporary folder first and renamed, so a half-written tree is never
    found)."""
    import io
    import tarfile

    sha = git_revision(ref, repo)
    if sha is None:
        raise BadInput(f"{ref}: no such git revision in {repo}")
    dest = (output_dir or repo / "build") / f"ab-{sha[:12]}"
    if is_kernel_tree(dest / "kernels"):
        return dest / "kernels"
    r = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha, "kernels"], capture_output=True)
    if r.returncode != 0:
        raise BadInput(f"{ref}: git archive of its kernels/ failed: "
                       f"{(r.stderr.decode(errors='replace').strip().splitlines() or ['?'])[-1]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(dest.parent, f"ab-{sha[:12]}")
    try:
        with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "kernels"


def patch_kernels(patch: Path, kernel_dir: Path = KERNEL_DIR, output_dir: Path | None = None) -> Path:
    """kernel_dir (this checkout's kernels/) with `patch` applied by git apply (paths kernels/..., as the files in
    variants/ have them), written once into build/ab-patch-<hash>/kernels: the hash covers the patch and the kernel
    sources it was applied to, so an edit to either makes a new tree and a second call finds this one. Written into a
    temporary folder first and renamed, so a half-written tree is never found; a patch that does not apply is bad
    input, with git's first line."""
    patch = Path(patch).resolve()
    digest = hashlib.sha256(patch.read_bytes() + source_hash(kernel_dir).encode()).hexdigest()[:12]
    dest = (output_dir or REPO_ROOT / "build") / f"ab-patch-{digest}"
    if is_kernel_tree(dest / "kernels"):
        return dest / "kernels"
    tmp = make_temp_dir(dest.parent, f"ab-patch-{digest}")
    try:
        shutil.copytree(kernel_dir, tmp / "kernels")
        # inside a repository git apply would patch that repository's paths: the ceiling keeps it to tmp
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp.parent)}
        r = subprocess.run(["git", "apply", str(patch)], cwd=tmp, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise BadInput(f"{patch.name}: does not apply to {kernel_dir}: "
                           f"{(r.stderr.strip().splitlines() or ['?'])[0]}")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "kernels"


def library_for(ref: str, archs: list[str], log=None, repo: Path = REPO_ROOT) -> BuildResult | Path:
    """The library `ref` names: a library file or build folder as it is (its path); a copy of kernels/, a git
    revision's kernels/ (extracted by revision_kernels) or this checkout's kernels/ with a patch applied
    (patch_kernels), built for `archs` into a library of its own as an A/B variant (kdev build --kernels: cached by
    content, latest.json left alone; its BuildResult)."""
    from kdev import config

    kind = describe_library_ref(ref, repo)
    if kind is None:
        raise BadInput(f"{ref}: {NO_LIBRARY_REF}")
    if kind == "library":
        return library_file(Path(ref))
    tree = {"kernels": lambda: Path(ref).resolve(), "revision": lambda: revision_kernels(ref, repo),
            "patch": lambda: patch_kernels(Path(ref), repo / "kernels")}[kind]()
    return build(config.load_build(None, list(archs)), log=log, kernel_dir=tree, variant=True)
