"""kdev field-report: one command a user with any GPU runs, and one JSON file to send back.

It builds the library `kdev build` would make for this GPU's arch (sm_90a on Hopper), verifies the smoke suite and a
fuzz run, runs the sanitizers on three smoke cases of the flash kernels, measures the ceilings (the mma.sync peak and
every rung of the flash loop ladder: the shared memory, copy and L2 rungs), and times the bench targets at page sizes 1
and 64, sampling NVML's SM clock, power, power limit, temperature and clock-event reasons all along. Each step is
`python -m kdev ...` in a process of its own (a fault in one does not take the others), its JSON document kept whole; a
step that fails is recorded with its exit code and the last lines it wrote. `kdev plan --project --calibrate FILE` takes
the file as a calibration point (docs/projection.md).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kdev import build as kbuild
from kdev import gpu as kgpu
from kdev import registry
from kdev.errors import BadInput, EnvironmentMissing
from kdev.fsutil import atomic_write_bytes

KIND, VERSION = "kdev-field-report", 1
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
# The smoke cases the sanitizers run: the tensor-copy path with a tree (ddtree-n16), a ragged batch with the narrow
# tiles and the combine (ragged-ddtree) and the row gathers of page size 1 (ragged-random-p1). The whole suite under
# racecheck takes minutes (200 s on an H100) and finds nothing these do not reach. scripts/gpu-round.sh asks for them.
SANITIZER_CASES = ("ddtree-n16", "ragged-ddtree", "ragged-random-p1")
SANITIZER_PREFIX = "========="
TAIL_LINES = 20


@dataclass(frozen=True)
class Step:
    name: str  # the report's key for its document
    argv: tuple  # after `python -m kdev` (or the whole command, for a tool in front of it)
    timeout_s: float
    wrapper: tuple = ()  # a tool the step runs under (compute-sanitizer)
    case_list: bool = False  # its document lists every case (a verify run): the report keeps the summary only


def steps(arch: str, fuzz: int, sweep: str, sanitizer: str | None) -> list[Step]:
    """In the order they run: what the projection reads (the ceilings, the bench) before the long checks."""
    out = [Step("build", ("build", "--arch", arch, "--json"), 1800),
           Step("verify", ("verify", "--suite", "smoke", "--json"), 900, case_list=True),
           Step("ceilings", ("bench", "--ceilings", "--json"), 1800),
           Step("bench", ("bench", "--sweep", sweep, "-a", "page_size=1,64", "--backend", ",".join(registry.PRODUCTS.values()),
                          "--json"), 3600),
           Step("fuzz", ("verify", "--fuzz", str(fuzz), "--json"), 3600, case_list=True)]
    if sanitizer:
        cases = tuple(arg for case in SANITIZER_CASES for arg in ("--case", case))
        out += [Step(f"sanitizer-{tool}", ("verify", "--suite", "smoke", *cases, "--kernel", ",".join(registry.PRODUCTS.values()),
                                           "--json"), 1800, (sanitizer, "--tool", tool, "--error-exitcode", "1"),
                     case_list=True)
                for tool in SANITIZER_TOOLS]
    return out


def run_step(step: Step) -> dict:
    """Runs one step; its exit code, seconds, JSON document (None where it printed none) and last stderr lines."""
    cmd = [*step.wrapper, sys.executable, "-m", "kdev", *step.argv]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=step.timeout_s)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, "", f"{e.stderr or ''}\ntimed out after {step.timeout_s:.0f} s"
    except OSError as e:  # the tool in front of it is not there
        rc, out, err = None, "", f"could not start {cmd[0]}: {e.strerror}"
    # compute-sanitizer writes its own lines (each starting with =========) into the same stdout as the document
    tool = [line for line in out.splitlines() if line.startswith(SANITIZER_PREFIX)]
    body = "\n".join(line for line in out.splitlines() if not line.startswith(SANITIZER_PREFIX))
    try:
        doc = json.loads(body) if body.strip() else None
    except ValueError:
        doc = None
    if step.case_list and isinstance(doc, dict):
        doc.pop("results", None)  # megabytes for a fuzz run: the summary and failures stay (a bench's rows are kept:
        #                           they are what kdev plan --project calibrates against)
    result = {"name": step.name, "command": " ".join(cmd), "rc": rc, "seconds": round(time.monotonic() - t0, 1),
              "doc": doc, "tail": [] if rc == 0 else (err or "").strip().splitlines()[-TAIL_LINES:]}
    if step.wrapper:
        result["sanitizer"] = [line.removeprefix(SANITIZER_PREFIX).strip() for line in tool][-TAIL_LINES:]
    return result


class NvmlSampler:
    """NVML's view of the GPU every `interval` seconds on a thread of its own, while the steps run."""

    def __init__(self, nvml, handle, interval: float = 0.2):
        self.nvml, self.handle, self.interval = nvml, handle, interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict:
        n, h = self.nvml, self.handle

        def read(fn, *args):
            try:
                return fn(h, *args)
            except Exception:
                return None

        clocks = kgpu.sm_clock_mhz(n, h)
        power, limit = read(n.nvmlDeviceGetPowerUsage), read(n.nvmlDeviceGetEnforcedPowerLimit)
        return {"t": round(time.monotonic(), 3), "sm_clock_mhz": clocks[0] if clocks else None,
                "power_w": power / 1000 if power is not None else None,
                "power_limit_w": limit / 1000 if limit is not None else None,
                "temperature_c": read(n.nvmlDeviceGetTemperature, getattr(n, "NVML_TEMPERATURE_GPU", 0)),
                "clock_events": kgpu.throttle_reasons(n, h)}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "NvmlSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def summarize(samples: list[dict]) -> dict:
    def values(key):
        return sorted(s[key] for s in samples if s.get(key) is not None)

    def stats(key):
        v = values(key)
        return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]} if v else None

    events = sorted({e for s in samples for e in s.get("clock_events") or []})
    return {"samples": len(samples), "sm_clock_mhz": stats("sm_clock_mhz"), "power_w": stats("power_w"),
            "power_limit_w": stats("power_limit_w"), "temperature_c": stats("temperature_c"), "clock_events": events}


