"""The budget curve of a real deploy: which node budget makes tree speculation fastest on a given model and GPUs.

A decoding step verifies B trees of (budget + 1) nodes; it emits B x tau tokens, tau the mean tokens per round at that
budget (budget 0: plain decoding, tau = 1). Its time is the verify attention of every layer (measured: a `kdev bench`
result over budgets) plus the rest of the step, from a declared cost model (configs/steps/*.yaml, each constant with
its source): per GPU, the weights the step reads at the memory bandwidth (weights every GPU holds counted whole; for
an MoE, the routed experts the step's tokens touch), the router's weights, the communication (TP: two ring
all-reduces a layer, each a latency per hop plus its payload over the link; attention DP with expert parallelism: a
dispatch and a combine a MoE layer), the drafter and the step's other kernels as declared ranges. tau comes from an
acceptance curve given as a file whose provenance is printed (one not marked measured makes the output
illustrative). tokens/s = B x tau / step time: a projection, given as a range over the uncertain inputs (each a low
and a high with its source), with the best budget and the inputs that move it most.

What the model ignores, and says so: routing is taken as uniform over experts (real routing is skewed: fewer experts
touched, so the weight term is an upper bound); weight reads, attention and communication are not overlapped; below
the smallest budget the bench timed, the verify attention is taken at that budget's time (an upper bound: it grows
with the budget).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kdev.config import CONFIG_DIR, YamlReader, load_gpus, load_yaml
from kdev.errors import BadInput


@dataclass(frozen=True)
class StepCosts:
    name: str
    gpu_name: str
    bytes_per_s: float
    layers: int
    dense_layers: int
    hidden: int
    heads: int
    q_lora_rank: int
    dense_intermediate: int
    moe_intermediate: int
    routed_experts: int
    experts_per_token: int
    shared_experts: int
    vocab: int
    tensor_parallel: int
    expert_weight_bytes: float
    other_weight_bytes: float
    allreduce_us: float
    allreduces_per_layer: int
    gpu_key: str = ""  # configs/gpus.yaml's key of the GPU

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts that `tokens` tokens reach in one layer, routing uniform:
        n (1 - (1 - k/n)^T)."""
        n, k = self.routed_experts, self.experts_per_token
        return n * (1.0 - (1.0 - k / n) ** tokens)

    def attention_params(self) -> int:
        """One MLA layer's weights: q_a, q_b (heads x 192), kv_a (512 + 64), kv_b (heads x 256 from 512), o."""
        h = self.heads
        return (self.hidden * self.q_lora_rank + self.q_lora_rank * h * 192 + self.hidden * 576 + 512 * h * 256
                + h * 128 * self.hidden)

    def rest_of_step(self, tokens: int) -> dict:
        """Per GPU: bytes of weights read, their time at the memory bandwidth, the all-reduces' time (µs)."""
        tp, mlp = self.tensor_parallel, 3 * self.hidden
        moe_layers = self.layers - self.dense_layers
        other = (self.layers * self.attention_params() + self.dense_layers * mlp * self.dense_intermediate
                 + moe_layers * self.shared_experts * mlp * self.moe_intermediate + self.vocab * self.hidden)
        experts = moe_layers * self.experts_touched(tokens) * mlp * self.moe_intermediate
        weight_bytes = (other * self.other_weight_bytes + experts * self.expert_weight_bytes) / tp
        return {"weight_bytes": weight_bytes, "weights_us": weight_bytes / self.bytes_per_s * 1e6,
                "allreduce_us": self.layers * self.allreduces_per_layer * self.allreduce_us,
                "experts_touched": self.experts_touched(tokens)}


@dataclass(frozen=True)
class Span:
    """An input nobody here has measured, or a range: low and high, and where they come from."""

    low: float
    high: float
    source: str

    @property
    def mid(self) -> float:
        return (self.low + self.high) / 2

    def at(self, corner: str) -> float:
        return {"low": self.low, "mid": self.mid, "high": self.high}[corner]


TOPOLOGIES = ("tp", "dp-ep")  # tensor parallel over every GPU; attention data parallel with expert parallelism


