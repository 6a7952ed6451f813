"""The speculative path's attention: transformers' DeepseekV3Attention swapped for an absorbed-MLA adapter over a paged
latent cache, everything else of the model left as it is.

The adapter uses the module's own projections and norms; RoPE is kdev's own (kdev/mla.py: apply_rope with its YaRN
frequencies, in the checkpoints' interleaved layout) at each node's position, prefix + depth, while the oracle rotates
with transformers' function (oracle.py checks the two YaRNs agree), so RoPE layout, YaRN, absorption and positions are
checked against code kdev did not write. Per layer it writes each node's latent row (c_kv, rotated k_pe: 576 wide) at
its slot, prefix + node index, then calls the verify attention (kdev's contract: docs/architecture.md §2) on the whole
batch of trees: `reference` (float64, kdev/mla.py), `bf16-emulated` (the kernels' arithmetic on the CPU: bf16 q, cache
and output, bf16 P in P.V, fp32 accumulation and softmax) or a kernel through torch.ops.kdev.verify_attn (bf16).
Each layer's latent output is kept for the forward (run.py's bf16 error bound reads it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kdev import cabi, mla, registry

EMULATED = "bf16-emulated"  # the kernels' arithmetic on the CPU
KERNELS = tuple(k for k in registry.VERIFY_KERNELS if k not in registry.WGMMA_ONLY)
BACKENDS = ("reference", *KERNELS, EMULATED)  # float64, a verify call, or the emulation
# planted faults in the attention's inputs (run.py plants those of the tree ops)
MUTANTS = ("scale", "rope-index", "prev-page", "mask-bit", "kv-position")


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
    bits, where each node's latent row is written (its request and slot position) and the position RoPE rotates it at.
    `mutant` names a planted fault (for the tests that show the check catching it): "scale" (softmax scale x 1.001),
    "rope-index" (RoPE at prefix + node index, not prefix + depth), "prev-page" (each request's last page read through
    the page table's previous entry), "mask-bit" (node 1 of every tree does not see its root), "kv-position" (two
    nodes' rows written in each other's slots)."""

    q_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    tree_mask: torch.Tensor
    request: torch.Tensor  # [N] request of each node row
    position: torch.Tensor  # [N] its slot position (prefix length + node index: the kernel's slot rule)
    max_qlen: int
    max_kv_len: int
    mutant: str | None = None
    rope_position: torch.Tensor | None = None  # [N] prefix length + depth (None: a chain, where it is `position`)
    rope_offset: int = 0  # added to every RoPE position (run.Settings.position_offset)

    def rope_positions(self) -> torch.Tensor:
        if self.mutant == "rope-index" or self.rope_position is None:
            return self.position + self.rope_offset
        return self.rope_position + self.rope_offset


def emulated_verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale: float) -> torch.Tensor:
    """The kernels' arithmetic on the CPU: q and the cache in bf16, scores and the softmax in fp32 (max subtracted),
    P rounded to bf16 for P.V with fp32 accumulation, divided by the fp32 row sum, the output rounded to bf16.
    Returns out [N_q, H, 512] float64 (bf16 values)."""
    qf = q.to(torch.bfloat16).float()
    out = torch.empty(q.shape[0], q.shape[1], cabi.LATENT_DIM, dtype=torch.float64, device=q.device)
    for b in range(len(prefix_lens)):
        L, r0, r1 = int(prefix_lens[b]), int(q_indptr[b]), int(q_indptr[b + 1])
        T = r1 - r0
        if T == 0:
            continue
        k = mla.gather_kv(kv_cache, page_table[b], L + T).to(torch.bfloat16).float()
        allowed = torch.ones(T, L + T, dtype=torch.bool, device=q.device)
        allowed[:, L:] = mla.unpack_tree_mask(tree_mask, slice(r0, r1), T)
        s = torch.einsum("nhd,sd->nhs", qf[r0:r1], k) * scale
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        o = torch.einsum("nhs,sc->nhc", p.to(torch.bfloat16).float(), k[:, :cabi.LATENT_DIM]) / p.sum(-1, keepdim=True)
        out[r0:r1] = o.to(torch.bfloat16).double()
    return out


