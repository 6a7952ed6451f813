"""The measurement: cold-L2 samples timed with CUDA events behind a spin kernel (or a CUDA-graph replay), stopped on
a noise target or a time limit, throttled samples dropped."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from kdev.bench.sweeps import Method


# ----------------------------------------------------------------------------------------- measurement
@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    rel_sem: float  # standard error of the mean over the median
    dropped_throttled: int
    stop: str  # "spread", "time", "max-samples"
    sm_clock_mhz: list = field(default_factory=list)  # [min, max] seen during samples


# A launch through ctypes costs the host tens of microseconds. Were the GPU idle when `start` is recorded, a
# microsecond kernel's sample would time the host's launch path instead of the kernel: a spin kernel of
# ~100 µs queued before `start` keeps the GPU busy until the launch is queued behind it.
HOST_COVER_CYCLES = 200_000


def capture_graph(run):
    """One call of `run` captured into a CUDA graph (after it has run eagerly: lazy set-up stays out of it);
    returns the graph's replay, which launches the same kernels on the same buffers on the current stream."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph.replay


def measure(run, method: Method, flush, nvml=None, handle=None, before_sample=None) -> Timing:
    """Cold-L2 samples timed with CUDA events around one call each (method.graph: around the replay of a CUDA
    graph holding one call). before_sample (outputs poisoned, say) runs before the flush, outside the timed region."""
    import torch

    from kdev import gpu

    t_start = time.time()
    for _ in range(method.warmup):
        run()
    torch.cuda.synchronize()
    if method.graph:
        run = capture_graph(run)
    samples, dropped, clocks = [], 0, []
    stop = "max-samples"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu_sleep = getattr(torch.cuda, "_sleep", None)
    while len(samples) < method.max_samples:
        if before_sample is not None:
            before_sample()
        flush.add_(1)  # touches 2x L2 worth of bytes: nothing of the inputs survives in L2
        if gpu_sleep is not None:  # the GPU is still busy when the host records start and launches
            gpu_sleep(HOST_COVER_CYCLES)
        start.record()
        run()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if nvml is not None and handle is not None:
            if gpu.throttle_reasons(nvml, handle):
                dropped += 1
                if dropped > 4 * method.max_samples:
                    stop = "throttled"
                    break
                continue
            c = gpu.sm_clock_mhz(nvml, handle)
            if c:
                clocks.append(c[0])
        samples.append(ms * 1e3)
        n = len(samples)
        if n >= method.min_samples:
            med = float(np.median(samples))
            sem = float(np.std(samples, ddof=1) / math.sqrt(n))
            if sem <= method.target_rel_spread * med:
                stop = "spread"
                break
        if time.time() - t_start > method.max_seconds and n >= 3:
            stop = "time"
            break
    a = np.array(samples) if samples else np.array([float("nan")])
    med = float(np.median(a))
    sem = float(np.std(a, ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")
    return Timing(med, float(np.percentile(a, 10)), float(np.percentile(a, 90)), len(samples),
                  sem / med if med else float("nan"), dropped, stop, [min(clocks), max(clocks)] if clocks else [])