@dataclass(frozen=True)
class Deploy:
    """What a step costs besides the verify attention, with ranges (configs/steps/*.yaml: `deploy:`)."""

    gpus: int
    bandwidth_efficiency: Span  # the share of the spec memory bandwidth weight reads reach
    link_gbps: Span  # the all-reduce's bus bandwidth between the GPUs, GB/s
    latency_us: Span  # one all-reduce's (or all-to-all's) fixed cost, whatever its payload, µs
    link: str  # what the GPUs are connected by
    activation_bytes: float
    router_weight_bytes: float
    drafter_us: Span
    other_us: Span  # norms, sampling, launches: the step's other kernels

    def allreduce_us(self, payload: float, corner: str) -> float:
        """An all-reduce of `payload` bytes over the GPUs: its fixed latency, and 2 (n - 1) / n of the payload over
        the link (a ring's traffic; the bus-bandwidth convention of nccl-tests)."""
        n = self.gpus
        slow = {"low": "high", "mid": "mid", "high": "low"}[corner]  # the low end of the time: the fast link
        return self.latency_us.at(corner) + 2 * (n - 1) / n * payload / (self.link_gbps.at(slow) * 1e3)

    def all_to_all_us(self, payload: float, corner: str) -> float:
        """One all-to-all in which each GPU sends `payload` bytes, (n - 1) / n of them to the others."""
        slow = {"low": "high", "mid": "mid", "high": "low"}[corner]
        return self.latency_us.at(corner) + (self.gpus - 1) / self.gpus * payload / (self.link_gbps.at(slow) * 1e3)


def step_parts(costs: StepCosts, dep: Deploy, topology: str, tokens: int, corner: str,
               local_tokens: int | None = None) -> dict:
    """Per GPU, µs and bytes of one step's parts besides the verify attention, at one corner of the ranges ("low":
    every uncertain input at its fast end, "high" at its slow end). `tokens`: the step's tokens, every request's
    tree; `local_tokens`: the most of them one GPU holds under dp-ep (default: all). Under tp every weight is split over the GPUs but those each holds whole (q_a and kv_a: replicated linear
    layers, the router); under dp-ep each GPU holds the attention, dense and shared MLPs, router and LM head whole and
    1/n of the routed experts whole, and the request's tokens sit on one GPU (at B = 1 the step waits for it)."""
    if topology not in TOPOLOGIES:
        raise BadInput(f"--topology {topology!r}: one of {', '.join(TOPOLOGIES)}")
    n, mlp, h = dep.gpus, 3 * costs.hidden, costs.heads
    moe_layers = costs.layers - costs.dense_layers
    whole_attn = costs.hidden * costs.q_lora_rank + costs.hidden * 576  # q_a, kv_a: replicated in TP
    split_attn = costs.q_lora_rank * h * 192 + 512 * h * 256 + h * 128 * costs.hidden
    dense = costs.dense_layers * mlp * costs.dense_intermediate
    shared = moe_layers * costs.shared_experts * mlp * costs.moe_intermediate
    lm_head = costs.vocab * costs.hidden
    router = moe_layers * costs.hidden * costs.routed_experts * dep.router_weight_bytes
    touched = costs.experts_touched(tokens)
    expert = mlp * costs.moe_intermediate
    if topology == "tp":
        other = costs.layers * (whole_attn + split_attn / n) + (dense + shared + lm_head) / n
        experts = moe_layers * touched * expert / n
        payload = tokens * costs.hidden * dep.activation_bytes
        comm = costs.layers * costs.allreduces_per_layer * dep.allreduce_us(payload, corner)
    else:
        other = costs.layers * (whole_attn + split_attn) + dense + shared + lm_head
        local = costs.routed_experts / n  # experts each GPU holds; those the step touches, routing uniform
        experts = moe_layers * local * (1.0 - (1.0 - costs.experts_per_token / costs.routed_experts) ** tokens) * expert
        payload = (local_tokens or tokens) * costs.experts_per_token * costs.hidden * dep.activation_bytes
        comm = moe_layers * 2 * dep.all_to_all_us(payload, corner)
    weight_bytes = other * costs.other_weight_bytes + experts * costs.expert_weight_bytes + router
    slow = {"low": "high", "mid": "mid", "high": "low"}[corner]
    weights_us = weight_bytes / (costs.bytes_per_s * dep.bandwidth_efficiency.at(slow)) * 1e6
    return {"weight_bytes": weight_bytes, "router_bytes": router, "weights_us": weights_us, "comm_us": comm,
            "drafter_us": dep.drafter_us.at(corner), "other_us": dep.other_us.at(corner), "experts_touched": touched}


