"""The verdict of `kdev e2e`: at every accepted and bonus position, the verify forward's logits against the oracle's.

A compared position is a tree node on the accepted path (its logits give the next accepted token or the bonus token)
or a prompt's last token (they give the first generated token). The oracle's logits there are those of transformers'
greedy decoding at the same generated index: the speculative run is teacher-forced onto the oracle's tokens (a
position whose argmax differs but whose logits are within the bound is a near-tie: excused, and the oracle's token is
taken), so every position has its oracle twin however many near-ties came before.

A position passes when |logit_v - oracle_v| <= bound_v for every vocabulary entry v:

- float64 (backend `reference`): bound_v = F64_REL x (1 + max |oracle logit|): the two paths differ only by the order
  of float64 operations (absorbed against un-absorbed attention, kdev's RoPE against transformers').
- bf16 (a kernel, or `bf16-emulated`): the float64 bound plus SIGMAS x PROPAGATION standard deviations of the error
  the kernels' arithmetic puts on the logits, to first order. The logits are linear in each layer's latent output
  o [H, 512] along the residual stream (W_UV, o_proj, the final RMSNorm at this row's scale, the LM head: M_l
  [vocab, H, 512] per layer l). Two kinds of noise are put on o, with s[h, c] = |o[h, c]| + rms_c o[h, :]:
  - independent in every head and element, standard deviation BF16_REL x s (one bf16 ulp of the element or of its
    row: the output's own rounding is half an ulp, P rounded to bf16 in P.V adds about as much);
  - shared by every head, SHARED_REL x s (the latent rows' rounding, uniform in half an ulp: MLA has one KV head, so
    every head reads the same rounded rows, and their errors add up across heads before they are squared);
  sigma_v^2 = sum_l [ sum_hc (M_l[v,h,c] BF16_REL s)^2 + sum_c (sum_h M_l[v,h,c] SHARED_REL s)^2 ] / rms^2.
  PROPAGATION covers what this leaves out: the score errors of the bf16 q and cache rows, which the softmax turns into
  output errors of their own, and any mixing of an earlier layer's error by later layers; its value puts the bound
  between what the emulation does and what a 0.1 % fault does. Measured (docs/e2e.md): the bf16-emulated run's
  largest |error| is 0.42 to 0.74 of this bound over the default matrix (0.90 with 64 heads), and a softmax scale
  x 1.001 reaches 1.34 to 1.62 of it (2.9 with 64 heads); tests/test_e2e.py checks both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64_REL = 2.0**-40  # ~9e-13: float64's 2^-52 with 2^12 of room for the order of operations
BF16_REL = 2.0**-8  # one bf16 ulp of the element or its row, independent across heads
SHARED_REL = 2.0**-9 / 3**0.5  # the latent rows' rounding (half an ulp, uniform), the same in every head
SIGMAS = 6.0
PROPAGATION = 1.6  # the score errors the sigma model leaves out (measured: see above)


@dataclass
class Position:
    """One compared position: the verify forward's logits against the oracle's at generated index `index`."""

    prompt: int
    round: int  # 0: the prefill's position
    index: int  # generated token index it predicts
    ratio: float  # max_v |logit_v - oracle_v| / bound_v (<= 1 passes)
    error: float  # max_v |logit_v - oracle_v|
    bound: float  # bound_v at that v
    got: int  # the verify forward's argmax
    want: int  # the oracle's token
    gap: float  # the oracle's top-2 gap
    status: str  # "ok", "excused" (a near-tie: argmax differs, logits within the bound), "fails"
    why: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Bounds:
    """The per-vocabulary-entry logit bound at a batch of rows, for one model and precision."""

    def __init__(self, model, bf16: bool):
        self.bf16 = bf16
        self.m = []
        if not bf16:
            return
        with torch.no_grad():
            lm = model.lm_head.weight.double() * model.model.norm.weight.double()  # [V, hidden]
            for layer in model.model.layers:
                a = getattr(layer.self_attn, "attn", layer.self_attn)
                h, nope, v = a.num_heads, a.qk_nope_head_dim, a.v_head_dim
                w_uv = a.kv_b_proj.weight.double().view(h, nope + v, a.kv_lora_rank)[:, nope:]  # [H, 128, 512]
                m = (lm @ a.o_proj.weight.double()).view(-1, h, v)  # [V, H, 128]
                self.m.append(torch.einsum("vhd,hdc->vhc", m, w_uv))  # [V, H, 512]

    def of(self, oracle_logits: torch.Tensor, outputs: list, inv_rms: torch.Tensor) -> torch.Tensor:
        """bound [R, V] at R rows: the oracle's logits there [R, V]; the bf16 case also each layer's latent output
        at those rows ([R, H, 512] per layer) and the final norm's 1 / rms per row [R]."""
        floor = F64_REL * (1.0 + oracle_logits.abs().amax(-1, keepdim=True))
        if not self.bf16:
            return floor.expand_as(oracle_logits)
        var = torch.zeros_like(oracle_logits)
        for o, m in zip(outputs, self.m):
            o = o.double().cpu()
            scale = o.abs() + o.square().mean(-1, keepdim=True).sqrt()  # [R, H, 512]
            # independent across heads and elements: the output's rounding, P's in P.V
            var += (BF16_REL * scale).square().reshape(len(o), -1) @ m.square().reshape(m.shape[0], -1).T
            # shared by every head: the latent rows' rounding (MLA's one KV head), summed over heads before squaring
            var += torch.einsum("vhc,rhc->rvc", m, SHARED_REL * scale).square().sum(-1)
        sigma = var.sqrt() * inv_rms.double().cpu()[:, None]
        return floor + SIGMAS * PROPAGATION * sigma


def judge(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, want_token: int) -> tuple[float, float, float,
                                                                                                 int, str]:
    """(ratio, error, bound, argmax, status) of one row: the largest |got - want| / bound, that error and its bound,
    the row's argmax and whether it passes, is an excused near-tie, or fails (NaN fails)."""
    diff = (got - want).abs()
    r = diff / bound
    r = torch.where(torch.isnan(r), torch.full_like(r, float("inf")), r)
    v = int(r.argmax())
    ratio = float(r[v])
    arg = int(got.argmax()) if not torch.isnan(got).any() else -1
    if ratio > 1.0:
        status = "fails"
    elif arg != want_token:
        status = "excused"
    else:
        status = "ok"
    return ratio, float(diff[v]), float(bound[v]), arg, status
