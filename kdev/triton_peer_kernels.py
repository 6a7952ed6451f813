"""The triton peer's two kernels (kdev/triton_peer.py says what they compute and how). A module of its own:
triton is an optional dependency, imported only where the peer runs, and Triton resolves a kernel's callees
(attend_tile) among its module's globals."""

import triton
import triton.language as tl


@triton.jit
def attend_tile(q_lat, q_pe, m_i, l_i, acc, kv_ptr, table_row_ptr, mask_ptr, node, row_ok, n0, end, L,
                scale_log2, mask_words, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, QK: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr):
    # one KV step of BLOCK_N tokens from n0: scores, online softmax, O += P V. MASKED: the step reaches past
    # the prefix or past the run's end (the tree's bitmask, the range); otherwise every row attends everywhere.
    n = n0 + tl.arange(0, BLOCK_N)
    lat = tl.arange(0, LAT)
    rope = tl.arange(0, ROPE)
    if MASKED:
        n_ok = n < end
    if PAGE >= BLOCK_N:  # the step lies in one page (n0 is a multiple of BLOCK_N): one lookup, contiguous rows
        page = tl.load(table_row_ptr + n0 // PAGE)
        kv_row = (page.to(tl.int64) * PAGE + n0 % PAGE + tl.arange(0, BLOCK_N)) * QK
    else:
        if MASKED:
            page = tl.load(table_row_ptr + n // PAGE, mask=n_ok, other=0)
        else:
            page = tl.load(table_row_ptr + n // PAGE)
        kv_row = (page.to(tl.int64) * PAGE + n % PAGE) * QK
    if MASKED:
        k_lat = tl.load(kv_ptr + kv_row[:, None] + lat[None, :], mask=n_ok[:, None], other=0.0)
        k_pe = tl.load(kv_ptr + kv_row[:, None] + LAT + rope[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_lat = tl.load(kv_ptr + kv_row[:, None] + lat[None, :])
        k_pe = tl.load(kv_ptr + kv_row[:, None] + LAT + rope[None, :])
    if WIDEN:
        k_lat = k_lat.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    qk = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q_lat, tl.trans(k_lat))) * scale_log2
    if MASKED:  # the tree part: bit j = n - L of the node's mask row; the prefix attends everywhere
        j = n - L
        in_tree = (j >= 0) & n_ok
        word = tl.load(mask_ptr + node[:, None].to(tl.int64) * mask_words + (j // 64)[None, :],
                       mask=row_ok[:, None] & in_tree[None, :], other=0)
        bit = (word >> (j % 64)[None, :].to(tl.int64)) & 1
        qk = tl.where(n_ok[None, :] & ((j < 0)[None, :] | (bit != 0)), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing attended so far stays 0
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p_lo = p.to(tl.bfloat16)
    if WIDEN:
        p_lo = p_lo.to(tl.float32)
    acc = tl.dot(p_lo, k_lat, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def split_attn(q_ptr, kv_ptr, table_ptr, prefix_ptr, indptr_ptr, mask_ptr, work_ptr, o_ptr, lse_ptr,
               scale_log2, table_stride, mask_words, rows_total, splits,
               H: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DIRECT: tl.constexpr, WIDEN: tl.constexpr, QK: tl.constexpr, LAT: tl.constexpr,
               ROPE: tl.constexpr):
    # program (w, s): work item w = (request b, row tile t) from the host's list, KV run s of the request.
    w = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.load(work_ptr + 2 * w)
    tile = tl.load(work_ptr + 2 * w + 1)
    L = tl.load(prefix_ptr + b)
    q0 = tl.load(indptr_ptr + b)
    T = tl.load(indptr_ptr + b + 1) - q0
    kv_len = L + T
    per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), splits)
    start = s * per_split * BLOCK_N
    end = tl.minimum(kv_len, start + per_split * BLOCK_N)
    # whole steps inside both the prefix and the run take the unmasked path
    fast_end = start + tl.maximum(tl.minimum(end, L) - start, 0) // BLOCK_N * BLOCK_N

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row within the request
    row_ok = r < T * H
    grow = (q0 * H + r).to(tl.int64)  # row within q / out / lse ([N_q, H] flattened)
    node = q0 + r // H
    lat = tl.arange(0, LAT)
    rope = tl.arange(0, ROPE)
    q_lat = tl.load(q_ptr + grow[:, None] * QK + lat[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_ptr + grow[:, None] * QK + LAT + rope[None, :], mask=row_ok[:, None], other=0.0)
    if WIDEN:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LAT], tl.float32)
    table_row_ptr = table_ptr + b.to(tl.int64) * table_stride
    for n0 in range(start, fast_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(q_lat, q_pe, m_i, l_i, acc, kv_ptr, table_row_ptr, mask_ptr, node, row_ok,
                                    n0, end, L, scale_log2, mask_words, PAGE, BLOCK_N, False, WIDEN, QK, LAT,
                                    ROPE)
    for n0 in range(fast_end, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(q_lat, q_pe, m_i, l_i, acc, kv_ptr, table_row_ptr, mask_ptr, node, row_ok,
                                    n0, end, L, scale_log2, mask_words, PAGE, BLOCK_N, True, WIDEN, QK, LAT,
                                    ROPE)

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        tl.store(o_ptr + grow[:, None] * LAT + lat[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
        tl.store(lse_ptr + grow, lse, mask=row_ok)
    else:
        part = s.to(tl.int64) * rows_total + grow
        tl.store(o_ptr + part[:, None] * LAT + lat[None, :], o, mask=row_ok[:, None])
        tl.store(lse_ptr + part, lse, mask=row_ok)


@triton.jit
def combine(part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, rows_total, splits, BLOCK_S: tl.constexpr,
            LAT: tl.constexpr):
    # one program per row: lse = log Σ exp(lse_s), out = Σ exp(lse_s - lse) o_s, in split order
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    lses = tl.load(part_lse_ptr + sp.to(tl.int64) * rows_total + row, mask=sp < splits, other=float("-inf"))
    m = tl.max(lses, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lses - m_ref), 0)
    lse = tl.where(total > 0, m_ref + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    lat = tl.arange(0, LAT)
    acc = tl.zeros([LAT], tl.float32)
    for s in range(0, splits):
        ls = tl.load(part_lse_ptr + s * rows_total + row)
        weight = tl.where(ls == float("-inf"), 0.0, tl.exp(ls - lse))
        acc += weight * tl.load(part_o_ptr + (s * rows_total + row) * LAT + lat)
    tl.store(out_ptr + row * LAT + lat, acc.to(tl.bfloat16))
    tl.store(lse_ptr + row, lse)
