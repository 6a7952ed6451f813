"""Comparison metrics and verdicts, shared by verify, bench sanity checks and tests.

An element passes when |got - want| <= atol OR <= rtol * |want| (both finite); NaN and Inf positions (and
the sign of Inf) must match exactly. Over the finite pairs, the cosine difference 1 - 2Σab / Σ(a² + b²) is
computed in float64 and must stay under its bound. A verdict names the worst elements with their indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdev.config import Tolerance


@dataclass
class Comparison:
    name: str
    passed: bool
    numel: int
    frac_passed: float
    max_abs: float
    max_rel: float
    cos_diff: float
    nonfinite_mismatch: int
    worst: list = field(default_factory=list)  # [(index tuple, got, want, abs error)]
    reason: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denom = (a * a + b * b).sum().item()
    if denom == 0.0:
        return 0.0
    return 1.0 - 2.0 * (a * b).sum().item() / denom


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance, worst_k: int = 5) -> Comparison:
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(name, False, want.numel(), 0.0, float("inf"), float("inf"), 1.0, want.numel(),
                          reason=f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    # on the GPU when the output is there: a fuzz case's out has up to 3.4e7 elements, slow in CPU float64
    dev = got.device if got.device.type == "cuda" else want.device
    g = got.detach().to(dev, torch.float64)
    w = want.detach().to(dev, torch.float64)
    nan_bad = torch.isnan(g) != torch.isnan(w)
    inf_bad = (torch.isinf(g) | torch.isinf(w)) & ~((g == w) & torch.isinf(w))
    nonfinite_bad = nan_bad | inf_bad
    both = torch.isfinite(g) & torch.isfinite(w)
    err = torch.where(both, (g - w).abs(), torch.zeros_like(g))
    rel = torch.where(both & (w != 0), err / w.abs().clamp_min(1e-300), torch.zeros_like(g))
    ok = both & ((err <= tol.atol) | (err <= tol.rtol * w.abs()))
    ok |= ~both & ~nonfinite_bad  # matching NaN / Inf positions pass
    n = g.numel()
    n_ok = int(ok.sum())
    cd = cos_diff(g[both], w[both]) if bool(both.any()) else 0.0
    # Worst elements: failing ones first (non-finite mismatches count as infinite error).
    score = torch.where(nonfinite_bad, torch.full_like(err, float("inf")), err)
    k = min(worst_k, n)
    worst = []
    if k:
        vals, idx = torch.topk(score.flatten(), k)
        for v, i in zip(vals.tolist(), idx.tolist()):
            pos = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), g.shape))
            worst.append((pos, g[pos].item(), w[pos].item(), v))
    reasons = []
    nfb = int(nonfinite_bad.sum())
    if nfb:
        reasons.append(f"{nfb} NaN/Inf position mismatch(es)")
    out_of_tol = n - n_ok - nfb
    if out_of_tol > 0:
        reasons.append(f"{out_of_tol} element(s) beyond atol {tol.atol:g} / rtol {tol.rtol:g}")
    if cd > tol.cos_diff:
        reasons.append(f"cos_diff {cd:.3e} > {tol.cos_diff:.1e}")
    return Comparison(
        name=name, passed=not reasons, numel=n, frac_passed=n_ok / n if n else 1.0,
        max_abs=float(err.max()) if n else 0.0, max_rel=float(rel.max()) if n else 0.0, cos_diff=cd,
        nonfinite_mismatch=nfb, worst=worst, reason="; ".join(reasons))
