"""kdev deploy-check probes: "is what I am about to deploy exactly what was built and verified, and is the
machine fit to take it?"

Each probe gives pass / warn / fail with a one-line reason (and details). Probes read one repository
(--repo), so the same checks run against a checkout that is not the current directory. The GPU probes go
through an NVML layer that tests replace with a fake; production uses nvidia-ml-py.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kdev import cabi, registry
from kdev.config import _arch_ok, YamlReader, load_yaml
from kdev.errors import BadInput
from kdev.fsutil import read_json_record

PASS, WARN, FAIL = "pass", "warn", "fail"
WATCHED_DIRS = ("kernels/", "kdev/", "configs/", "vectors/")


@dataclass
class Probe:
    name: str
    status: str
    reason: str
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DeployConfig:
    target_arch: str
    required_suites: tuple
    required_kernels: tuple
    proxy_kernels: tuple  # run off the target arch, the code path the target runs (flash-portable for sm_120)
    memory_headroom_gib: float
    max_ledger_age_days: float


def load_deploy(repo: Path, target: str | None = None) -> DeployConfig:
    path = repo / "configs" / "deploy.yaml"
    data = load_yaml(path) if path.is_file() else {}
    r = YamlReader(data or {}, path, "")
    configured_target = r.get("target_arch", str, "sm_120", check=_arch_ok, check_msg="an arch like sm_120")
    if target is not None and not _arch_ok(target):
        raise BadInput(f"--target: {target!r} is not an arch like sm_120")
    cfg = DeployConfig(
        target_arch=target or configured_target,
        required_suites=tuple(r.get("required_suites", list, ["smoke"])),
        required_kernels=tuple(r.get("required_kernels", list, [registry.ORACLE, registry.HOPPER])),
        proxy_kernels=tuple(r.get("proxy_kernels", list, [registry.PORTABLE])),
        memory_headroom_gib=r.get("memory_headroom_gib", float, 8.0),
        max_ledger_age_days=r.get("max_ledger_age_days", float, 14.0))
    r.done()
    return cfg


def _git(repo: Path, *args) -> str | None:
    """git's output as text, read as bytes: a checkout whose path is not UTF-8 (a folder named with byte 0xE9) gets
    that path back from rev-parse, and a commit subject may be in another encoding; such bytes show as U+FFFD instead
    of ending the check in a UnicodeDecodeError."""
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True)
    return r.stdout.decode("utf-8", errors="replace").rstrip("\n") if r.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ git
def probe_git(repo: Path) -> Probe:
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is None:
        return Probe("git", FAIL, f"{repo} is not inside a git repository")
    branch = _git(repo, "rev-parse", "--abbrev-ref", "HEAD") or "?"
    head = _git(repo, "rev-parse", "HEAD")
    log = (_git(repo, "log", "-5", "--format=%h %ad %s", "--date=short") or "").splitlines()
    status = (_git(repo, "status", "--porcelain", "--untracked-files=all") or "").splitlines()
    watched, other = [], []
    for line in status:
        path = line[3:].split(" -> ")[-1]
        (watched if path.startswith(WATCHED_DIRS) else other).append(f"{line[:2].strip() or '?'} {path}")
    details = {"branch": branch, "head": head, "last_commits": log, "dirty": watched, "dirty_elsewhere": other}
    upstream = _git(repo, "rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{u}")
    ahead_behind = None
    if upstream:
        counts = _git(repo, "rev-list", "--left-right", "--count", f"{upstream}...HEAD")
        if counts:
            behind, ahead = map(int, counts.split())
            ahead_behind = (ahead, behind)
            details.update(upstream=upstream, ahead=ahead, behind=behind)
    if head is None:
        return Probe("git", FAIL, "no commits yet", details)
    if watched:
        shown = ", ".join(watched[:4]) + (f" (+{len(watched) - 4} more)" if len(watched) > 4 else "")
        return Probe("git", FAIL, f"uncommitted changes: {shown}", details)
    where = f"{branch} @ {head[:12]}"
    if ahead_behind and any(ahead_behind):
        return Probe("git", WARN, f"{where}: {ahead_behind[0]} ahead, {ahead_behind[1]} behind {upstream}", details)
    if other:
        return Probe("git", WARN, f"{where}: clean kernels/kdev/configs/vectors, {len(other)} other change(s)", details)
    return Probe("git", PASS, f"{where}, clean" + (f", in sync with {upstream}" if upstream else ""), details)


# ---------------------------------------------------------------------------------------------- build
def library_info(repo: Path) -> tuple[Path | None, dict | None, str]:
    """(library path, embedded build info, problem) for the repo's last successful build."""
    latest = repo / "build" / "latest.json"
    if not latest.is_file():
        return None, None, "no library built (build/latest.json missing): run 'kdev build'"
    record = read_json_record(latest, ("library",))
    if record is None or not isinstance(record["library"], str):
        return None, None, f"{latest} is damaged (no library path in it): run 'kdev build'"
    lib = Path(record["library"])
    if not lib.is_file():
        return lib, None, f"{lib} is missing: run 'kdev build'"
    try:
        return lib, cabi.build_info(cabi.load(lib)), ""
    except (cabi.LoadError, AttributeError, ValueError) as e:
        return lib, None, f"{lib}: cannot read its build info: {e}"


