"""Token-exact: do a kernel's latent outputs pick the same tokens as the reference's?

The latent outputs [N, H, 512] are projected through a fixed, seeded per-head W_UV, an output projection and an LM
head (float64) to logits; the argmax at every tree node is compared, and the greedy accept walk (ddtree.py) is run
on both. A node whose reference top-2 logit margin is within the noise of bf16 outputs is a tie: reported, not
failed; a walk that differs only through tie nodes likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kdev import ddtree
from kdev.config import LATENT_DIM


class TokenProjector:
    """latent out [N, H, 512] -> logits [N, vocab]: per-head W_UV (128 x 512), an output projection
    (H*128 -> hidden) and an LM head (hidden -> vocab), all fixed by one seed, in float64."""

    def __init__(self, heads: int, vocab: int, device, seed: int = 20261202, hidden: int = 256):
        g = torch.Generator().manual_seed(seed)
        self.w_uv = (torch.randn(heads, 128, LATENT_DIM, generator=g, dtype=torch.float64) / LATENT_DIM**0.5).to(device)
        self.w_o = (torch.randn(heads * 128, hidden, generator=g, dtype=torch.float64) / (heads * 128) ** 0.5).to(device)
        self.lm = (torch.randn(hidden, vocab, generator=g, dtype=torch.float64) / hidden**0.5).to(device)

    def logits(self, o_lat: torch.Tensor) -> torch.Tensor:
        n, h, _ = o_lat.shape
        v = torch.einsum("nhc,hdc->nhd", o_lat.to(self.w_uv.device, torch.float64), self.w_uv)
        return v.reshape(n, h * 128) @ self.w_o @ self.lm

    def margin_sigma(self, o_ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rel_noise: float) -> torch.Tensor:
        """Standard deviation of logit[a] - logit[b] per node when every output element carries independent
        noise of standard deviation rel_noise * |o_ref| (the map is linear: sqrt(Σ g² σ²))."""
        d = (self.lm[:, a] - self.lm[:, b]).T  # [N, hidden]
        g = (d @ self.w_o.T).reshape(len(a), -1, 128)  # [N, H, 128]
        g = torch.einsum("nhd,hdc->nhc", g, self.w_uv)  # d(margin)/d(o_lat): [N, H, 512]
        o = o_ref.to(g.device, torch.float64)
        return ((g * o * rel_noise) ** 2).sum((1, 2)).sqrt()


# A bf16 output carries its own rounding (half an ulp, 2^-9 relative) plus the kernel's (bf16 P in P.V):
# one bf16 ulp (2^-8 of |o|) per element is a generous standard deviation for that noise. A node is a tie
# when the reference top-2 margin is within TIE_SIGMAS of it, for either side of a comparison.
TIE_REL_NOISE = 2.0**-8
TIE_SIGMAS = 6.0


@dataclass
class TokenResult:
    passed: bool
    nodes: int
    node_mismatches: int  # argmax differs at a node that is not a tie
    ties: int  # nodes whose margin is within the tolerance's noise
    walk_mismatches: int  # requests whose accepted path or bonus token differ (not explained by a tie)
    walk_ties: int  # requests whose walks differ only through tie nodes
    accepted: list = field(default_factory=list)  # per request: (accepted length, bonus token) from the test output

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def label(self) -> str:
        if not self.passed:
            return f"FAIL ({self.node_mismatches} nodes, {self.walk_mismatches} walks)"
        return "ok" + (f" ({self.ties} ties)" if self.ties else "")


def token_exact(proj: TokenProjector, trees: list, o_test: torch.Tensor, o_ref: torch.Tensor) -> TokenResult:
    lr = proj.logits(o_ref)
    lt = proj.logits(o_test)
    top = lr.topk(2, dim=-1)
    a, b = top.indices[:, 0], top.indices[:, 1]
    margin = top.values[:, 0] - top.values[:, 1]
    tie = margin <= TIE_SIGMAS * 2**0.5 * proj.margin_sigma(o_ref, a, b, TIE_REL_NOISE)  # both sides are noisy
    arg_t = lt.argmax(-1)
    node_bad = (arg_t != a) & ~tie
    arg_t, arg_r, tie_np = arg_t.cpu().numpy(), a.cpu().numpy(), tie.cpu().numpy()
    walk_bad = walk_tie = 0
    accepted = []
    row = 0
    for tree in trees:
        rows = slice(row, row + tree.size)
        acc_t = ddtree.accept_greedy(tree, arg_t[rows])
        acc_r = ddtree.accept_greedy(tree, arg_r[rows])
        accepted.append((len(acc_t.nodes), acc_t.bonus_token))
        if not (np.array_equal(acc_t.nodes, acc_r.nodes) and acc_t.bonus_token == acc_r.bonus_token):
            visited = set(acc_t.nodes.tolist()) | set(acc_r.nodes.tolist())
            if any(tie_np[row + i] for i in visited):
                walk_tie += 1
            else:
                walk_bad += 1
        row += tree.size
    n_bad = int(node_bad.sum())
    return TokenResult(passed=n_bad == 0 and walk_bad == 0, nodes=len(a), node_mismatches=n_bad,
                       ties=int(tie.sum()), walk_mismatches=walk_bad, walk_ties=walk_tie, accepted=accepted)
