"""A drafter that proposes what DDTree's block drafter proposes: per depth 1..D after the root, the top-k tokens and
their log-probs, in one shot (no tree search of its own). It knows the target's greedy continuation and agrees with it
at a depth with probability `agree` (the true token ranked first); otherwise the true token sits at a lower rank or is
missing, and the other tokens are seeded noise. So acceptance lengths are realistic and set by one knob."""

from __future__ import annotations

import numpy as np


class OracleDrafter:
    def __init__(self, depth: int, topk: int, vocab: int, agree: float, seed: int):
        """depth, topk and agree as run.Settings.check admits them."""
        self.depth, self.topk, self.vocab, self.agree = depth, min(topk, vocab), vocab, agree
        self.rng = np.random.default_rng(seed)

    def propose(self, truth: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """log_probs [D, K] float32 (descending per depth) and token ids [D, K] int64, given the target's greedy tokens
        after the root (truth[d - 1] at depth d; shorter near the end of the reference)."""
        D, K = self.depth, self.topk
        lps = np.empty((D, K), np.float32)
        ids = np.empty((D, K), np.int64)
        for d in range(D):
            logits = np.sort(self.rng.standard_normal(K) * 2.0)[::-1]
            lp = logits - np.log(np.exp(logits - logits[0]).sum()) - logits[0]
            lps[d] = np.minimum(np.round(lp * 4096) / 4096, 0.0)  # exact in float32 on every machine
            true = truth[d] if d < len(truth) else -1
            others = self.rng.permutation(self.vocab)
            ids[d] = others[others != true][:K]
            if true >= 0:
                if self.rng.random() < self.agree:
                    ids[d, 0] = true
                elif K > 1 and self.rng.random() < 0.5:
                    ids[d, int(self.rng.integers(1, K))] = true
        return lps, ids