def probe_build(repo: Path, target_arch: str, local_archs: list[str]) -> Probe:
    from kdev import build as kbuild

    lib, info, problem = library_info(repo)
    if info is None:
        return Probe("build provenance", FAIL, problem)
    kdir = repo / "kernels"
    now = kbuild.source_hashes(kdir)
    built = info.get("sources", {})
    changed = sorted(f for f in set(now) | set(built) if now.get(f) != built.get(f))
    details = {"library": str(lib), "build_info": info, "changed_sources": changed}
    if info.get("source_hash") != kbuild.source_hash(kdir):
        return Probe("build provenance", FAIL, f"kernel sources changed since the build: {', '.join(changed) or '?'}",
                     details)
    sass = info.get("archs", [])
    need = sorted(set(local_archs) | {target_arch})
    missing = [a for a in need if not kbuild.runs_on(sass, a)]
    if missing:
        return Probe("build provenance", FAIL, f"library has no SASS for {', '.join(missing)} (built for "
                     f"{', '.join(sass)})", details)
    head = _git(repo, "rev-parse", "HEAD")
    notes = []
    if info.get("git_sha") != head:
        notes.append(f"built at {str(info.get('git_sha'))[:12]}, HEAD is {str(head)[:12]} (same kernel sources)")
    if info.get("git_dirty"):
        notes.append("built from a dirty tree (same kernel sources as now)")
    if notes:
        return Probe("build provenance", WARN, "; ".join(notes), details)
    return Probe("build provenance", PASS, f"{lib.name}: sources {info['source_hash'][:12]} at HEAD, "
                 f"archs {', '.join(sass)}", details)


# -------------------------------------------------------------------------------------------- vectors
def probe_vectors(repo: Path, suites: tuple) -> Probe:
    from kdev import vectors
    from kdev.errors import KdevError

    from kdev import config

    problems, ok = [], []
    for name in suites:
        try:
            s = vectors.open_suite(name, root=repo / "vectors")
            s.check_integrity()
            configured = config.load_suites(repo / "configs" / "suites.yaml")
            if name in configured:
                problems += [f"{name}: {d}" for d in s.config_drift(configured[name])]
            ok.append(f"{name} ({len(s.cases)} cases)")
        except KdevError as e:
            problems.append(str(e))
    if problems:
        return Probe("vectors", FAIL, problems[0], {"problems": problems})
    return Probe("vectors", PASS, f"intact and current: {', '.join(ok)}")


# --------------------------------------------------------------------------------------------- ledger
# deploy-check reads the newest records only: its time stays bounded however long the ledger grows (`kdev clean`
# prunes it), and a passing verify of the current sources is among the newest of any working ledger
LEDGER_WINDOW = 2000


def _covers(r: dict, src: str, cfg: DeployConfig) -> bool:
    """A passing verify of these sources on a required suite, with every required kernel passing."""
    k = r.get("kernels", {})
    return bool(r.get("passed") and r.get("kind") == "suite" and r.get("source_hash") == src
                and r.get("suite", {}).get("name") in cfg.required_suites
                and all(k.get(n, {}).get("passed") for n in cfg.required_kernels))


