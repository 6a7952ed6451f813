"""nvcc driver: per-arch compile into one shared library, content-hash cache, ptxas resource gate, provenance.

A configuration (archs + flags) builds into build/kdtree-<archs>-<flags hash>/libkdtree.so with SASS for
every arch and PTX for the newest. The cache key is the hash of the kernel sources, the flags, the archs
and the nvcc version: when it matches the last build's, nothing is compiled. Provenance (git sha and dirty
flag, source hash, nvcc version, archs, flags) is embedded through a generated source file that defines
kdtree_build_info(). What the machine code takes (the ptxas report, the flash calls' dynamic shared memory, the
archs cuobjdump finds) and the gate on it live in kdev/resources.py; another build named by a reference (a copy of
kernels/, a git revision, a patch) in kdev/refs.py.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
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
from kdev import cabi, resources
from kdev.config import REPO_ROOT, WORK_ROOT, BuildConfig, load_build
from kdev.errors import BadInput, CheckFailed, EnvironmentMissing, KdevError
from kdev.fsutil import (atomic_write_bytes, make_temp_dir, normal_mode, raise_if_stopped, read_json_record,
                         remove_dead_writers_temps, signals_deferred, temp_name)

KERNEL_DIR = REPO_ROOT / "kernels"
HEADER = Path("include") / "kdev" / "kdtree.h"  # the C interface, in a kernels/ tree
LIB_NAME = "libkdtree.so"
LOCK_NAME = "build.lock"  # in a build's folder: one build of a configuration at a time (_one_build_at_a_time)
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
        h.update(os.fsencode(rel) + f"\0{digest}\n".encode())  # a file name need not be UTF-8
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- tools
CUDA_HOMES = ["/usr/local/cuda"]


def run_tool_group(cmd: list[str], env: dict) -> tuple[int, str]:
    """Run a compiler driver in a process group of its own and return (exit status, stdout + stderr). If kdev is
    interrupted or terminated meanwhile, the whole group (nvcc and the cicc / ptxas it started) is killed before the
    exception goes on: no compiler runs on as an orphan."""
    # the tools echo paths, which need not be UTF-8 (a checkout under caf\xe9/): read as UTF-8, a bad byte replaced
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8", errors="replace",
                            cwd=REPO_ROOT, env=env, start_new_session=True)
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


@contextlib.contextmanager
def _one_build_at_a_time(folder: Path, log):
    """An exclusive lock per build configuration: eight tensor-parallel processes of a server that start at once make
    one build, and the seven others find it cached. A folder that cannot be written is not locked (nothing can be built
    there; a cached build is only read)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, normal_mode())
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (log or (lambda m: None))(f"waiting for another process's build of {folder.name}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build(cfg: BuildConfig, force: bool = False, log=None, kernel_dir: Path = KERNEL_DIR,
          variant: bool = False) -> BuildResult:
    """Build (or reuse) the library for cfg, one process at a time per configuration (_build), once the archs are known
    to be buildable (nothing is made for a refused one)."""
    nvcc, ver = _toolchain_for(cfg)
    with _one_build_at_a_time(config_folder(cfg), log):
        return _build(cfg, nvcc, ver, force, log, kernel_dir, variant)


def _toolchain_for(cfg: BuildConfig) -> tuple[str, str]:
    """(nvcc, its version) where it builds every arch of cfg and the gate knows each; else one line."""
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
    return nvcc, ver


