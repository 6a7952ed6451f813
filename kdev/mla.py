"""Float64 MLA reference: the un-absorbed form, the absorbed form, and the kernel-contract reference.

Un-absorbed (what the model computes, per head h):
    k_nope_h = W_UK_h · c_kv            (128 <- 512)
    score    = scale · (q_nope_h · k_nope_h + rope(q_pe_h) · rope(k_pe))
    o_h      = Σ softmax(score) · (W_UV_h · c_kv)
Absorbed (what the kernels compute): q_lat_h = W_UK_hᵀ · q_nope_h (512 wide), so
    score    = scale · ([q_lat_h, rope(q_pe_h)] · [c_kv, rope(k_pe)])      (576-wide rows)
    o_lat_h  = Σ softmax(score) · c_kv                                      (512 wide)
and o_h = W_UV_h · o_lat_h. The two agree up to float64 rounding.

RoPE uses DeepSeek-V3's YaRN frequencies. Two pairings of the 64 rope dims exist: real checkpoints (rope_interleave
true, as DeepSeek-V3 and Kimi K2 ship, and as transformers and SGLang rotate them) turn dims (2i, 2i+1) together,
"interleaved"; the rotate-half pairing turns dims (i, i+32), "half". apply_rope takes the layout by name, the
default the checkpoints'. They differ by a fixed permutation of the dims (deinterleave): rotating the deinterleaved
vector by halves gives the deinterleaved rotation, so scores agree whenever q and k share one layout, and the
kernels, which see rotated rows only, take either.
Everything runs in torch float64 so that large references can run on a GPU (--device cuda).

An FP8 (e4m3) latent cache (kdtree.h KDTREE_KV_FP8_E4M3) holds float8 e4m3fn values and one scale: a row's value is
the stored value times kv_scale, exactly (3 significant bits times a float32's 24 fit float64's 53). The reference
reads that dequantized cache; it is the golden of an e4m3 case. What SGLang does and what kdev's contract decides:
- SGLang's MLA pool (MLATokenToKVPool, store_dtype viewed as float8_e4m3fn) stores k / k_scale and takes no scale
  itself; its extend kernel multiplies the scores by k_scale and P.V by v_scale; an uncalibrated layer's k_scale is
  None, read as 1.0. kdev takes one scale: for MLA the value is the first 512 columns of the key row, so one stored
  row and one scale serve both (a caller with k_scale != v_scale has no MLA cache kdev can read).
- The tree's own rows: SGLang's extend kernel takes them from the forward's bf16 k, not the pool. kdev's contract
  reads every row, prefix and tree, from the one pool: one pointer, one page walk, one dtype per call, and the tree's
  rows are what every later step reads anyway once accepted. A caller writes the tree's k into the pool before the
  call (SGLang's backends save the KV before attention). The difference from SGLang's Triton path is one e4m3 rounding
  of the T tree rows of a step, no more; the goldens and the emulation below read the pool for them too.

The kernels' arithmetic on an e4m3 cache (emulate_dequantizing_kernel) is decided here, and the tolerances of e4m3
cases (cases.E4M3_TOLERANCES) are derived from it: dequantize each e4m3 value to bf16 on its way into shared memory,
unscaled, and run the bf16 kernels' tensor-core loops unchanged; kv_scale enters in fp32, folded into the softmax
scale for the scores and once into O before its bf16 rounding. Why bf16 and unscaled: every e4m3fn value (3 mantissa
bits, exponents 2^-9..2^8) is a bf16 value exactly, so the conversion rounds nothing and the kernel's error is the bf16
kernel's own (P rounded to bf16 before P.V, the output rounded to bf16); dequantizing to value x scale in bf16 would
round every element again, and to fp32 would leave the tensor cores (no fp32 operand mma). The alternative, e4m3
tensor-core math (Q and P quantized to e4m3, V transposed), is emulated by emulate_e4m3_mma for its accuracy cost;
kernels/NOTES.md "FP8 cache: the prediction" weighs the two. (mxfp8 block scales are not in the contract.)
"""

