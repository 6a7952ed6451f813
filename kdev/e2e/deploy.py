"""The budget curve of a real deploy: which node budget makes tree speculation fastest on a given model and GPU.

A decoding step verifies B trees of (budget + 1) nodes; it emits B x tau tokens, tau the mean tokens per round at that
budget. Its time is the verify attention of every layer (measured: a `kdev bench` result over budgets) plus the rest
of the step, from a declared cost model (configs/steps/*.yaml, each constant with its source): the weights read (for
an MoE, the routed experts the step's tokens touch: a tree of 65 tokens at B = 1 touches ~286 of 384 experts), the
all-reduces. tau comes from an acceptance curve given as a file (measured in production, say), not from the tiny
model's drafter. tokens/s = B x tau / step time, per budget; the best budget is the curve's maximum.

What the model ignores, and says so: routing is taken as uniform over experts (real routing is skewed: fewer experts
touched, so the weight term is an upper bound); weight reads run at the GPU's memory bandwidth with nothing
overlapped; every other kernel of the step (norms, the drafter, sampling) is left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kdev.config import CONFIG_DIR, _Reader, load_gpus, load_yaml
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


def load_step_costs(path: Path) -> StepCosts:
    r = _Reader(load_yaml(Path(path)), Path(path), "")
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
    r.done()
    return StepCosts(name, gpus[gpu].name, gpus[gpu].bytes_per_s, **vals, **floats)


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
    r = _Reader(load_yaml(Path(path)), Path(path), "")
    curve = r.get("tokens_per_round", dict)
    try:
        points = {int(k): float(v) for k, v in curve.items()}
    except (TypeError, ValueError):
        raise BadInput(f"{path}: tokens_per_round maps budgets (whole numbers) to tokens per round") from None
    if not points or any(b < 1 or t < 1.0 for b, t in points.items()):
        raise BadInput(f"{path}: tokens_per_round needs budgets >= 1 and at least 1 token per round (the bonus)")
    source = r.get("source", str, "not given")
    r.done()
    return points, source


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


def budget_curve(costs: StepCosts, attention: dict, acceptance: dict, budgets: list[int], batch: int) -> list[dict]:
    rows = []
    for b in budgets:
        tau = _interpolate(acceptance, b, "acceptance curve", log=True)
        attn = costs.layers * _interpolate(attention, b, "attention timings")
        rest = costs.rest_of_step(batch * (b + 1))
        step = attn + rest["weights_us"] + rest["allreduce_us"]
        rows.append({"budget": b, "tokens_per_round": tau, "verify_attention_us": attn, **rest, "step_us": step,
                     "attention_share": attn / step, "tokens_per_s": batch * tau / step * 1e6})
    best = max(rows, key=lambda r: r["tokens_per_s"])
    for r in rows:
        r["best"] = r is best
    return rows


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
    best = next(r for r in rows if r["best"])
    ax.annotate(f"best: {best['budget']}", (best["budget"], best["tokens_per_s"]), textcoords="offset points",
                xytext=(0, 8), ha="center")
    ax.set_xscale("log", base=2)
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