def _build(cfg: BuildConfig, nvcc: str, ver: str, force: bool = False, log=None, kernel_dir: Path = KERNEL_DIR,
           variant: bool = False) -> BuildResult:
    """Build (or reuse) the library for cfg. Raises CheckFailed on compiler errors and EnvironmentMissing
    without nvcc; resource-gate failures are returned in result.problems (the library is kept for study,
    but latest.json is not pointed at it).

    variant: kernel_dir is an edited copy of the kernels under study (an A/B candidate). Its library gets a
    folder of its own, named by its source hash, and latest.json (what verify, bench and deploy-check load
    by default) is left alone: the candidate is loaded only where asked for, with --library."""
    import time

    log = log or (lambda msg: None)
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
        if old["key"] == key and _header_beside_is(folder, old["build_info"]):
            launches, gate_changed = old["launches"], old.get("gate") != resources.gate_settings(cfg)
            if gate_changed:
                # build.yaml's gate changed since this build (the key holds only what the compile depends on): the
                # launcher is asked again with the new limits, and the stored report judged anew
                launches = resources.flash_launches(lib, cfg)
            res = BuildResult(library=lib, folder=folder, cached=True, key=key, build_info=old["build_info"],
                              resources=old["resources"], embedded=old["embedded"],
                              problems=resources.gate_problems(old["resources"], launches, old["embedded"], cfg, lib),
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
    # the header as the build record states it, kept to be put beside the library: one read, so an edit made during the
    # build cannot pair the library with a header its record does not name
    header_bytes = (kernel_dir / HEADER).read_bytes()
    if hashlib.sha256(header_bytes).hexdigest() != cabi.header_sha256_of(info):
        raise CheckFailed(f"{kernel_dir / HEADER} changed while the build read the sources: run it again")
    gen = folder / "build_info.gen.cpp"
    atomic_write_bytes(gen, _build_info_source(info).encode())
    remove_dead_writers_temps(folder)  # what a killed build left: its temp library and nvcc's temp folder
    cu = [str(p) for p in kernel_sources(kernel_dir) if p.suffix == ".cu"]
    tmp_lib = tmp_header = scratch = None
    try:
        with signals_deferred():  # a kill now lands inside this try, where both temps are removed
            fd, tmp_lib = tempfile.mkstemp(prefix=temp_name("libkdtree"), suffix=".so", dir=folder)
            os.close(fd)
            scratch = make_temp_dir(folder, "nvcc")  # nvcc's own temp files (TMPDIR)
        cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", *cfg.flags, "-Xptxas", "-v", f"-I{kernel_dir / 'include'}",
               *gencode_flags(cfg.archs), "--threads", "0", "-o", tmp_lib, *cu, str(gen)]
        log(f"nvcc {ver}: {len(cu)} sources for {', '.join(cfg.archs)}")
        returncode, text = run_tool_group(cmd, {**os.environ, "TMPDIR": str(scratch)})
        if returncode != 0:
            errors = _compiler_errors(text) or [line for line in text.splitlines() if line.strip()][-5:]
            for e in errors:
                log(e)
            detail = f"first: {errors[0]}" if errors else f"exit status {returncode}, no output"
            raise CheckFailed(f"nvcc failed ({len(errors)} error line(s)); {detail}")
        # asked of the new library under its own (unique) name: a process that loaded an earlier build from `lib`
        # would get that one back from the loader
        with signals_deferred():  # made inside the try that removes it
            fd, tmp_header = tempfile.mkstemp(prefix=temp_name("kdtree"), suffix=".h", dir=folder)
            os.close(fd)
        Path(tmp_header).write_bytes(header_bytes)
        launches = resources.flash_launches(tmp_lib, cfg, Path(tmp_header))
        os.chmod(tmp_lib, normal_mode(executable=True))  # mkstemp's 0600: a server's account could not load it
        os.chmod(tmp_header, normal_mode())
        raise_if_stopped()  # a stop that library code swallowed: the build is not put in place
        with signals_deferred():  # the library and the header it binds with are put in place together
            os.replace(tmp_header, folder / cabi.HEADER_BESIDE)
            os.replace(tmp_lib, lib)
    finally:
        for tmp in (tmp_lib, tmp_header):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    rows = resources.parse_ptxas(text)
    names = resources.demangle(sorted({r.kernel for r in rows}))
    for r in rows:
        r.kernel = names.get(r.kernel, r.kernel)
    rows.sort(key=lambda r: (r.kernel, int(r.arch[3:].rstrip("a"))))
    embedded = resources.embedded_archs(lib, find_cuobjdump(nvcc))
    per_kernel = [asdict(r) for r in rows]
    res = BuildResult(library=lib, folder=folder, cached=False, key=key, build_info=info, resources=per_kernel,
                      embedded=embedded, problems=resources.gate_problems(per_kernel, launches, embedded, cfg, lib),
                      seconds=round(time.time() - t0, 1), launches=launches)
    _write_record(record, res, cfg)
    if not variant:
        _point_latest(cfg, res)
    return res