def probe_ledger(repo: Path, cfg: DeployConfig, ledger: Path | None = None, now=None) -> Probe:
    from kdev import build as kbuild
    from kdev.ledger import read_records

    src = kbuild.source_hash(repo / "kernels")
    records = read_records(ledger or repo / ".kdev" / "ledger", newest=LEDGER_WINDOW)
    now = now or _dt.datetime.now(_dt.timezone.utc)

    good = [r for r in records if _covers(r, src, cfg)]
    missing_suites = [s for s in cfg.required_suites if not any(r["suite"]["name"] == s for r in good)]
    if missing_suites and not good:
        n_src = sum(r.get("source_hash") == src for r in records)
        return Probe("ledger", FAIL, f"no passing 'kdev verify' of sources {src[:12]} for suites "
                     f"{', '.join(missing_suites)} with kernels {', '.join(cfg.required_kernels)} "
                     f"({len(records)} newest record(s), {n_src} for these sources)")
    on_target = [r for r in good if r.get("gpu", {}).get("arch") == cfg.target_arch]
    newest = max(on_target or good, key=lambda r: r["timestamp"])
    age = now - _dt.datetime.fromisoformat(newest["timestamp"])
    age_s = f"{age.total_seconds() / 3600:.1f} h ago" if age.days < 2 else f"{age.days} days ago"
    details = {"record": newest.get("_file"), "gpu": newest.get("gpu"), "age_hours": age.total_seconds() / 3600}
    if missing_suites:
        return Probe("ledger", FAIL, f"no passing verify for suites {', '.join(missing_suites)}", details)
    where = f"{newest['gpu'].get('name')} ({newest['gpu'].get('arch')})"
    if not on_target:
        # Another GPU's verify says something about the target only where it ran the target's code path (on an H200 the
        # flash call takes kernels that sm_120 cannot hold): without the proxy kernels, the target's kernels never ran.
        archs = ", ".join(sorted({r["gpu"].get("arch") for r in good}))
        proxy = ", ".join(cfg.proxy_kernels)
        def proxy_passed(r: dict) -> bool:
            return all(r.get("kernels", {}).get(n, {}).get("passed") for n in cfg.proxy_kernels)

        if not any(proxy_passed(r) for r in good):
            return Probe("ledger", FAIL, f"verified only on {archs} ({where}, {age_s}) and not with {proxy}: the "
                         f"{cfg.target_arch} code path never ran ('kdev verify --kernel "
                         f"{','.join((*cfg.required_kernels, *cfg.proxy_kernels))}')", details)
        # a proxy run (of these sources, any suite or fuzz run) that also took the target's split plan (kdev verify
        # --plan-gpu) covers the target's grids too
        planned = sorted({f"{r['plan']['gpu']}, {r['plan']['sms']} SMs" for r in records
                          if r.get("passed") and r.get("source_hash") == src and proxy_passed(r)
                          and (r.get("plan") or {}).get("arch") == cfg.target_arch})
        plan_note = (f" and the {cfg.target_arch} split plan ({'; '.join(planned)})" if planned else
                     f"; not yet with a {cfg.target_arch} GPU's split plan ('kdev verify --kernel {proxy} "
                     f"--plan-gpu ...')")
        return Probe("ledger", WARN, f"verified only on {archs} ({where}, {age_s}), with {proxy} (the "
                     f"{cfg.target_arch} code path){plan_note} passing there; no passing verify on the target", details)
    if age.days > cfg.max_ledger_age_days:
        return Probe("ledger", WARN, f"last passing verify on {where} is {age_s}", details)
    return Probe("ledger", PASS, f"verified on {where}, {age_s}", details)


