"""Every GPU of the host: `--gpus` on verify, bench and deploy-check.

A GPU is named by its UUID, never by an index: CUDA numbers the GPUs it sees fastest first unless CUDA_DEVICE_ORDER says
otherwise, NVML numbers them by PCI bus, and CUDA_VISIBLE_DEVICES renumbers them again. So `--gpus 0,2` means positions
in the list this process sees through CUDA (torch's cuda:0, cuda:2), resolved once to UUIDs by a probe process; `--gpus
GPU-...` names one by UUID; `--gpus all` (the default) is every GPU the process sees. Each worker is `python -m kdev
COMMAND ... --json` in a process of its own with CUDA_VISIBLE_DEVICES set to its GPU's UUID, all running at once; the
parent gathers their documents, one progress line per GPU. A worker that exits without a document (OOM, an Xid, a
kill) or runs past the timeout is a failed row for its GPU, with the reason; the others finish. verify's ledger has one
writer: the parent, one record per GPU (the workers write none).

The device layer (which GPUs there are, how a worker starts) is an object the tests replace with fakes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kdev import gpu as kgpu
from kdev.errors import BadInput, EnvironmentMissing

WORKER_ENV = "KDEV_FLEET_WORKER"  # set in a worker: it runs on its one GPU and writes no ledger record
TAIL_LINES = 12
# clock-event reasons that say a card is held back by a fault, not by its configured power cap or by idling
HARMFUL_CLOCK_EVENTS = {"HwSlowdown": 0x8, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40,
                        "HwPowerBrakeSlowdown": 0x80}


@dataclass
class GpuState:
    """One GPU as NVML describes it, keyed by UUID."""

    position: int  # in the list this process sees through CUDA
    uuid: str
    name: str = "?"
    arch: str = "?"
    memory_total_gib: float | None = None
    driver: str | None = None
    ecc_mode: str | None = None  # "on", "off", or None where the card has no ECC mode to report
    ecc_uncorrected: int | None = None
    remapped_rows: dict | None = None  # correctable, uncorrectable, pending, failure
    clock_events: list = field(default_factory=list)  # harmful ones only

    @property
    def label(self) -> str:
        return f"GPU {self.position} {self.name} ({self.uuid[:12]})"

    def health_problems(self) -> list[str]:
        out = []
        if self.ecc_uncorrected:
            out.append(f"{self.ecc_uncorrected} uncorrected ECC error(s)")
        r = self.remapped_rows or {}
        if r.get("pending") or r.get("failure"):
            out.append("row remapping " + ("failed" if r.get("failure") else "pending (a reset is needed)"))
        if self.clock_events:
            out.append("clocks held back: " + ", ".join(self.clock_events))
        return out


def _uuid_key(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-")


def same_uuid(a: str | None, b: str | None) -> bool:
    """NVML writes GPU-xxxxxxxx-..., torch the bare UUID: the same GPU either way."""
    return bool(a and b) and _uuid_key(a) == _uuid_key(b)


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


def nvml_state(nvml, uuid: str, position: int) -> GpuState:
    """What NVML says of the GPU with this UUID (the fields it cannot answer stay None)."""
    st = GpuState(position, uuid)
    if nvml is None:
        return st
    h = _call(nvml.nvmlDeviceGetHandleByUUID, uuid)
    if h is None:
        return st
    s = kgpu._s
    st.name = s(_call(nvml.nvmlDeviceGetName, h) or "?")
    cc = _call(nvml.nvmlDeviceGetCudaComputeCapability, h)
    st.arch = f"sm_{cc[0]}{cc[1]}" if cc else "?"
    mem = _call(nvml.nvmlDeviceGetMemoryInfo, h)
    st.memory_total_gib = mem.total / 2**30 if mem else None
    st.driver = s(_call(nvml.nvmlSystemGetDriverVersion) or "?")
    mode = _call(nvml.nvmlDeviceGetEccMode, h)  # (current, pending); raises where the card has no ECC
    st.ecc_mode = None if mode is None else ("on" if mode[0] else "off")
    if st.ecc_mode == "on":
        st.ecc_uncorrected = _call(nvml.nvmlDeviceGetTotalEccErrors, h,
                                   getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                   getattr(nvml, "NVML_VOLATILE_ECC", 0))
    remap = _call(nvml.nvmlDeviceGetRemappedRows, h)  # Ampere and newer; retired pages were the older mechanism
    if remap:
        st.remapped_rows = dict(zip(("correctable", "uncorrectable", "pending", "failure"), map(int, remap)))
    mask = _call(nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
    if mask is None:
        mask = _call(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
    st.clock_events = [n for n, bit in HARMFUL_CLOCK_EVENTS.items() if mask and mask & bit]
    return st


# ------------------------------------------------------------------------------------------- devices
class Devices:
    """The real device layer: the GPUs this process sees through CUDA (by a probe process, so the parent holds no
    CUDA context on any of them), NVML for their state, and workers as subprocesses."""

    PROBE = ("import json, torch\n"
             "print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]))")

    def __init__(self, nvml=None):
        self.nvml = nvml if nvml is not None else kgpu.load_nvml()

    def uuids(self) -> list[str]:
        """UUIDs of the GPUs this process sees, in CUDA's order (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER applied)."""
        r = subprocess.run([sys.executable, "-c", self.PROBE], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise EnvironmentMissing(f"cannot list the GPUs through CUDA: {last}")
        return ["GPU-" + _uuid_key(u) for u in json.loads(r.stdout)]

    def state(self, uuid: str, position: int) -> GpuState:
        return nvml_state(self.nvml, uuid, position)

    def start(self, argv: list[str], uuid: str, stdout, stderr) -> subprocess.Popen:
        """The worker, its output into the files given (a pipe would fill and stop a worker that prints a large
        document while the parent waits for the others)."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid, **{WORKER_ENV: "1"})
        return subprocess.Popen([sys.executable, "-m", "kdev", *argv], stdout=stdout, stderr=stderr, env=env,
                                start_new_session=True)


def select(devices, spec: str | None, uuids: list[str] | None = None) -> list[GpuState]:
    """The GPUs `--gpus` names (all where None), each with its NVML state; `uuids`: the devices' list, where it is
    already at hand (listing them takes a process)."""
    uuids = devices.uuids() if uuids is None else uuids
    if not uuids:
        raise EnvironmentMissing("no CUDA GPU visible to this process")
    spec = (spec or "all").strip()
    if spec == "all":
        picked = list(range(len(uuids)))
    else:
        picked = []
        by_key = {_uuid_key(u): i for i, u in enumerate(uuids)}
        for item in (x.strip() for x in spec.split(",")):
            if item.isdigit() and int(item) < len(uuids):
                i = int(item)
            elif _uuid_key(item) in by_key:
                i = by_key[_uuid_key(item)]
            else:
                raise BadInput(f"--gpus {spec}: {item!r} is neither a position below {len(uuids)} nor the UUID of a GPU "
                               f"this process sees (CUDA_VISIBLE_DEVICES applies)")
            if i in picked:
                raise BadInput(f"--gpus {spec}: GPU {i} named twice")
            picked.append(i)
    return [devices.state(uuids[i], i) for i in picked]


def in_worker() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def failures_root() -> Path | None:
    """Where a fuzz run keeps its failing cases: a worker in a folder of its GPU's own (vectors/fleet/UUID), so that
    workers failing at once never write one suite's manifest together; None elsewhere (the usual place)."""
    if not in_worker():
        return None
    from kdev import vectors

    return vectors.default_vectors_root() / "fleet" / os.environ.get("CUDA_VISIBLE_DEVICES", "unknown")


# --------------------------------------------------------------------------------------------- fan-out
@dataclass
class WorkerResult:
    gpu: GpuState
    rc: int | None  # None: killed past the timeout
    doc: dict | None  # the worker's JSON document
    reason: str  # why it failed ("" when it passed)
    seconds: float

    @property
    def passed(self) -> bool:
        return self.rc == 0 and self.doc is not None

    def to_dict(self) -> dict:
        return {"gpu": asdict(self.gpu), "rc": self.rc, "passed": self.passed, "reason": self.reason,
                "seconds": round(self.seconds, 1), "result": self.doc}


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (OSError, AttributeError):
        proc.kill()


def fan_out(devices, gpus: list[GpuState], argv: list[str], timeout_s: float,
            on_update=lambda gpu, state: None, poll_s: float = 0.2) -> list[WorkerResult]:
    """Runs `kdev ARGV` on every GPU at once and gathers what each gave, in the order of `gpus`."""
    with tempfile.TemporaryDirectory(prefix="kdev-fleet-") as tmp:
        files = {g.uuid: (open(Path(tmp) / f"{g.position}.out", "w+"), open(Path(tmp) / f"{g.position}.err", "w+"))
                 for g in gpus}
        try:
            return _gather(devices, gpus, argv, timeout_s, on_update, poll_s, files)
        finally:
            for out, err in files.values():
                out.close()
                err.close()


def _gather(devices, gpus, argv, timeout_s, on_update, poll_s, files) -> list[WorkerResult]:
    procs = {g.uuid: (g, devices.start(argv, g.uuid, *files[g.uuid]), time.monotonic()) for g in gpus}
    for g in gpus:
        on_update(g, "running")
    done: dict[str, WorkerResult] = {}

    def read(uuid: str) -> tuple[str, str]:
        out, err = files[uuid]
        out.seek(0)
        err.seek(0)
        return out.read(), err.read()

    try:
        while len(done) < len(procs):
            for uuid, (g, p, t0) in procs.items():
                if uuid in done:
                    continue
                elapsed = time.monotonic() - t0
                if p.poll() is None and elapsed < timeout_s:
                    continue
                if p.poll() is None:
                    _kill(p)
                    p.wait()
                    done[uuid] = WorkerResult(g, None, None, f"no answer in {timeout_s:g} s: killed", elapsed)
                else:
                    done[uuid] = _result(g, p.returncode, *read(uuid), elapsed)
                on_update(g, "passed" if done[uuid].passed else f"failed: {done[uuid].reason}")
            if len(done) < len(procs):
                time.sleep(poll_s)
    finally:
        for uuid, (g, p, _) in procs.items():
            if uuid not in done and p.poll() is None:
                _kill(p)
                p.wait()
    return [done[g.uuid] for g in gpus]


def _result(g: GpuState, rc: int, out: str, err: str, seconds: float) -> WorkerResult:
    try:
        doc = json.loads(out) if out and out.strip() else None
    except ValueError:
        doc = None
    if rc == 0 and doc is not None:
        return WorkerResult(g, rc, doc, "", seconds)
    lines = (err or "").strip().splitlines()
    if rc < 0:
        why = f"killed by signal {-rc}" + (" (out of memory?)" if -rc == signal.SIGKILL else "")
    elif doc is None:
        why = f"exit {rc} without a result" + (f": {lines[-1]}" if lines else "")
    else:
        why = f"exit {rc}" + (f": {lines[-1]}" if lines else "")
    return WorkerResult(g, rc, doc, why, seconds)


def mixed(gpus: list[GpuState]) -> list[str]:
    """What differs between the GPUs that a deploy expects to be alike: model and driver."""
    out = []
    for what in ("name", "driver"):
        values = sorted({getattr(g, what) or "?" for g in gpus})
        if len(values) > 1:
            out.append(f"{what}s differ: " + "; ".join(
                f"{v} ({', '.join(str(g.position) for g in gpus if (getattr(g, what) or '?') == v)})" for v in values))
    return out


def devices() -> Devices:
    """The device layer the commands use (tests replace this function)."""
    return Devices()


def plan(spec: str | None) -> list[GpuState] | None:
    """The GPUs a command fans out to, or None where it runs here as on one GPU: inside a worker; without --gpus where
    the process sees one GPU or none (what it has always done); with --gpus where the only GPU there is is the one named."""
    if in_worker():
        if spec:
            raise BadInput(f"--gpus {spec}: a worker runs on the one GPU it was given")
        return None
    if spec is None:
        import torch

        if torch.cuda.device_count() <= 1:
            return None
    layer = devices()
    uuids = layer.uuids()
    gpus = select(layer, spec, uuids)
    return None if len(gpus) == 1 and len(uuids) == 1 else gpus


def prebuild(gpus: list[GpuState], log=None) -> None:
    """The library for each arch among the GPUs, built once here before the workers start (a cache hit when nothing
    changed): workers that each found none would all build it at once."""
    from kdev import build, config
    from kdev.errors import CheckFailed

    for arch in sorted({g.arch for g in gpus if g.arch != "?"}):
        res = build.build(config.load_build(None, [arch]), log=log)
        if res.problems:
            raise CheckFailed(f"kdev build for {arch} failed its resource gate: {res.problems[0]}")


def ledger_record(result: WorkerResult, source_hash: str) -> dict:
    """verify's ledger record for one GPU, written by the parent: the worker's record, or a failed one with the reason
    where the worker gave none. Either is keyed by the GPU's UUID as this process resolved it."""
    from kdev import ledger

    gpu = {"uuid": result.gpu.uuid, "name": result.gpu.name, "arch": result.gpu.arch, "driver": result.gpu.driver,
           "position": result.gpu.position}
    if result.doc is not None:
        rec = {k: v for k, v in result.doc.items() if k not in ("results", "ledger", "saved_failures")}
        rec["gpu"] = {**(rec.get("gpu") or {}), **gpu}
    else:
        rec = {"schema_version": ledger.LEDGER_SCHEMA, "timestamp": ledger.now_iso(), "kind": "worker",
               "source_hash": source_hash, "gpu": gpu, "kernels": {}, "passed": False,
               "failures": [{"case": None, "kernel": None, "against": None, "reason": result.reason}]}
    rec["worker"] = {"rc": result.rc, "reason": result.reason, "seconds": round(result.seconds, 1)}
    return rec


def verify(gpus: list[GpuState], argv: list[str], timeout_s: float, on_update=lambda g, s: None) -> dict:
    """kdev verify on every GPU at once; the parent writes each GPU's ledger record (one writer)."""
    from kdev import build, ledger

    results = fan_out(devices(), gpus, ["verify", *argv, "--json"], timeout_s, on_update)
    src = build.source_hash()
    rows = []
    for r in results:
        row = r.to_dict()
        row["ledger"] = str(ledger.append_record(ledger_record(r, src)))
        rows.append(row)
    return {"gpus": rows, "passed": all(r.passed for r in results)}


def bench(gpus: list[GpuState], argv: list[str], timeout_s: float, on_update=lambda g, s: None,
          slow_above: float = 0.05) -> dict:
    """kdev bench on every GPU at once: each card's medians, and per shape and backend the spread between cards and the
    cards slower than the cards' median by more than `slow_above`."""
    results = fan_out(devices(), gpus, ["bench", *argv, "--json"], timeout_s, on_update)
    times: dict[tuple, dict] = {}
    for r in results:
        for x in (r.doc or {}).get("results", []):
            t = x.get("timing") or {}
            if t.get("median_us"):
                times.setdefault((x["shape"], x["backend"]), {})[r.gpu.uuid] = t["median_us"]
    spread = []
    for (shape, backend), per in times.items():
        v = sorted(per.values())
        mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
        slow = [g.label for g in gpus if per.get(g.uuid, 0) > mid * (1 + slow_above)]
        spread.append({"shape": shape, "backend": backend, "median_us": per, "spread": v[-1] / v[0] - 1,
                       "slow": slow})
    return {"gpus": [r.to_dict() for r in results], "spread": spread, "slow_above": slow_above,
            "passed": all(r.passed for r in results)}
