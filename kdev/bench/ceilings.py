"""This GPU's ceilings: the mma.sync peak, the wgmma peak (a library built for sm_90a), the copy bandwidth and the flash
loop ladder, measured and cached."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kdev import cabi
from kdev.config import WORK_ROOT, load_gpus
from kdev.errors import BadInput
from kdev.fsutil import read_json_record


# --------------------------------------------------------------------------------------------- ceilings
def ceilings_path(gpu_id: dict) -> Path:
    key = (gpu_id.get("uuid") or gpu_id["name"]).replace(" ", "_").replace("/", "_")
    return WORK_ROOT / ".kdev" / "ceilings" / f"{key}.json"


def load_ceilings(gpu_id: dict) -> dict | None:
    """This GPU's cached ceilings (kdev bench --ceilings), else those configs/gpus.yaml holds as measured on a GPU of
    this name, else None."""
    cached = read_json_record(ceilings_path(gpu_id), ("flops", "bytes_per_s"))  # a damaged cache is no cache
    if cached is not None:
        return cached
    known = [g for g in load_gpus().values() if g.name == gpu_id["name"] and g.ceilings_measured]
    return {"flops": known[0].flops, "bytes_per_s": known[0].bytes_per_s,
            "source": known[0].ceilings_source} if known else None


def floor_ceiling(ceilings: dict) -> dict:
    """The tensor ceiling a bench floor is priced at, named: wgmma's where it was measured on this GPU (an sm_90 GPU,
    with a library built for sm_90a: what the Hopper product may use), else mma.sync's."""
    wgmma = ceilings.get("wgmma_flops")
    return {"name": "wgmma", "flops": wgmma} if wgmma else {"name": "mma.sync", "flops": ceilings["flops"]}


def save_ceilings(gpu_id: dict, ceilings: dict) -> Path:
    from kdev.fsutil import atomic_write_bytes

    path = ceilings_path(gpu_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({**ceilings, "gpu": gpu_id}, indent=2).encode())
    return path


def measure_ceilings(lib, device) -> dict:
    """bf16 mma.sync m16n8k16 peak (the library's microbenchmark) and device-to-device copy bandwidth."""
    import ctypes

    import torch

    L = lib.lib
    chains = L.kdtree_bench_mma_chains()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.zeros(256, device=device)
    stream = torch.cuda.current_stream()
    blocks, iters = sms * 8, 4096
    best = 0.0
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        st = L.kdtree_bench_mma_peak(blocks, iters, ctypes.c_void_p(sink.data_ptr()), ctypes.c_void_p(stream.cuda_stream))
        e.record()
        e.synchronize()
        if st != 0:
            raise RuntimeError(f"kdtree_bench_mma_peak: status {st} ({cabi.status_text(st)})")
        flops = blocks * 8 * iters * chains * 4096.0
        best = max(best, flops / (s.elapsed_time(e) / 1e3))
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 0.0
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        bw = max(bw, 2 * n * 2 / (s.elapsed_time(e) / 1e3))
    return {"flops": best, "bytes_per_s": bw, "source": f"kdev bench --ceilings ({time.strftime('%Y-%m-%d')})",
            "wgmma_flops": measure_wgmma_peak(lib, device), "inner_loops": measure_inner_loops(lib, device, best)}


WGMMA_FLOPS_PER_CTA_ITER = 2 * 4 * 2 * 64 * 256 * 16  # two warpgroups, four m64n256k16 each (kernels/wgmma.cu)