def load_step_costs(path: Path) -> StepCosts:
    r = YamlReader(load_yaml(Path(path)), Path(path), "")
    gpus = load_gpus()
    gpu = r.get("gpu", str)
    if gpu not in gpus or not gpus[gpu].bytes_per_s:
        raise BadInput(f"{path}: gpu {gpu!r} has no memory bandwidth in configs/gpus.yaml")
    ints = ("layers", "dense_layers", "hidden", "heads", "q_lora_rank", "dense_intermediate", "moe_intermediate",
            "routed_experts", "experts_per_token", "shared_experts", "vocab", "tensor_parallel",
            "allreduces_per_layer")
    vals = {k: r.positive_int(k) if k not in ("dense_layers", "shared_experts") else r.get(k, int) for k in ints}
    floats = {k: r.get(k, float) for k in ("expert_weight_bytes", "other_weight_bytes", "allreduce_us")}
    if vals["experts_per_token"] > vals["routed_experts"] or vals["dense_layers"] > vals["layers"]:
        raise BadInput(f"{path}: experts_per_token > routed_experts, or dense_layers > layers")
    name = r.get("name", str)
    r.sub("deploy", {})  # read by load_deploy
    r.done()
    return StepCosts(name, gpus[gpu].name, gpus[gpu].bytes_per_s, **vals, **floats, gpu_key=gpu)


def _span(r: YamlReader, key: str) -> Span:
    s = r.sub(key)
    low, high = s.get("low", float), s.get("high", float)
    source = s.get("source", str)
    s.done()
    if not 0 <= low <= high:
        raise r.fail(key, f"low {low:g} and high {high:g}: 0 <= low <= high")
    if not source.strip():
        raise r.fail(key, "source: say where the numbers come from")
    return Span(low, high, source)


def load_deploy(path: Path) -> Deploy:
    """The `deploy:` section of a step cost model: the GPUs, their link and every range, each with its source."""
    top = YamlReader(load_yaml(Path(path)), Path(path), "")
    if "deploy" not in top.data:
        raise BadInput(f"{path}: no deploy: section (the link, the ranges and their sources)")
    r = top.sub("deploy")
    dep = Deploy(r.positive_int("gpus"), _span(r, "bandwidth_efficiency"), _span(r, "link_gbps"), _span(r, "latency_us"),
                 r.get("link", str), r.get("activation_bytes", float, check=lambda v: v > 0, check_msg="must be > 0"),
                 r.get("router_weight_bytes", float, check=lambda v: v > 0, check_msg="must be > 0"),
                 _span(r, "drafter_us"), _span(r, "other_us"))
    r.done()
    if not 0 < dep.bandwidth_efficiency.low <= dep.bandwidth_efficiency.high <= 1:
        raise BadInput(f"{path}: deploy.bandwidth_efficiency: a share, 0 < low <= high <= 1")
    if dep.link_gbps.low <= 0:
        raise BadInput(f"{path}: deploy.link_gbps: low must be > 0")
    return dep


def default_step_costs() -> Path:
    return CONFIG_DIR / "steps" / "kimi-k2.6-rtx-pro-6000-tp8.yaml"


def _interpolate(points: dict, x: float, what: str, log: bool = False) -> float:
    xs = sorted(points)
    if not xs[0] <= x <= xs[-1]:
        raise BadInput(f"budget {x:g} outside the budgets of the {what}, {xs[0]:g}..{xs[-1]:g}")
    for lo, hi in zip(xs, xs[1:] + xs[-1:]):
        if lo <= x <= hi:
            if hi == lo:
                return points[lo]
            f = (math.log(x / lo) / math.log(hi / lo)) if log else (x - lo) / (hi - lo)
            return points[lo] + f * (points[hi] - points[lo])
    return points[xs[-1]]


def load_acceptance(path: Path) -> tuple[dict, str]:
    """{budget: tokens per round} from a YAML file (tokens_per_round: {16: 3.1, 64: 4.0}, source: "...")."""
    r = YamlReader(load_yaml(Path(path)), Path(path), "")
    curve = r.get("tokens_per_round", dict)
    try:
        points = {int(k): float(v) for k, v in curve.items()}
    except (TypeError, ValueError):
        raise BadInput(f"{path}: tokens_per_round maps budgets (whole numbers) to tokens per round") from None
    if not points or any(b < 1 or t < 1.0 for b, t in points.items()):
        raise BadInput(f"{path}: tokens_per_round needs budgets >= 1 and at least 1 token per round (the bonus)")
    source = r.get("source", str, "not given")
    measured = r.get("measured", bool, False)
    r.done()
    return points, source if measured else f"ASSUMED, not measured ({source}): the output is illustrative"