def identify(nvml) -> tuple[dict, object]:
    """This GPU (the first the process sees) by NVML: name, arch, UUID, driver, memory, max SM clock, power limit."""
    if nvml is None:
        raise EnvironmentMissing("field-report: no NVIDIA driver (NVML) here: it runs on a machine with the GPU")
    try:
        if nvml.nvmlDeviceGetCount() < 1:
            raise EnvironmentMissing("field-report: NVML sees no GPU")
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
        clocks = kgpu.sm_clock_mhz(nvml, h)
        ident = {"name": kgpu._s(nvml.nvmlDeviceGetName(h)), "arch": f"sm_{major}{minor}",
                 "uuid": kgpu._s(nvml.nvmlDeviceGetUUID(h)), "driver": kgpu._s(nvml.nvmlSystemGetDriverVersion()),
                 "memory_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                 "max_sm_clock_mhz": clocks[1] if clocks else None}
    except EnvironmentMissing:
        raise
    except Exception as e:  # an NVML that answers nothing useful
        raise EnvironmentMissing(f"field-report: NVML could not describe GPU 0: {e}") from None
    try:
        ident["power_limit_w"] = nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
    except Exception:
        ident["power_limit_w"] = None
    return ident, h


def collect(out: Path, fuzz: int = 200, sweep: str = "targets", force: bool = False, nvml=None,
            runner=None, progress=lambda step, result: None) -> dict:
    """Runs every step and writes the report to `out` (atomically; an existing file only with force)."""
    if out.exists() and not force:
        raise BadInput(f"{out} exists: name another file, or --force to replace it")
    if fuzz < 1:
        raise BadInput(f"--fuzz {fuzz}: a field report verifies one fuzz case at least")
    nvml = nvml if nvml is not None else kgpu.load_nvml()
    runner = runner or run_step
    ident, handle = identify(nvml)
    sanitizer = shutil.which("compute-sanitizer")
    doc = {"kind": KIND, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "gpu": ident, "steps": []}
    if sanitizer is None:
        doc["steps"].append({"name": "sanitizer", "command": "compute-sanitizer", "rc": None, "seconds": 0,
                             "tail": ["compute-sanitizer not found on PATH: the sanitizers did not run"]})
    out.parent.mkdir(parents=True, exist_ok=True)
    with NvmlSampler(nvml, handle) as sampler:
        # the file is rewritten after every step, `complete` false until the last: a report cut short keeps its steps
        # the build `kdev build` would make for this GPU (sm_90a on Hopper: the flash call by wgmma)
        for step in steps(kbuild.build_arch_for(ident["arch"]), fuzz, sweep, sanitizer):
            result = runner(step)
            progress(step, result)
            doc[step.name] = result.pop("doc")
            doc["steps"].append(result)
            _write(out, doc, sampler, complete=False)
    _write(out, doc, sampler, complete=True)
    return doc


def _write(out: Path, doc: dict, sampler: NvmlSampler, complete: bool) -> None:
    doc["complete"] = complete
    doc["nvml"] = summarize(list(sampler.samples))
    doc["nvml"]["interval_s"] = sampler.interval
    atomic_write_bytes(out, (json.dumps(doc, indent=1) + "\n").encode())


def failed_steps(doc: dict) -> list[dict]:
    return [s for s in doc["steps"] if s["rc"] != 0]
