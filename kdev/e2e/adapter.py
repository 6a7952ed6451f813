"""The speculative path's attention: transformers' DeepseekV3Attention swapped for an absorbed-MLA adapter over a paged
latent cache, everything else of the model left as it is.

The adapter uses the module's own projections and norms and transformers' own RoPE function with the cos/sin the
model hands every layer (its rotary table, float32 even in a float64 model), so RoPE layout, YaRN, absorption and
positions are checked against code kdev did not write. Per layer it writes each node's latent row (c_kv, rotated
k_pe: 576 wide) at its position's slot, then calls the verify attention (kdev's contract: docs/architecture.md §2)
on the whole batch of trees: `reference` (float64, kdev/mla.py) or a kernel through torch.ops.kdev.verify_attn (bf16).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kdev import cabi, mla, registry

BACKENDS = ("reference", *(k for k in registry.VERIFY_KERNELS if k not in registry.WGMMA_ONLY))  # float64, or a call


class PagedLatentCache:
    """One pool of [pages, page_size, 576] rows per layer and a page table [B, pages_per_request]: request b's position
    p lives in row p % page_size of its page p // page_size. Pages are handed out shuffled, so a wrong table lookup
    reads another request's rows; unwritten rows hold NaN, so reading one shows."""

    def __init__(self, layers: int, batch: int, max_len: int, page_size: int, dtype, device, seed: int):
        problem = cabi.page_size_problem(page_size)
        if problem:
            raise ValueError(problem)
        per = -(-max_len // page_size)
        order = np.random.default_rng(seed).permutation(batch * per + 1)
        self.page_size = page_size
        self.page_table = torch.from_numpy(order[: batch * per].reshape(batch, per).astype(np.int32)).to(device)
        self.pools = [torch.full((batch * per + 1, page_size, cabi.QK_DIM), float("nan"), dtype=dtype, device=device)
                      for _ in range(layers)]

    def slots(self, b: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row) of request b's position pos (elementwise)."""
        return self.page_table[b, pos // self.page_size].long(), pos % self.page_size


@dataclass
class VerifyStep:
    """One forward's trees, in kdev's contract: the rows of every request's nodes (q_indptr), prefix lengths, tree
    bits, and where each node's latent row is written (its request and position). `mutant` names a planted fault (for
    the tests that show the check catching it): "mask-bit" (a node does not see the root), "kv-position" (two nodes'
    rows written in each other's slots)."""

    q_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    tree_mask: torch.Tensor
    request: torch.Tensor  # [N] request of each node row
    position: torch.Tensor  # [N] its position (prefix length + node index: the kernel's slot rule)
    max_qlen: int
    max_kv_len: int
    mutant: str | None = None


class LatentAttention:
    """The verify attention of one forward, shared by every layer's adapter."""

    def __init__(self, cache: PagedLatentCache, backend: str, sync):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
        self.cache, self.backend, self.sync = cache, backend, sync
        self.step: VerifyStep | None = None
        self.schedule = None  # a scheduled kernel's, once per forward (kdev.ops.StepSchedule; made on first use)
        self.seconds = 0.0  # the verify attention's time, every layer and forward
        self.timed = True  # off while a CUDA graph is captured (no synchronisation is allowed there)

    def attend(self, layer: int, q_rows: torch.Tensor, k_rows: torch.Tensor, scale: float) -> torch.Tensor:
        step, cache = self.step, self.cache
        pool = cache.pools[layer]
        pos = step.position
        if step.mutant == "kv-position" and len(pos) > 2:
            pos = pos.clone()
            pos[[1, 2]] = pos[[2, 1]]
        page, row = cache.slots(step.request, pos)
        pool[page, row] = k_rows.to(pool.dtype)
        mask = step.tree_mask
        if step.mutant == "mask-bit" and int(step.q_indptr[1]) > 1:
            mask = mask.clone()
            mask[1, 0] &= ~1  # node 1 of the first tree stops seeing its root
        if self.timed:
            self.sync()
        t0 = time.perf_counter()
        if self.backend == "reference":
            out, _ = mla.reference_verify_attn(q_rows, pool, cache.page_table, step.prefix_lens, step.q_indptr, mask,
                                               scale, device=q_rows.device)
        else:
            import kdev.ops  # registers torch.ops.kdev

            if self.schedule is None:
                self.schedule = kdev.ops.StepSchedule(self.backend)
            ws = self.schedule.workspace(layer, step.prefix_lens, step.q_indptr, q_rows.shape[1], cache.page_size,
                                         step.max_qlen, step.max_kv_len)
            out, _ = kdev.ops.attend(q_rows.to(torch.bfloat16), pool, cache.page_table, step.prefix_lens,
                                     step.q_indptr, mask, scale, self.backend, step.max_qlen, step.max_kv_len, ws)
        if self.timed:
            self.sync()
            self.seconds += time.perf_counter() - t0
        return out.to(q_rows.dtype)


class AbsorbedMLA(torch.nn.Module):
    """Stands in for one layer's DeepseekV3Attention: the same weights, the absorbed form, kdev's attention."""

    def __init__(self, attn: torch.nn.Module, layer: int, latent: LatentAttention):
        super().__init__()
        self.attn, self.layer, self.latent = attn, layer, latent
        h, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
        w = attn.kv_b_proj.weight.view(h, nope + v, attn.kv_lora_rank)
        self.w_uk, self.w_uv = w[:, :nope], w[:, nope:]  # [H, 128, 512] each

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as stock

        a = self.attn
        b, s, _ = hidden_states.shape
        if a.q_lora_rank is None:
            q = a.q_proj(hidden_states)
        else:
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hidden_states)))
        q = q.view(b, s, a.num_heads, a.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        c_kv, k_rot = torch.split(a.kv_a_proj_with_mqa(hidden_states), [a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        c_kv = a.kv_a_layernorm(c_kv)
        k_rot = k_rot.view(b, 1, s, a.qk_rope_head_dim)
        cos, sin = position_embeddings
        rotate = stock.apply_rotary_pos_emb_interleave if a.config.rope_interleave else stock.apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        q_lat = torch.einsum("bhsd,hdc->bshc", q_nope, self.w_uk)
        q_rows = torch.cat([q_lat, q_rot.transpose(1, 2)], -1).reshape(b * s, a.num_heads, cabi.QK_DIM)
        k_rows = torch.cat([c_kv, k_rot[:, 0]], -1).reshape(b * s, cabi.QK_DIM)
        o_lat = self.latent.attend(self.layer, q_rows, k_rows, a.scaling)  # [b*s, H, 512]
        o = torch.einsum("nhc,hdc->nhd", o_lat, self.w_uv).reshape(b, s, a.num_heads * a.v_head_dim)
        return a.o_proj(o), None


def swap_attention(model, latent: LatentAttention) -> list:
    """Put an adapter in every layer's self_attn; returns the stock modules (restore_attention puts them back)."""
    stock = []
    for i, layer in enumerate(model.model.layers):
        stock.append(layer.self_attn)
        layer.self_attn = AbsorbedMLA(layer.self_attn, i, latent)
    return stock


def restore_attention(model, stock: list) -> None:
    for layer, attn in zip(model.model.layers, stock):
        layer.self_attn = attn