class LatentAttention:
    """The verify attention of one forward, shared by every layer's adapter."""

    def __init__(self, cache: PagedLatentCache, backend: str, sync, rope_model=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
        self.cache, self.backend, self.sync = cache, backend, sync
        self.rope_model = rope_model  # kdev's ModelConfig for apply_rope (oracle.kdev_config); None: the model's cos/sin
        self.step: VerifyStep | None = None
        self.outputs: dict = {}  # layer -> its latent output [N, H, 512] of the last forward (float64)
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
        mask, table = step.tree_mask, cache.page_table
        if step.mutant == "mask-bit":
            starts = step.q_indptr[:-1].long()
            ones = starts[(step.q_indptr[1:] - step.q_indptr[:-1]).long() > 1]
            mask = mask.clone()
            mask[ones + 1, 0] &= ~1  # node 1 of every tree stops seeing its root
        if step.mutant == "scale":
            scale = scale * 1.001
        if step.mutant == "prev-page":
            table = table.clone()
            last = ((step.prefix_lens.long() + (step.q_indptr[1:] - step.q_indptr[:-1]).long() - 1)
                    // cache.page_size)
            for b, p in enumerate(last.tolist()):
                if p > 0:
                    table[b, p] = table[b, p - 1]
        if self.timed:
            self.sync()
        t0 = time.perf_counter()
        if self.backend == "reference":
            out, _ = mla.reference_verify_attn(q_rows, pool, table, step.prefix_lens, step.q_indptr, mask,
                                               scale, device=q_rows.device)
        elif self.backend == EMULATED:
            out = emulated_verify_attn(q_rows, pool, table, step.prefix_lens, step.q_indptr, mask, scale)
        else:
            import kdev.ops  # registers torch.ops.kdev

            if self.schedule is None:
                self.schedule = kdev.ops.StepSchedule(self.backend)
            ws = self.schedule.workspace(layer, step.prefix_lens, step.q_indptr, q_rows.shape[1], cache.page_size,
                                         step.max_qlen, step.max_kv_len)
            out, _ = kdev.ops.attend(q_rows.to(torch.bfloat16), pool, table, step.prefix_lens,
                                     step.q_indptr, mask, scale, self.backend, step.max_qlen, step.max_kv_len, ws)
        if self.timed:
            self.sync()
            self.seconds += time.perf_counter() - t0
        out = out.to(q_rows.dtype)
        self.outputs[layer] = out
        return out


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
        if self.latent.rope_model is not None:  # kdev's RoPE and YaRN (kdev/mla.py), interleaved as checkpoints are
            pos = self.latent.step.rope_positions()
            q_rot = mla.apply_rope(q_rot.transpose(1, 2).reshape(b * s, a.num_heads, -1), pos, self.latent.rope_model)
            k_rot = mla.apply_rope(k_rot.reshape(b * s, -1), pos, self.latent.rope_model)
        else:
            cos, sin = position_embeddings
            rotate = stock.apply_rotary_pos_emb_interleave if a.config.rope_interleave else stock.apply_rotary_pos_emb
            q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
            q_rot, k_rot = q_rot.transpose(1, 2).reshape(b * s, a.num_heads, -1), k_rot[:, 0].reshape(b * s, -1)
        q_lat = torch.einsum("bhsd,hdc->bshc", q_nope, self.w_uk).reshape(b * s, a.num_heads, -1)
        q_rows = torch.cat([q_lat, q_rot.to(q_lat.dtype)], -1)
        k_rows = torch.cat([c_kv.reshape(b * s, -1), k_rot.to(c_kv.dtype)], -1)
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