# ----------------------------------------------------------------------------------------------- GPUs
def _call(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:
        return default


def _s(x):
    return x.decode() if isinstance(x, bytes) else x


def why_no_nvml() -> str:
    """Why gpu.load_nvml() gave None: nvidia-ml-py is not installed, or it is and NVML did not start (no driver, or
    one it cannot talk to), with NVML's own words."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return f"NVML did not start ({type(e).__name__}: {e}; no NVIDIA driver here?)"
    pynvml.nvmlShutdown()
    return "NVML did not start"


def probe_gpus(nvml, headroom_gib: float, require_gpu: bool) -> list[Probe]:
    """One probe per GPU. nvml is pynvml (or a fake with the same functions), or None."""
    missing = FAIL if require_gpu else WARN
    if nvml is None:
        return [Probe("gpu", missing, f"{why_no_nvml()}: GPU state not checked")]
    count = _call(nvml.nvmlDeviceGetCount, default=0)
    if not count:
        return [Probe("gpu", missing, "no GPU found by NVML")]
    driver = _s(_call(nvml.nvmlSystemGetDriverVersion, default="?"))
    probes = []
    for i in range(count):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        name = _s(_call(nvml.nvmlDeviceGetName, h, default="?"))
        cc = _call(nvml.nvmlDeviceGetCudaComputeCapability, h)
        arch = f"sm_{cc[0]}{cc[1]}" if cc else "?"
        mem = _call(nvml.nvmlDeviceGetMemoryInfo, h)
        procs = _call(nvml.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
        ecc = _call(nvml.nvmlDeviceGetTotalEccErrors, h, getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                    getattr(nvml, "NVML_VOLATILE_ECC", 0))
        retired_pending = _call(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        remap = _call(nvml.nvmlDeviceGetRemappedRows, h)  # (corrected, uncorrected, pending, failure)
        reasons = _call(nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is None:
            reasons = _call(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, h, default=0)
        persistence = _call(nvml.nvmlDeviceGetPersistenceMode, h)
        bad_reasons = [n for n, bit in (("sw-power-cap", 0x4), ("hw-slowdown", 0x8), ("sw-thermal", 0x20),
                                         ("hw-thermal", 0x40), ("hw-power-brake", 0x80)) if reasons and reasons & bit]
        free_gib = mem.free / 2**30 if mem else None
        details = {"index": i, "name": name, "arch": arch, "driver": driver,
                   "memory_free_gib": free_gib, "memory_total_gib": mem.total / 2**30 if mem else None,
                   "compute_processes": len(procs), "uncorrected_ecc": ecc, "retired_pages_pending": retired_pending,
                   "remapped_rows": list(remap) if remap else None, "clock_event_reasons": bad_reasons,
                   "persistence_mode": persistence}
        fails, warns = [], []
        if ecc:
            fails.append(f"{ecc} uncorrected ECC error(s)")
        if retired_pending:
            fails.append("retired pages pending (reset needed)")
        if remap and (remap[2] or remap[3]):
            fails.append("row remapping pending or failed")
        if free_gib is not None and free_gib < headroom_gib:
            fails.append(f"{free_gib:.1f} GiB free < {headroom_gib:g} GiB headroom")
        if bad_reasons:
            warns.append("clocks held back: " + ", ".join(bad_reasons))
        if procs:
            warns.append(f"{len(procs)} compute process(es) running")
        if persistence == 0:
            warns.append("persistence mode off")
        head = f"GPU {i} {name} ({arch}), driver {driver}"
        status = FAIL if fails else WARN if warns else PASS
        tail = "; ".join(fails + warns) or (f"{free_gib:.0f} GiB free, no ECC errors, clocks free" if free_gib else "ok")
        probes.append(Probe(f"gpu {i}", status, f"{head}: {tail}", details))
    return probes


# ---------------------------------------------------------------------------------------- every GPU
def probe_fleet(repo: Path, cfg: DeployConfig, gpus: list, allow_mixed: bool, ledger: Path | None = None) -> list[Probe]:
    """With several GPUs (kdev/fleet.py): are they alike, and has each, by its UUID, a passing verify of this build (its
    sources and its library's bytes) and no fault (uncorrected ECC errors, a row remap pending or failed, clocks held
    back by heat or a hardware slowdown)?"""
    import hashlib

    from kdev import build as kbuild
    from kdev import fleet
    from kdev.ledger import read_records

    src = kbuild.source_hash(repo / "kernels")
    lib, info, problem = library_info(repo)
    lib_sha = hashlib.sha256(lib.read_bytes()).hexdigest() if info is not None else None
    records = read_records(ledger or repo / ".kdev" / "ledger", newest=LEDGER_WINDOW)
    differ = fleet.mixed(gpus)
    if not differ:
        probes = [Probe("gpus alike", PASS, f"{len(gpus)} x {gpus[0].name}, driver {gpus[0].driver}")]
    elif allow_mixed:
        probes = [Probe("gpus alike", WARN, "; ".join(differ) + " (--allow-mixed)")]
    else:
        probes = [Probe("gpus alike", FAIL, "; ".join(differ) + " (--allow-mixed deploys anyway)")]
    for g in gpus:
        mine = [r for r in records if fleet.same_uuid((r.get("gpu") or {}).get("uuid"), g.uuid)]
        passing = [r for r in mine if _covers(r, src, cfg)]
        problems = []
        if lib_sha is None:
            problems.append(problem)
        elif not any(r.get("library_sha256") == lib_sha for r in passing):
            if passing:
                other = passing[-1].get("library_sha256") or "?"
                problems.append(f"its passing verify ran library {other[:12]}, this build's is {lib_sha[:12]}")
            elif mine and mine[-1].get("source_hash") == src and not mine[-1].get("passed"):
                why = (mine[-1].get("failures") or [{}])[0].get("reason") or "failed"
                problems.append(f"its last verify of this build failed: {why}")
            else:
                problems.append(f"no passing verify of this build on it ('kdev verify --gpus {g.position}')")
        problems += g.health_problems()
        ecc = {"on": "ECC on", "off": "ECC off (the card reports no ECC protection)", None: "no ECC mode reported"}[
            g.ecc_mode]
        details = {"gpu": {k: v for k, v in g.__dict__.items()}, "library_sha256": lib_sha, "rows": len(mine)}
        tail = "; ".join(problems) if problems else f"verified with this build; {ecc}"
        probes.append(Probe(f"gpu {g.uuid[:12]}", FAIL if problems else PASS, f"{g.label}: {tail}", details))
    return probes


# ------------------------------------------------------------------------------------------ toolchain
def probe_toolchain(repo: Path) -> Probe:
    from kdev import build as kbuild
    from kdev.errors import EnvironmentMissing

    _, info, _ = library_info(repo)
    try:
        ver = kbuild.nvcc_version(kbuild.find_nvcc())
    except EnvironmentMissing:
        return Probe("toolchain", WARN, "nvcc not found: cannot compare with the build's nvcc")
    built = info.get("nvcc_version") if info else None
    if built is None:
        return Probe("toolchain", WARN, f"nvcc {ver}; no build info to compare with")
    if built != ver:
        return Probe("toolchain", WARN, f"nvcc {ver} here, library built with {built}")
    return Probe("toolchain", PASS, f"nvcc {ver}, as in the build")


def run_checks(repo: Path, target: str | None = None, require_gpu: bool = False, nvml=None,
               ledger: Path | None = None, gpus: list | None = None,
               allow_mixed: bool = False) -> tuple[list[Probe], DeployConfig]:
    from kdev import gpu

    import os

    repo = Path(repo).resolve()
    ledger = ledger or (Path(os.environ["KDEV_LEDGER"]) if os.environ.get("KDEV_LEDGER") else None)
    cfg = load_deploy(repo, target)
    nv = nvml if nvml is not None else gpu.load_nvml()
    gpu_probes = probe_gpus(nv, cfg.memory_headroom_gib, require_gpu)
    local_archs = sorted({p.details["arch"] for p in gpu_probes if p.details.get("arch", "?") != "?"})
    probes = [probe_git(repo), probe_build(repo, cfg.target_arch, local_archs), probe_vectors(repo, cfg.required_suites),
              probe_ledger(repo, cfg, ledger), *gpu_probes, probe_toolchain(repo)]
    if gpus:
        probes += probe_fleet(repo, cfg, gpus, allow_mixed, ledger)
    return probes, cfg