def measure_wgmma_peak(lib, device) -> float | None:
    """The bf16 wgmma peak from shared memory (kernels/wgmma.cu's rung), FLOP/s; None where the code loaded for this GPU
    has no wgmma (only a library built for sm_90a has it, on an sm_90 GPU)."""
    import ctypes

    import torch

    L = lib.lib
    if not hasattr(L, "kdtree_bench_wgmma_peak"):  # a library from before the rung
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.zeros(256, device=device)
    stream = torch.cuda.current_stream()
    blocks, iters = sms, 4096

    def timed(n: int) -> float:  # seconds, launch included
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        st = L.kdtree_bench_wgmma_peak(blocks, n, ctypes.c_void_p(sink.data_ptr()), ctypes.c_void_p(stream.cuda_stream))
        e.record()
        e.synchronize()
        if st == cabi.ERR_UNSUPPORTED:
            return -1.0
        if st != 0:
            raise RuntimeError(f"kdtree_bench_wgmma_peak: status {st} ({cabi.status_text(st)})")
        return s.elapsed_time(e) / 1e3

    if timed(1) < 0:
        return None
    best = 0.0
    for _ in range(5):  # the difference of two lengths: the launch each call makes cancels
        t1, t2 = timed(iters), timed(2 * iters)
        if t2 > t1:
            best = max(best, blocks * iters * WGMMA_FLOPS_PER_CTA_ITER / (t2 - t1))
    return best


def measure_inner_loops(lib, device, peak_flops: float, only: list[str] | None = None) -> list[dict]:
    """The flash kernel's loop at its occupancy, alone and then piece by piece (kernels/ceilings.cu says
    which loops): per loop the best of five launches, as TFLOP/s and as a fraction of the mma.sync peak just
    measured. The first rungs say what a kernel of that shape could reach if everything but its mma and
    fragment loads were free; each further rung, what one more of the kernel's pieces costs. `only`: these
    rungs by name (BadInput naming the library's rungs for one it lacks)."""
    import ctypes

    import torch

    L = lib.lib
    if not hasattr(L, "kdtree_bench_loop"):  # a library built before the inner loops existed
        if only:
            raise BadInput(f"{lib.path.name} was built before the flash loop ladder: no --loop to run")
        return []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.zeros(512, device=device)
    # the gathering loops stream tiles from 16 MiB that stay in L2, as the flash kernel's KV tiles mostly do
    # (every row tile's CTA reads the same tile; only the first read comes from HBM)
    src = torch.randn(8 << 20, device=device).to(torch.bfloat16)
    stream = torch.cuda.current_stream()
    tiles = 2048  # ~2 ms per launch at the flash kernel's tile rate: event resolution is not a factor
    names = [L.kdtree_bench_loop_name(i).decode() for i in range(L.kdtree_bench_loop_count())]
    for n in only or []:
        if n not in names:
            raise BadInput(f"no loop {n!r} in {lib.path.name}; it has: {', '.join(repr(x) for x in names)}")
    loops = []
    for i, name in enumerate(names):
        if only and name not in only:
            continue
        warps, mma = L.kdtree_bench_loop_warps(i), L.kdtree_bench_loop_mma_per_tile(i)
        tile_bytes = L.kdtree_bench_loop_tile_bytes(i)
        best_s = float("inf")
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            st = L.kdtree_bench_loop(i, sms, tiles, ctypes.c_void_p(src.data_ptr()), src.numel() * 2,
                                     ctypes.c_void_p(sink.data_ptr()), ctypes.c_void_p(stream.cuda_stream))
            e.record()
            e.synchronize()
            if st == cabi.ERR_UNSUPPORTED:  # its buffers exceed the shared memory, or bulk / tensor copies before sm_90
                break
            if st != 0:
                raise RuntimeError(f"kdtree_bench_loop({name}): status {st} ({cabi.status_text(st)})")
            best_s = min(best_s, s.elapsed_time(e) / 1e3)
        if best_s == float("inf"):
            loops.append({"loop": name, "warps_per_sm": warps, "mma_per_warp_tile": mma, "flops": None,
                          "of_peak": None, "copy_bytes_per_s": None, "runs": False})
            continue
        flops = sms * warps * tiles * mma * 4096.0 / best_s
        loops.append({"loop": name, "warps_per_sm": warps, "mma_per_warp_tile": mma, "flops": flops,
                      "of_peak": flops / peak_flops if peak_flops > 0 else None,
                      "copy_bytes_per_s": sms * tiles * tile_bytes / best_s if tile_bytes else None,
                      "runs": True})
    return loops
