"""kdev plan: what the flash call launches at DDTree shapes on a GPU, asked of the built library without running
anything (no GPU needed): the kernels, row tiles, KV splits, CTAs and waves, the workspace the caller must provide,
and what the plan leaves on the table against the roofline.

The plan is the library's own: kdtree_flash_plan (the split plan, the combine's groups, the workspace) and
kdtree_flash_launch_plan (which kernels, how much dynamic shared memory), the launcher's rules asked with the GPU's
figures. What this module adds is arithmetic on that plan, each figure named for what it is:
- CTAs per SM: the full-tile kernel's registers (the ptxas report in the build.json beside the library, allocated per
  warp in units of 256), its shared memory (dynamic + static + the 1 KB the runtime reserves per block) and threads,
  against the GPU's per-SM limits.
- waves: the full-tile kernel's working CTAs over SMs x CTAs per SM (the narrow kernel's CTAs, cut by a split count of
  their own, take the SMs that the full tiles' last wave leaves, then the rest).
- slot use: the KV tiles the full-tile CTAs run over waves x SMs x CTAs per SM x the longest CTA's tiles (the split
  cut mirrors the kernels' split_chunk: equal chunks of whole 32-token tiles).
- row use: the requests' rows (T x H) over the rows the tensor cores compute (64 per full row tile, 16 per narrow one).
- KV read: every row tile's CTAs read the request's whole KV range (L2 -> SM traffic), against the KV in memory once.
- floor: the larger of FLOPs over the GPU's mma.sync ceiling and bytes over its memory ceiling (as kdev bench).
With costs, each plan also carries the planner's own model cost (kdtree_flash_split_cost) of its choices: per full-tile
split count, the narrow split count the planner's rule would take with it. A skewed batch's plan carries the device
schedule too (kdtree_flash_schedule_plan), what the scheduled calls run in place of the plain call's one split count.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kdev import bench, cabi, registry
from kdev.resources import launch_plan_entry
from kdev.build import runs_on
from kdev.config import REPO_ROOT, WGMMA_ARCH, GpuSpec, load_gpus
from kdev.errors import BadInput, EnvironmentMissing
from kdev.fsutil import read_json_record

BLOCK_M, BLOCK_N, NARROW_ROWS = cabi.BLOCK_M, cabi.BLOCK_N, cabi.NARROW_ROWS  # kdtree.h's flash tiling
THREADS = cabi.FLASH_THREADS
RESERVED_SMEM = 1024  # shared memory the runtime reserves per block (sm_80+)
KV_ROW_BYTES = cabi.QK_DIM * 2
CALLS = (registry.HOPPER, registry.PORTABLE)  # the products' calls (kdev/registry.py)
MAX_SPLITS_ASKED = 2 * cabi.MAX_SPLITS  # past the combine's cap: the library answers infinity there
PLAN_FUNCTIONS = ("kdtree_flash_plan", "kdtree_flash_split_cost", "kdtree_flash_schedule_plan",
                  "kdtree_flash_launch_time")  # called here with this checkout's arguments


# ------------------------------------------------------------------------------------------------ GPU
def gpu_here() -> GpuSpec | None:
    """The GPU torch uses now, from its device properties (ceilings as kdev bench finds them), or None. Its rates and the
    clock its ceilings hold at (what kdev plan --project needs) are those configs/gpus.yaml gives a GPU of its name."""
    import torch

    if not torch.cuda.is_available():
        return None
    from kdev import gpu

    ident = gpu.current_gpu().to_dict()
    pr = torch.cuda.get_device_properties(ident["index"])
    known = next((g for g in load_gpus().values() if g.name == pr.name), None)

    def prop(attr: str, field: str) -> int:  # an older torch may not report it: the table's figure for this GPU
        value = getattr(pr, attr, None) or (getattr(known, field) if known else None)
        if value is None:
            raise EnvironmentMissing(f"torch {torch.__version__} does not report {attr} for {pr.name}, and "
                                     f"configs/gpus.yaml has no GPU of that name: name one with --gpu")
        return int(value)

    ceil = bench.load_ceilings(ident) or {}
    return GpuSpec(key="this GPU", name=pr.name, arch=ident["arch"], sms=pr.multi_processor_count,
                   smem_per_block_optin=prop("shared_memory_per_block_optin", "smem_per_block_optin"),
                   smem_per_sm=prop("shared_memory_per_multiprocessor", "smem_per_sm"),
                   threads_per_sm=prop("max_threads_per_multi_processor", "threads_per_sm"),
                   registers_per_sm=prop("regs_per_multiprocessor", "registers_per_sm"), flops=ceil.get("flops"),
                   bytes_per_s=ceil.get("bytes_per_s"), ceilings_measured=bool(ceil),
                   ceilings_source=ceil.get("source", "kdev bench --ceilings") if ceil else "",
                   ceilings_clock_mhz=known.ceilings_clock_mhz if known else None,
                   rates=known.rates if known else None)


def resolve_gpu(name: str | None, sms: int | None = None, gpus_path: Path | None = None,
                deploy_repo: Path = REPO_ROOT, option: str = "--gpu") -> GpuSpec:
    """--gpu NAME (a key or a name in configs/gpus.yaml); without it the GPU here, else the deploy target's
    (configs/deploy.yaml target_arch). --sms replaces the SM count (a partitioned or a smaller GPU of that arch)."""
    gpus = load_gpus(gpus_path)
    if name:
        found = gpus.get(name) or next((g for g in gpus.values() if g.name == name), None)
        if found is None:
            raise BadInput(f"{option} {name!r}: not in configs/gpus.yaml (have: {', '.join(gpus)})")
    else:
        found = gpu_here()
        if found is None:
            from kdev.deploy import load_deploy

            target = load_deploy(deploy_repo).target_arch
            found = next((g for g in gpus.values() if g.arch == target), None)
            if found is None:
                raise BadInput(f"no GPU here and none of arch {target} (configs/deploy.yaml target_arch) in "
                               f"configs/gpus.yaml: name one with --gpu ({', '.join(gpus)})")
    if sms is not None:
        if sms < 1:
            raise BadInput(f"--sms {sms}: must be >= 1")
        found = replace(found, sms=sms)
    return found


@dataclass(frozen=True)
class PlanTarget:
    """What --plan-gpu names for verify and bench: a GPU of configs/gpus.yaml (its SM count, and its arch for the
    ledger) or a bare SM count. The flash calls are then planned as for that many SMs (VerifyAttnParams.plan_sm_count)."""

    sms: int
    key: str | None = None
    name: str | None = None
    arch: str | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.sms} SMs)" if self.name else f"{self.sms} SMs"

    def to_dict(self) -> dict:
        return {"gpu": self.key, "name": self.name, "arch": self.arch, "sms": self.sms}

    @classmethod
    def from_dict(cls, d: dict) -> "PlanTarget":
        return cls(d["sms"], d.get("gpu"), d.get("name"), d.get("arch"))


def plan_target(value: str, option: str = "--plan-gpu") -> PlanTarget:
    if value.strip().isdigit():
        sms = int(value)
        if sms < 1:
            raise BadInput(f"{option} {value}: an SM count must be >= 1")
        return PlanTarget(sms)
    g = resolve_gpu(value, option=option)
    return PlanTarget(g.sms, g.key, g.name, g.arch)


# -------------------------------------------------------------------------------------------- library
class PlanLibrary:
    """The library's plan entry points (host code only: loading it needs no GPU) and its build record, through cabi (no
    torch: a plan needs no GPU stack)."""

    def __init__(self, path: Path):
        if not path.exists():  # a path given wrongly is bad input; one that exists and will not load, environment
            raise BadInput(f"{path}: no such library")
        try:
            L = cabi.load(path)
        except cabi.LoadError as e:
            raise EnvironmentMissing(str(e)) from None
        self.launch_plan = launch_plan_entry(L, error=BadInput)
        if not hasattr(L, "kdtree_flash_plan") or self.launch_plan is None:
            raise EnvironmentMissing(f"{path}: built from sources without kdtree_flash_plan: run 'kdev build'")
        # the calls below pass this checkout's arguments: a library whose own header declares the plan functions
        # otherwise (an older build) is refused, not called with arguments in the wrong places
        other = [f for f in PLAN_FUNCTIONS if hasattr(L, f)
                 and L.kdev_contract.arg_names.get(f) != cabi.CONTRACT.arg_names.get(f)]
        if other:
            raise EnvironmentMissing(f"{path}: its {other[0]} takes other arguments than this checkout's kdtree.h "
                                     f"declares (ABI {L.kdtree_abi_version()}, here {cabi.ABI_VERSION}): run "
                                     f"'kdev build'")
        # a library from before the planner's costs were exposed still plans; only --costs needs the entry
        self.has_costs = hasattr(L, "kdtree_flash_split_cost")
        self.lib, self.path = L, path
        self.build_info = cabi.build_info(L)
        record = path.parent / "build.json"
        rec = read_json_record(record, ("resources",))  # none, or a damaged one: CTAs per SM are then not known
        self.resources = rec["resources"] if rec is not None else None

    def stale_note(self) -> str | None:
        """Why this library's plan may not be the current sources' (None where it is, or for an A/B build)."""
        from kdev import build

        built, now = self.build_info.get("source_hash", "?"), build.source_hash()
        if built == now or self.build_info.get("variant"):
            return None
        return f"{self.path} was built from sources {built[:12]}, kernels/ is now {now[:12]}: run 'kdev build'"

    def _fail(self, fn: str) -> BadInput:
        return BadInput(f"{fn}: {cabi.last_error(self.lib)}")

    def split_plan(self, batch: int, total_q: int, heads: int, max_qlen: int, max_kv_len: int, page_size: int,
                   gpu: GpuSpec) -> dict:
        out = [ctypes.c_int() for _ in range(4)]
        ws = ctypes.c_size_t()
        if self.lib.kdtree_flash_plan(batch, total_q, heads, max_qlen, max_kv_len, page_size, gpu.sms,
                                      gpu.threads_per_sm, *map(ctypes.byref, out), ctypes.byref(ws)):
            raise self._fail("kdtree_flash_plan")
        m_tiles, splits, narrow_splits, groups = (x.value for x in out)
        return {"row_tiles": m_tiles, "splits": splits, "narrow_splits": narrow_splits, "combine_groups": groups,
                "workspace_bytes": ws.value}

    def split_costs(self, batch: int, total_q: int, heads: int, max_qlen: int, max_kv_len: int, page_size: int,
                    gpu: GpuSpec) -> list[dict]:
        """The planner's model cost (KV tiles) of every choice it may take for these bounds (full-tile splits, narrow
        splits: 0 where there is no narrow tile), in the order of the splits."""
        if not self.has_costs:
            raise EnvironmentMissing(f"{self.path}: built from sources without kdtree_flash_split_cost: run 'kdev build'")
        out, cost = [], ctypes.c_double()
        for splits in range(1, MAX_SPLITS_ASKED + 1):
            found = len(out)
            for narrow_splits in range(MAX_SPLITS_ASKED + 1):
                if self.lib.kdtree_flash_split_cost(batch, total_q, heads, max_qlen, max_kv_len, page_size, gpu.sms,
                                                    splits, narrow_splits, ctypes.byref(cost)):
                    raise self._fail("kdtree_flash_split_cost")
                if math.isfinite(cost.value):
                    out.append({"splits": splits, "narrow_splits": narrow_splits, "cost_tiles": cost.value})
                elif len(out) > found:
                    break  # past the cap (or past 0 without a narrow tile): the rest are infinite too
            if len(out) == found:
                break  # past the cap, or more than one split without a full tile: so are all larger counts
        return out

    def launch_time(self, full_ctas: int, full_cta: float, narrow_ctas: int, narrow_cta: float,
                    narrow_cold_cta: float, sm_count: int) -> float:
        """The planner's schedule of one launch (kdtree_flash_launch_time): when its last CTA ends, in the CTAs' unit."""
        if not hasattr(self.lib, "kdtree_flash_launch_time"):
            raise EnvironmentMissing(f"{self.path}: built from sources without kdtree_flash_launch_time: run 'kdev build'")
        out = ctypes.c_double()
        if self.lib.kdtree_flash_launch_time(full_ctas, full_cta, narrow_ctas, narrow_cta, narrow_cold_cta, sm_count,
                                             ctypes.byref(out)):
            raise self._fail("kdtree_flash_launch_time")
        return out.value

    def schedule_plan(self, shape: bench.Shape, sizes: list[int], gpu: GpuSpec) -> dict | None:
        """The device schedule the scheduled calls would run for this batch (kdtree_flash_schedule_plan: the schedule
        kernel's arithmetic on the host), its requests' trees `sizes` nodes each, at the shape's bounds (a capture's, or
        its own); None from a library without it."""
        if not hasattr(self.lib, "kdtree_flash_schedule_plan"):
            return None
        B = shape.batch
        prefix = (ctypes.c_int * B)(*shape.prefix_lens)
        qlens = (ctypes.c_int * B)(*sizes)
        splits, narrow = (ctypes.c_int * B)(), (ctypes.c_int * B)()
        k, ctas, narrow_ctas, at_bounds = (ctypes.c_int() for _ in range(4))
        tokens = ctypes.c_int64()
        max_kv_len, max_qlen = shape.bounds or (0, 0)
        if self.lib.kdtree_flash_schedule_plan(B, shape.heads, shape.page_size, gpu.sms, ctypes.addressof(prefix),
                                               ctypes.addressof(qlens), max_qlen, max_kv_len, ctypes.byref(k), splits,
                                               narrow,
                                               ctypes.byref(ctas), ctypes.byref(narrow_ctas), ctypes.byref(tokens),
                                               ctypes.byref(at_bounds)):
            raise self._fail("kdtree_flash_schedule_plan")
        return {"k": k.value, "splits": list(splits), "narrow_splits": list(narrow), "ctas": ctas.value,
                "narrow_ctas": narrow_ctas.value, "model_tokens": tokens.value, "host_plan": bool(at_bounds.value)}

    def wgmma_built(self, gpu: GpuSpec, archs: list[str] | None = None) -> bool:
        """Whether code built for `archs` (this library's by default) holds the wgmma kernel that the flash call runs
        on `gpu`: a build for sm_90a, which an sm_90 GPU runs."""
        archs = self.build_info.get("archs", []) if archs is None else archs
        return WGMMA_ARCH in archs and runs_on([WGMMA_ARCH], gpu.arch.rstrip("a"))

    def kernels(self, gpu: GpuSpec, tensor_copy: bool, portable: bool, wgmma: bool | None = None) -> dict:
        """The kernels a call launches on `gpu`; `wgmma` says whether the code holds the wgmma kernel (None: this
        library's, from its archs; a measured call says what its own library held)."""
        wgmma_built = self.wgmma_built(gpu) if wgmma is None else wgmma
        return self.launch_plan(gpu.major, gpu.smem_per_block_optin, tensor_copy, portable, wgmma_built)

    def ctas_per_sm(self, kernel: str, dynamic_smem: int, gpu: GpuSpec) -> int:
        if self.resources is None:
            raise EnvironmentMissing(f"{self.path}: no build.json beside it (the ptxas report): cannot tell "
                                     f"{kernel}'s registers")
        arch = gpu.arch.rstrip("a")
        r = next((x for x in self.resources if x["kernel"] == kernel and x["arch"].rstrip("a") == arch), None)
        if r is None:
            built = sorted({x["arch"] for x in self.resources})
            raise BadInput(f"{self.path}: no {arch} build of {kernel} (built for {', '.join(built)}): "
                           f"kdev build --arch {arch}")
        per_warp = math.ceil(32 * math.ceil(max(r["registers"], 1) / 8) * 8 / 256) * 256
        by_regs = gpu.registers_per_sm // (per_warp * THREADS // 32)
        by_smem = gpu.smem_per_sm // (dynamic_smem + r["smem"] + RESERVED_SMEM)
        return min(by_regs, by_smem, gpu.threads_per_sm // THREADS)


# ----------------------------------------------------------------------------------------------- plan
@dataclass
class ShapePlan:
    shape: str
    axes: dict
    rows: int  # T x H per request
    row_tiles: int
    narrow_rows: int  # rows of the narrow last tile; 0 where the last tile runs as a full one
    splits: int
    narrow_splits: int
    combine_groups: int
    workspace_bytes: int
    full_kernel: str
    full_smem: int
    narrow_kernel: str | None
    ctas_per_sm: int
    full_ctas: int
    narrow_ctas: int
    waves: int
    slot_use: float
    row_use: float
    kv_bytes: int  # the requests' KV rows, once
    kv_read_bytes: int  # what the CTAs read of it (every row tile reads its request's range)
    floor_us: float | None
    bound: str
    schedule: dict | None = None  # the device schedule (the scheduled calls') of a skewed batch or a capture's replay


def split_chunk(kv_len: int, splits: int) -> int:
    """Tokens of each split of a range of kv_len: its equal share rounded up to whole KV tiles. The Python statement of
    flash_plan.cuh's split_chunk, which the kernels and the device schedule cut by (tests/test_flash_plan.py compares
    the two)."""
    return -(-(-(-kv_len // splits)) // BLOCK_N) * BLOCK_N


def split_tiles(kv_len: int, splits: int, filled: int | None = None) -> list[int]:
    """KV tiles of each split of a range of kv_len tokens (split_chunk's cut), of which the first `filled` hold KV (all
    by default; fewer where a call is planned for a capture's bounds but the request is shorter)."""
    filled = kv_len if filled is None else filled
    chunk = split_chunk(kv_len, splits)
    return [math.ceil(max(0, min(chunk, filled - s * chunk)) / BLOCK_N) for s in range(splits)]


NEAR_TIE = 1e-3  # the planner takes the fewest splits (full, then narrow) within this of the least cost


def split_costs(lib: PlanLibrary, shape: bench.Shape, gpu: GpuSpec) -> list[dict]:
    """The planner's model at this shape: per full-tile split count, the narrow split count its rule would take with
    it (the fewest within 0.1 % of the least cost of all, else the cheapest for that count), with its model cost,
    cheapest first, and each one's cost over the least (the plan is the first, in order of splits, within 0.1 %)."""
    kv_bound, t_bound = launch_bounds(shape)
    costs = lib.split_costs(shape.batch, shape.batch * shape.T, shape.heads, t_bound, kv_bound, shape.page_size, gpu)
    least = min(c["cost_tiles"] for c in costs)
    per_split: dict[int, dict] = {}
    for c in costs:  # in order of (splits, narrow splits)
        kept = per_split.get(c["splits"])
        near = c["cost_tiles"] <= least * (1 + NEAR_TIE)
        if kept is None or (near and kept["cost_tiles"] > least * (1 + NEAR_TIE)) or \
                (not near and c["cost_tiles"] < kept["cost_tiles"]):
            per_split[c["splits"]] = c
    out = sorted(per_split.values(), key=lambda c: (c["cost_tiles"], c["splits"]))
    for c in out:
        c["relative"] = c["cost_tiles"] / least
    return out


def launch_bounds(shape: bench.Shape) -> tuple[int, int]:
    """(max_kv_len, max_qlen) the call is planned for: a graph's capture-time bounds where the shape replays one, else
    its own (a skewed batch's longest prefix and largest tree)."""
    return shape.bounds or (shape.prefix + shape.T, shape.T)


def plan_shape(lib: PlanLibrary, shape: bench.Shape, gpu: GpuSpec, call: str = registry.HOPPER,
               wgmma: bool | None = None) -> ShapePlan:
    """The plain call's launch at the shape's bounds (launch_bounds); the KV it reads and the floor are the shape's own.
    `wgmma`: whether the code holds the wgmma kernel (PlanLibrary.kernels; None: this library's)."""
    T, H, B, L = shape.T, shape.heads, shape.batch, shape.prefix
    kv_len, t_bound = launch_bounds(shape)
    p = lib.split_plan(B, B * T, H, t_bound, kv_len, shape.page_size, gpu)
    tensor_copy = gpu.major >= 9 and shape.page_size >= cabi.TENSOR_COPY_MIN_PAGE
    k = lib.kernels(gpu, tensor_copy, call == registry.PORTABLE, wgmma)
    narrow = 1 if p["narrow_splits"] else 0
    full_tiles = p["row_tiles"] - narrow
    per_sm = lib.ctas_per_sm(k["full"], k["full_smem"], gpu)
    if per_sm < 1:
        raise BadInput(f"{k['full']} does not fit one CTA on an SM of {gpu.name} ({k['full_smem']} B dynamic shared "
                       f"memory)")
    full_ctas = B * full_tiles * p["splits"]
    narrow_ctas = B * p["narrow_splits"]
    slots = gpu.sms * per_sm
    waves = math.ceil(full_ctas / slots) if full_ctas else 0
    # the CTAs' work: the splits cut the bound's range, of which a request fills the first ones (its own range), and a
    # request's row tiles past its rows have none (at a capture's bounds, its tail is a full-tile CTA's)
    own_kv, rows = L + T, T * H
    own = split_tiles(kv_len, p["splits"], own_kv)
    busy_tiles = min(-(-rows // BLOCK_M), full_tiles) if shape.bounds else full_tiles
    slot_use = B * busy_tiles * sum(own) / (waves * slots * max(own)) if full_ctas else 0.0
    sizes = [n + 1 for n in shape.budget_list]
    kv_bytes = sum(Lb + t for Lb, t in zip(shape.prefix_lens, sizes)) * KV_ROW_BYTES
    kv_read = sum((Lb + t) * -(-t * H // BLOCK_M) for Lb, t in zip(shape.prefix_lens, sizes)) * KV_ROW_BYTES
    flops, nbytes = bench.flops_bytes(sizes, shape.prefix_lens, H)
    floor = bound = None
    if gpu.flops and gpu.bytes_per_s:
        tc, tm = flops / gpu.flops, nbytes / gpu.bytes_per_s
        floor, bound = max(tc, tm) * 1e6, "compute" if tc >= tm else "memory"
    launched_rows = t_bound * H
    return ShapePlan(
        shape=shape.name, axes=asdict(shape), rows=rows, row_tiles=p["row_tiles"],
        narrow_rows=launched_rows - full_tiles * BLOCK_M if narrow else 0, splits=p["splits"],
        narrow_splits=p["narrow_splits"], combine_groups=p["combine_groups"], workspace_bytes=p["workspace_bytes"],
        full_kernel=k["full"], full_smem=k["full_smem"], narrow_kernel=k["narrow"] if narrow else None,
        ctas_per_sm=per_sm, full_ctas=full_ctas, narrow_ctas=narrow_ctas, waves=waves, slot_use=slot_use,
        row_use=rows / (full_tiles * BLOCK_M + narrow * NARROW_ROWS), kv_bytes=kv_bytes,
        kv_read_bytes=kv_read, floor_us=floor, bound=bound or "-",
        schedule=lib.schedule_plan(shape, sizes, gpu) if shape.requests or shape.bounds else None)


def plan(lib: PlanLibrary, shapes: list[bench.Shape], gpu: GpuSpec, call: str = registry.HOPPER,
         costs: bool = False) -> dict:
    if call not in CALLS:
        raise BadInput(f"--call {call!r}: one of {', '.join(CALLS)}")
    plans = [plan_shape(lib, s, gpu, call) for s in shapes]
    largest = max(plans, key=lambda x: x.workspace_bytes, default=None)
    docs = [asdict(x) for x in plans]
    if costs:
        for d, s in zip(docs, shapes):
            d["split_costs"] = split_costs(lib, s, gpu)
    return {"gpu": asdict(gpu), "library": str(lib.path), "call": call, "plans": docs,
            "largest_workspace": {"shape": largest.shape, "bytes": largest.workspace_bytes} if largest else None}


# ------------------------------------------------------------------------------------------- context held
# What the card keeps for weights and KV cache: SGLang's --mem-fraction-static, the rest left to activations, CUDA
# graphs and the allocator. An assumption (SGLang picks its default by GPU memory and parallelism): the same for every
# layout and cache dtype here, so the ratios between them do not depend on it.
MEM_FRACTION_STATIC = 0.90
CONTEXT_DTYPES = {"bf16": 2, "e4m3": 1}  # bytes per cache element (kdtree.h: bf16 rows, or e4m3 rows and one scale)
ALL_EXPERTS_TOKENS = 1_000_000  # tokens that reach every routed expert (what a card holds, not what one step reads)


def _resident_weight_bytes(steps) -> tuple[float, float]:
    """(weights one GPU holds under tensor parallelism, the attention weights one layer's replicas add per GPU under
    attention DP) in bytes, from the step cost model (configs/steps): every routed expert, not those one step reads."""
    rest = steps.rest_of_step(ALL_EXPERTS_TOKENS)
    if rest["experts_touched"] != steps.routed_experts:
        raise BadInput(f"{steps.name}: {ALL_EXPERTS_TOKENS} tokens reach {rest['experts_touched']:g} of "
                       f"{steps.routed_experts} experts")
    tp = steps.tensor_parallel
    attention = steps.layers * steps.attention_params() * steps.other_weight_bytes
    return rest["weight_bytes"], attention * (1 - 1 / tp)


def context_capacity(gpu: GpuSpec, steps_path: Path | None = None,
                     mem_fraction: float = MEM_FRACTION_STATIC) -> dict:
    """Tokens of context the target model's KV cache holds on `gpu` (configs/steps: the model, its layers and tensor
    parallelism; configs/gpus.yaml: the card's memory), with a bf16 and an e4m3 cache, for three layouts of the
    attention over the tp GPUs: tensor parallel (every GPU holds every token's latent row: the longest request and the
    distinct tokens are one GPU's), attention DP (each GPU its own requests' rows, and the attention weights whole on
    every GPU: distinct tokens tp times one GPU's, a request at most one GPU's), DCP over the same GPUs (a request's
    tokens cut across them: both tp times one GPU's). A latent row is 576 elements per layer (kdtree.h)."""
    from kdev.e2e.deploy import default_step_costs, load_step_costs

    steps = load_step_costs(steps_path or default_step_costs())
    if gpu.memory_bytes is None:
        raise BadInput(f"configs/gpus.yaml: {gpu.key} has no memory_gib: cannot say what its memory holds")
    tp_weights, dp_extra = _resident_weight_bytes(steps)
    usable = gpu.memory_bytes.nominal * mem_fraction
    tp = steps.tensor_parallel
    layouts = {"tp": (tp_weights, 1, 1), "attention-dp": (tp_weights + dp_extra, tp, 1), "dcp": (tp_weights, tp, tp)}
    rows = []
    for dtype, size in CONTEXT_DTYPES.items():
        per_token = cabi.QK_DIM * steps.layers * size
        for layout, (weights, distinct, longest) in layouts.items():
            per_gpu = max(0, int((usable - weights) // per_token))
            rows.append({"cache": dtype, "layout": layout, "kv_bytes_per_token": per_token,
                         "weight_bytes_per_gpu": weights, "kv_bytes_per_gpu": max(0.0, usable - weights),
                         "tokens_per_gpu": per_gpu, "distinct_tokens": per_gpu * distinct,
                         "longest_request": per_gpu * longest})
    return {"gpu": gpu.key, "gpu_name": gpu.name, "memory_bytes": gpu.memory_bytes.nominal,
            "memory_source": gpu.memory_bytes.source, "mem_fraction_static": mem_fraction, "model": steps.name,
            "layers": steps.layers, "tensor_parallel": tp, "rows": rows}