from __future__ import annotations

import math

import torch

from kdev import cabi
from kdev.config import LATENT_DIM, QK_DIM, ModelConfig


# ------------------------------------------------------------------------------------------------ RoPE
def yarn_inv_freq(model: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim/2] with YaRN's interpolation ramp (float64)."""
    dim, base, y = model.qk_rope_head_dim, model.rope_theta, model.yarn
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / base**exponents
    if y.factor <= 1.0:
        return freq_extra
    freq_inter = freq_extra / y.factor

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # 1 for high-frequency pairs (kept), 0 for low-frequency ones (interpolated)
    return freq_inter * (1 - extrapolate) + freq_extra * extrapolate


def yarn_rope_mscale(model: ModelConfig) -> float:
    """cos/sin multiplier: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 for Kimi / DeepSeek)."""
    y = model.yarn

    def m(scale: float, md: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * md * math.log(scale) + 1.0

    return m(y.factor, y.mscale) / m(y.factor, y.mscale_all_dim)


ROPE_LAYOUTS = ("interleaved", "half")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairing -> rotate-half pairing: dims (2i, 2i+1) become (i, i + dim/2)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


def interleave(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half pairing -> interleaved pairing (deinterleave's inverse)."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], -1).flatten(-2)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, model: ModelConfig, layout: str = "interleaved") -> torch.Tensor:
    """Rotate x[..., rope_dim] at integer positions (broadcast over x's leading dims after the first), its pairs in
    `layout` (module docstring): interleaved, the checkpoints', or half. The result is in the same layout."""
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope layout {layout!r}: one of {', '.join(ROPE_LAYOUTS)}")
    if layout == "interleaved":
        return interleave(apply_rope(deinterleave(x), positions, model, "half"))
    inv_freq = yarn_inv_freq(model).to(x.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [S, dim/2]
    m = yarn_rope_mscale(model)
    cos = torch.cat([angles.cos(), angles.cos()], -1) * m
    sin = torch.cat([angles.sin(), angles.sin()], -1) * m
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


# ------------------------------------------------------------------------------------------- attention
def unabsorbed_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, q_pos, kv_pos, mask, model: ModelConfig):
    """The model's own form. q_nope [N,H,128], q_pe [N,H,64] (not yet rotated), c_kv [S,512],
    k_pe [S,64] (not yet rotated), w_uk / w_uv [H,128,512], mask [N,S] bool (True = attend).
    Returns o [N,H,v_head_dim] float64."""
    scale = model.softmax_scale
    k_nope = torch.einsum("hdc,sc->shd", w_uk, c_kv)  # [S,H,128]
    v = torch.einsum("hdc,sc->shd", w_uv, c_kv)  # [S,H,128]
    qr = apply_rope(q_pe, q_pos, model)
    kr = apply_rope(k_pe, kv_pos, model)
    scores = torch.einsum("nhd,shd->nhs", q_nope, k_nope) + torch.einsum("nhd,sd->nhs", qr, kr)
    scores = (scores * scale).masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("nhs,shd->nhd", torch.softmax(scores, -1), v)


def absorb(q_nope, q_pe, c_kv, k_pe, w_uk, q_pos, kv_pos, model: ModelConfig):
    """Kernel-layout rows: q [N,H,576] = [W_UKᵀ q_nope, rope(q_pe)], k [S,576] = [c_kv, rope(k_pe)]."""
    q_lat = torch.einsum("hdc,nhd->nhc", w_uk, q_nope)
    q = torch.cat([q_lat, apply_rope(q_pe, q_pos, model)], -1)
    k = torch.cat([c_kv, apply_rope(k_pe, kv_pos, model)], -1)
    return q, k


def absorbed_attention(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float,
                       max_elems: int = 1 << 26):
    """q [N,H,576], k [S,576] (values = k[:, :512]), mask [N,S] bool -> (o_lat [N,H,512], lse [N,H]) in float64.
    lse is ln Σ exp(scale·score) over attended keys (-inf for a row that attends to nothing).
    Rows are processed in chunks so that a 128K-token prefix does not need an [N·H, S] score matrix at once."""
    q, k = q.to(torch.float64), k.to(torch.float64)
    N, H, _ = q.shape
    S = k.shape[0]
    out = torch.empty(N, H, LATENT_DIM, dtype=torch.float64, device=q.device)
    lse = torch.empty(N, H, dtype=torch.float64, device=q.device)
    step = max(1, max_elems // max(1, S * H))
    v = k[:, :LATENT_DIM]
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        s = torch.einsum("nhd,sd->nhs", q[n0:n1], k) * scale
        s = s.masked_fill(~mask[n0:n1, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - row_lse[..., None].clamp(min=-1e300))  # an empty row stays all zero
        p = torch.nan_to_num(p, nan=0.0)
        out[n0:n1] = torch.einsum("nhs,sc->nhc", p, v)
        lse[n0:n1] = row_lse
    return out, lse


# ------------------------------------------------------------------------------- the kernel contract
def unpack_tree_mask(tree_mask: torch.Tensor, rows: slice, T: int) -> torch.Tensor:
    """tree_mask [N_q, W] (uint64 bits stored as int64) -> bool [T, T] for one request's rows."""
    words = tree_mask[rows].to(torch.int64)
    j = torch.arange(T, device=words.device)
    bits = (words[:, j // 64] >> (j % 64)) & 1
    return bits.bool()


def gather_kv(kv_cache: torch.Tensor, page_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Logical rows 0..length-1 of one request from the paged cache [pages, page_size, 576]."""
    page_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    return kv_cache[cabi.kv_page_offset(page_table_row.to(kv_cache.device).long(), pos, page_size)]


def dequantize(rows: torch.Tensor, kv_scale: float | None) -> torch.Tensor:
    """Cache rows as float64 values: an e4m3 row's stored values times kv_scale (None: 1.0, SGLang's uncalibrated
    scale), exactly; any other dtype upcast exactly."""
    x = rows.to(torch.float64)
    if rows.dtype == torch.float8_e4m3fn:
        x = x * float(torch.tensor(1.0 if kv_scale is None else kv_scale, dtype=torch.float32))  # the params' float
    return x


def _requests(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, device):
    """Per request with a tree: (rows r0:r1, its L + T stored cache rows on `device`, its mask [T, L + T])."""
    kv_cache, tree_mask = kv_cache.to(device=device), tree_mask.to(device)
    for b in range(len(prefix_lens)):
        L = int(prefix_lens[b])
        r0, r1 = int(q_indptr[b]), int(q_indptr[b + 1])
        T = r1 - r0
        if T == 0:
            continue
        mask = torch.ones(T, L + T, dtype=torch.bool, device=device)
        mask[:, L:] = unpack_tree_mask(tree_mask, slice(r0, r1), T)
        yield slice(r0, r1), gather_kv(kv_cache, page_table[b], L + T), mask


def reference_verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale: float,
                          device: str | torch.device = "cpu", kv_scale: float | None = None):
    """Float64 reference of kdtree_verify_attn (docs/architecture.md §2). Inputs in kernel layout (any dtype; they are
    upcast exactly; an e4m3 cache is dequantized with kv_scale, exactly). Returns (out [N_q,H,512] float64,
    lse [N_q,H] float64) on `device`."""
    q = q.to(device=device, dtype=torch.float64)
    N_q, H, D = q.shape
    assert D == QK_DIM
    out = torch.empty(N_q, H, LATENT_DIM, dtype=torch.float64, device=device)
    lse = torch.empty(N_q, H, dtype=torch.float64, device=device)
    for rows, k, mask in _requests(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, device):
        out[rows], lse[rows] = absorbed_attention(q[rows], dequantize(k, kv_scale), mask, scale)
    return out, lse


# ------------------------------------------------------------------------------- e4m3 cache: the kernels' arithmetic
def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (round to nearest even), back in float64."""
    return x.to(dtype).to(torch.float64)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _softmax_pv(s: torch.Tensor, mask: torch.Tensor, v: torch.Tensor, p_dtype: torch.dtype):
    """Masked softmax of fp32 scores s [T,H,S] and P.V, as the flash kernels round: P = exp(s - max) in fp32, rounded
    to p_dtype for the tensor cores' P.V, its row sum l taken before that rounding; O = (P.V) / l in fp32; lse in fp32."""
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = _round(torch.exp(s - m), torch.float32)
    l_sum = _round(p.sum(-1), torch.float32)
    o = _round(torch.einsum("ths,sc->thc", _round(p, p_dtype), v), torch.float32) / l_sum[..., None]
    return _round(o, torch.float32), _round(m[..., 0] + torch.log(l_sum), torch.float32)


def emulate_dequantizing_kernel(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale: float,
                                kv_scale: float | None):
    """What a flash kernel that dequantizes an e4m3 cache to bf16 on its way into shared memory computes (module
    docstring), at its rounding points: the stored e4m3 values as bf16 (exact), scores in fp32 times the fp32 product
    fp32(scale) x fp32(kv_scale), P rounded to bf16 for P.V, O times kv_scale in fp32, then rounded to bf16. The sums
    themselves are taken in float64 (the kernels' fp32 accumulation orders differ among themselves by ~2^-24 relative,
    far under the roundings modelled). Returns (out [N_q,H,512] as bf16 values in float64, lse [N_q,H] float64)."""
    q64 = q.to(torch.float64)
    ks = _f32(1.0 if kv_scale is None else kv_scale)
    eff = _f32(_f32(scale) * ks)
    out = torch.full((q.shape[0], q.shape[1], LATENT_DIM), float("nan"), dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float64)
    for rows, k, mask in _requests(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, "cpu"):
        kb = _round(k.to(torch.float64), torch.bfloat16)  # e4m3 -> bf16: exact (an e4m3 value is a bf16 value)
        s = _round(_round(torch.einsum("thd,sd->ths", q64[rows], kb), torch.float32) * eff, torch.float32)
        o, lse[rows] = _softmax_pv(s, mask, kb[:, :LATENT_DIM], torch.bfloat16)
        out[rows] = _round(_round(o * ks, torch.float32), torch.bfloat16)
    return out, lse


def emulate_e4m3_mma(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale: float, kv_scale: float | None,
                     q_scaled: bool = True):
    """The other design's arithmetic, for its accuracy cost: e4m3 tensor-core math. Q is quantized to e4m3 (q_scaled:
    with one fp32 scale per call, amax / 448, folded into the softmax scale; else cast as it is, as SGLang's other fp8
    paths do), the e4m3 cache is read as it is, scores accumulate in fp32; P (in [0, 1] after the row max) is quantized
    to e4m3 for an e4m3 P.V (values under e4m3's smallest subnormal, 2^-9, become 0), O times kv_scale, rounded to
    bf16. Returns (out, lse) as emulate_dequantizing_kernel."""
    q64 = q.to(torch.float64)
    ks = _f32(1.0 if kv_scale is None else kv_scale)
    qs = _f32(float(q64.abs().max()) / float(torch.finfo(torch.float8_e4m3fn).max)) if q_scaled else 1.0
    qq = _round(q64 / qs, torch.float8_e4m3fn)
    eff = _f32(_f32(_f32(scale) * ks) * qs)
    out = torch.full((q.shape[0], q.shape[1], LATENT_DIM), float("nan"), dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float64)
    for rows, k, mask in _requests(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, "cpu"):
        k8 = k.to(torch.float64) if k.dtype == torch.float8_e4m3fn else _round(k.to(torch.float64), torch.float8_e4m3fn)
        s = _round(_round(torch.einsum("thd,sd->ths", qq[rows], k8), torch.float32) * eff, torch.float32)
        o, lse[rows] = _softmax_pv(s, mask, k8[:, :LATENT_DIM], torch.float8_e4m3fn)
        out[rows] = _round(_round(o * ks, torch.float32), torch.bfloat16)
    return out, lse