def _header_beside_is(folder: Path, info: dict) -> bool:
    """Whether the build folder holds the header its library was built from (cabi.library_contract binds with it)."""
    beside = folder / cabi.HEADER_BESIDE
    try:
        return beside.is_file() and hashlib.sha256(beside.read_bytes()).hexdigest() == cabi.header_sha256_of(info)
    except OSError:
        return False


def _write_record(record: Path, res: BuildResult, cfg: BuildConfig) -> None:
    doc = {k: v for k, v in res.to_dict().items() if k not in ("library", "folder", "cached", "seconds")}
    atomic_write_bytes(record, json.dumps({**doc, "gate": resources.gate_settings(cfg)}, indent=2).encode())


def runs_on(archs, gpu_arch: str) -> bool:
    """Whether a library built for `archs` has machine code for a GPU of `gpu_arch` (sm_90): its own arch, or the
    arch-specific form of it (sm_90a: sm_90's code and the features of that GPU alone, such as wgmma)."""
    return gpu_arch in archs or f"{gpu_arch}a" in archs


def build_arch_for(gpu_arch: str) -> str:
    """The arch a build for one GPU of `gpu_arch` targets: the arch-specific form (sm_90a for an sm_90 GPU) where
    build.yaml's archs name it, as the default library then runs kernels only that form holds (the flash call's wgmma
    kernel, docs/kernels.md), so a one-GPU build, a KERNEL@REF base and a field report run what `kdev build` ships;
    else the GPU's own arch."""
    try:
        archs = load_build(None).default_archs
    except KdevError:
        return gpu_arch
    return f"{gpu_arch}a" if f"{gpu_arch}a" in archs else gpu_arch


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
            data = json.dumps(doc, indent=2).encode()
            try:
                unchanged = path.read_bytes() == data
            except OSError:
                unchanged = False
            if not unchanged:  # a read-only checkout whose build is current writes nothing, and goes on
                atomic_write_bytes(path, data)
            continue
        named = read_json_record(path, ("library",))
        if named is not None and Path(named["library"]) == res.library:
            path.unlink(missing_ok=True)


def library_file(library: Path) -> Path:
    """A build folder stands for the library in it."""
    return library / LIB_NAME if library.is_dir() and (library / LIB_NAME).is_file() else library


def missing_default_library() -> str:
    """What to say where the default library is wanted and none is built: a one-arch build (--arch) is not it."""
    try:
        archs = ", ".join(load_build(None).default_archs)
    except KdevError:
        archs = "build.yaml's archs"
    return f"no library of {archs} built (build/latest.json): run 'kdev build' (an --arch build is not the default)"


def latest_library(output_dir: Path | None = None, archs=None) -> Path | None:
    """The library the last successful `kdev build` of build.yaml's archs produced, or of `archs` where named
    (KDEV_LIB overrides)."""
    env = os.environ.get("KDEV_LIB")
    if env:
        return Path(env)
    out = output_dir or (WORK_ROOT / "build")
    f = out / (latest_record(archs) if archs else LATEST)
    record = read_json_record(f, ("library",))
    if record is None or not isinstance(record["library"], str):
        return None
    lib = Path(record["library"])
    return lib if lib.is_file() else None