def acceptance_measured(path: Path) -> bool:
    return bool(YamlReader(load_yaml(Path(path)), Path(path), "").get("measured", bool, False))


def load_attention(path: Path, batch: int, prefix: int, heads: int, backend: str) -> tuple[dict, str]:
    """{budget: µs of one layer's verify attention} from a `kdev bench` JSON result, at this batch, prefix and heads,
    and the GPU it was timed on."""
    try:
        doc = json.loads(Path(path).read_text())
        rows = doc["results"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BadInput(f"{path}: not a kdev bench result (no results list)") from None
    points = {}
    for row in rows:
        a = row.get("axes", {})
        if (row.get("backend"), a.get("batch"), a.get("prefix"), a.get("heads")) == (backend, batch, prefix, heads):
            if row.get("timing"):
                points[int(a["budget"])] = float(row["timing"]["median_us"])
    if not points:
        raise BadInput(f"{path}: no {backend} timing at batch {batch}, prefix {prefix}, {heads} heads "
                       "(run kdev bench at those shapes over the budgets)")
    gpu = (doc.get("provenance") or {}).get("gpu") or {}
    return points, gpu.get("name", "an unnamed GPU") if isinstance(gpu, dict) else str(gpu)


def projected_attention(costs: StepCosts, budgets: list[int], batch: int, prefix: int, heads: int, kernel: str,
                        page_size: int = 1) -> tuple[dict, dict, str, list[str]]:
    """One layer's verify attention on the deploy's GPU from `kdev plan --project` (docs/projection.md), where no bench
    file of that card exists: ({budget: low µs}, {budget: high µs}, the GPU's name, notes: a stale library, the
    projection's known misses at this page size). Page size 1 by default: SGLang's MLA verify calls it so."""
    from kdev import bench, build, projection
    from kdev import plan as kplan
    from kdev.errors import EnvironmentMissing

    gpu = kplan.resolve_gpu(costs.gpu_key or costs.gpu_name)
    path = build.latest_library()
    if path is None:
        raise EnvironmentMissing(build.missing_default_library())
    planner = kplan.PlanLibrary(build.library_file(Path(path)))
    notes = [n for n in (planner.stale_note(),) if n]
    shapes = [bench.Shape(batch=batch, prefix=prefix, budget=b, heads=heads, page_size=page_size)
              for b in sorted({max(b, 1) for b in budgets})]
    doc = projection.run(planner, shapes, gpu, kernel)
    low = {s["axes"]["budget"]: float(s["low_us"]) for s in doc["shapes"]}
    high = {s["axes"]["budget"]: float(s["high_us"]) for s in doc["shapes"]}
    cfg = projection.load_config()
    fam = projection.family_of(cfg, gpu.arch)
    for f in (fam, *([cfg.families[fam.borrow]] if fam.borrow else [])):
        for match, why in f.misses:
            if match.get("page_size", page_size) == page_size:
                notes.append(f"the projection's known miss at page size {page_size} ({f.name}): {why}")
    return low, high, gpu.name, notes


def attention_at(attention: dict, budget: int) -> tuple[float, bool]:
    """One layer's verify attention at `budget` (µs), and whether it is the smallest timed budget's, an upper bound:
    below the bench's budgets the time is taken at its smallest (the attention grows with the tree); above, refused."""
    lo = min(attention)
    if budget < lo:
        return attention[lo], True
    return _interpolate(attention, budget, "attention timings"), False


CORNERS = ("low", "mid", "high")


def projection(costs: StepCosts, dep: Deploy, topology: str, attention: dict, acceptance: dict, budgets: list[int],
               batch: int, dep_over: dict | None = None, attention_high: dict | None = None) -> list[dict]:
    """The budget curve as a projection: per budget (0: plain decoding), the step's parts at the middle of every range
    and tokens/s at its fast and slow ends; the best budget by the middle. dep_over: Deploy fields replaced (the
    sensitivity's one input at one end)."""
    if dep_over:
        from dataclasses import replace

        dep = replace(dep, **dep_over)
    rows = []
    for b in budgets:
        tau = 1.0 if b == 0 else _interpolate(acceptance, b, "acceptance curve", log=True)
        per_layer, floor = attention_at(attention, max(b, 1))
        per_layer_high = attention_at(attention_high, max(b, 1))[0] if attention_high else per_layer
        # tp: every GPU attends with its heads; dp-ep: the request's GPU with all of them (the bench's 'heads' axis)
        span = {"low": per_layer, "mid": (per_layer + per_layer_high) / 2, "high": per_layer_high}
        attn = costs.layers * span["mid"]
        row = {"budget": b, "tokens_per_round": tau, "verify_attention_us": attn, "attention_upper_bound": floor,
               "verify_attention_us_low": costs.layers * span["low"],
               "verify_attention_us_high": costs.layers * span["high"]}
        local = -(-batch // dep.gpus) * (b + 1)  # dp-ep: the requests of the busiest GPU
        for corner in CORNERS:
            attn = costs.layers * span[corner]
            parts = step_parts(costs, dep, topology, batch * (b + 1), corner, local)
            step = attn + parts["weights_us"] + parts["comm_us"] + parts["drafter_us"] * (b > 0) + parts["other_us"]
            if corner == "mid":
                row.update(parts)
                row["drafter_us"] = parts["drafter_us"] * (b > 0)
                row["step_us"] = step
                row["attention_share"] = attn / step
                row["verify_attention_us"] = attn
            row[f"tokens_per_s_{corner}"] = batch * tau / step * 1e6
        row["tokens_per_s"] = row["tokens_per_s_mid"]
        rows.append(row)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    for r in rows:
        r["best"] = r is best
    return rows


def sensitivity(costs, dep, topology, attention, acceptance, budgets, batch, attention_high=None) -> list[dict]:
    """Each uncertain input at its low and its high end, the others at their middle: the best budget and its
    tokens/s at each, the inputs ordered by how far they move the best tokens/s."""
    from dataclasses import replace

    out = []
    for name in ("bandwidth_efficiency", "link_gbps", "latency_us", "drafter_us", "other_us"):
        span = getattr(dep, name)
        ends = {}
        for end in ("low", "high"):
            pinned = Span(span.at(end), span.at(end), span.source)
            rows = projection(costs, replace(dep, **{name: pinned}), topology, attention, acceptance, budgets, batch,
                              attention_high=attention_high)
            best = next(r for r in rows if r["best"])
            ends[f"at_{end}"] = {"best_budget": best["budget"], "tokens_per_s": best["tokens_per_s"]}
        out.append({"input": name, "low": span.low, "high": span.high, "source": span.source, **ends,
                    "swing": abs(ends["at_high"]["tokens_per_s"] - ends["at_low"]["tokens_per_s"]),
                    "moves_best_budget": ends["at_low"]["best_budget"] != ends["at_high"]["best_budget"]})
    if attention_high:  # the verify attention's own range (kdev plan --project's)
        ends = {}
        for end, times in (("low", attention), ("high", attention_high)):
            rows = projection(costs, dep, topology, times, acceptance, budgets, batch)
            best = next(r for r in rows if r["best"])
            ends[f"at_{end}"] = {"best_budget": best["budget"], "tokens_per_s": best["tokens_per_s"]}
        top = max(attention)
        out.append({"input": "verify_attention_us", "low": attention[top], "high": attention_high[top],
                    "source": f"kdev plan --project's range (at budget {top}: low .. high)", **ends,
                    "swing": abs(ends["at_high"]["tokens_per_s"] - ends["at_low"]["tokens_per_s"]),
                    "moves_best_budget": ends["at_low"]["best_budget"] != ends["at_high"]["best_budget"]})
    return sorted(out, key=lambda x: -x["swing"])


def plot(path: Path, rows: list[dict], title: str) -> None:
    """tokens/s against the budget (and the verify attention's share of the step), written atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from kdev.errors import EnvironmentMissing

        raise EnvironmentMissing("--plot needs matplotlib (pip install 'kdev[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["budget"] for r in rows]
    ax.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label="tokens/s")
    ax.fill_between(xs, [r["tokens_per_s_high"] for r in rows], [r["tokens_per_s_low"] for r in rows], alpha=0.2)
    best = next(r for r in rows if r["best"])
    ax.annotate(f"best: {best['budget']}", (best["budget"], best["tokens_per_s"]), textcoords="offset points",
                xytext=(0, 8), ha="center")
    ax.set_xscale("symlog", base=2, linthresh=1)
    ax.set_xlabel("node budget")
    ax.set_ylabel("tokens/s (whole batch)")
    share = ax.twinx()
    share.plot(xs, [100 * r["attention_share"] for r in rows], color="gray", linestyle="--",
               label="verify attention, % of step")
    share.set_ylabel("verify attention, % of the step")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)
