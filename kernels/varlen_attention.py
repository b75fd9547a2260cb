"""Triton kernels of ``varlen_attention`` (DESIGN.md, "Attention over packed trajectories").

Triton only, no torch: ``tests/triton_aot.py`` compiles every configuration for sm_90 ahead of
time (``aot_specs()``), under any triton, in an environment without torch. The launcher is
``agentrl_fast/ops/varlen_attention_triton.py``.

Layout: ``q[T, Hq, D]``, ``k, v[T, Hk, D]`` (the last dimension contiguous; token and head
strides are arguments), ``lse[Hq, T]`` float32 (natural log), ``cu_seqlens[B+1]`` int32.

Scheduling: a grid covers only real tiles. The launcher builds, on the device, a tile table
(``tile_sequence[i]``, ``tile_block[i]``) from ``cu_seqlens`` with the longest work first, and
launches a 1-D grid of ``num_tile_slots * heads`` programs: program ``p`` takes tile
``p // heads`` and head ``p % heads``, so the heads of a tile are adjacent (they share K/V
through L2 under GQA) and the hardware, which starts programs in order, starts the longest tiles
first. Slots past the real tile count hold ``tile_sequence = -1`` and exit at once.

Kernels:

- ``varlen_attention_forward_kernel``: one program per (query tile of ``BLOCK_M`` rows, query
  head); online softmax in base 2 over key blocks of ``BLOCK_N``: the blocks wholly inside the
  sequence and below the diagonal run without masks, the diagonal/tail blocks with them; writes
  ``out`` and ``lse``.
- ``varlen_attention_backward_preprocess_kernel``: ``delta[h, t] = sum_d dout * out``.
- ``varlen_attention_backward_kernel``: one program per (tile of ``BLOCK`` tokens, KV head).
  Phase 1: the tile as keys: ``dk``, ``dv`` summed over the query heads of the group in
  registers, over query steps of ``STEP`` rows. Phase 2: the tile as queries: ``dq`` of each
  query head of the group, over key steps of ``STEP`` rows. No atomics, so the backward is
  deterministic (bitwise run to run) whether or not it is asked to be; the price is recomputing
  ``q k^T`` and ``dout v^T`` in phase 2 (7 matrix products per block pair instead of 5). Under a
  causal mask phase 1 of block j visits ``n - j`` query blocks and phase 2 ``j + 1`` key blocks,
  so every tile of a sequence costs the same: tiles are ordered by sequence length.

``causal`` is a runtime flag (it changes loop bounds and the masks of the diagonal blocks only),
and ``head_dim`` is padded to a power of two ``HEAD_DIM`` (``EVEN_D``: no padding, no masks on
the head dimension), so the configurations are (dtype, padded head dim, even or not).
"""

import os

import triton
import triton.language as tl
from .tuned import tuned

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Triton's interpreter multiplies bfloat16 operands of tl.dot as their uint16 bit patterns
# (triton 3.6-3.8); under it (only) the operands are widened to float32 first, which gives the
# same products (exact in float32) accumulated in float32, as the MMA does. TRITON_INTERPRET is
# read when kernels are defined, as triton itself does.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

DTYPES = ("bf16", "fp16", "fp32")
PADDED_HEAD_DIMS = (32, 64, 128, 256)
PREPROCESS_BLOCK_T = 32
PREPROCESS_BLOCK_D = 32


def padded_head_dim(head_dim: int) -> int:
    """The power of two (at least 32) the kernels compute ``head_dim`` at."""
    padded = 32
    while padded < head_dim:
        padded *= 2
    return padded


def forward_config(dtype: str, head_dim: int) -> dict:
    """Launch configuration of the forward for ``dtype`` ("bf16", "fp16", "fp32") and
    ``head_dim``: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; the tuning sweep's
    for this GPU where it wrote one (``kernels/tuned.py``), else the defaults below."""
    padded = padded_head_dim(head_dim)
    return tuned("varlen_attention_forward", f"{dtype}_d{padded}",
                 default_forward_config(dtype, padded))


def default_forward_config(dtype: str, padded: int) -> dict:
    """The forward's configuration chosen from sm_90 compiles (registers, spills)."""
    if dtype == "fp32":  # fp32 operands take twice the registers and shared memory
        if padded <= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        if padded == 128:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)
    if padded <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if padded == 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)


def backward_config(dtype: str, head_dim: int) -> dict:
    """Launch configuration of the backward (the sweep's where it wrote one, as the forward)."""
    padded = padded_head_dim(head_dim)
    return tuned("varlen_attention_backward", f"{dtype}_d{padded}",
                 default_backward_config(dtype, padded))


def default_backward_config(dtype: str, padded: int) -> dict:
    """The backward's configuration: tile ``BLOCK`` tokens, inner ``STEP`` rows."""
    if dtype == "fp32":  # (ptxas: no spills at D <= 128, 496 bytes at D 256; with 4 warps
        # D 256 spilled 17-171 KB and took ptxas a minute)
        if padded <= 64:
            return dict(BLOCK=64, STEP=32, num_warps=8, num_stages=1)
        return dict(BLOCK=32, STEP=16, num_warps=8, num_stages=1)
    if padded <= 128:  # (ptxas: 48 / 1300 spill bytes at D 64 / 128; 128-token tiles spill more)
        return dict(BLOCK=64, STEP=64, num_warps=8, num_stages=2)
    return dict(BLOCK=64, STEP=32, num_warps=8, num_stages=1)


# ---------------------------------------------------------------------------------------------
# Helpers.

@triton.jit
def _load_rows(base, rows, row_stride, offs_d, head_dim, row_valid,
               EVEN_D: tl.constexpr, ROWS_IN: tl.constexpr):
    """``base[rows, offs_d]`` as a ``[len(rows), HEAD_DIM]`` tile, zeros outside; ``ROWS_IN``:
    every row is inside the sequence (no row mask)."""
    ptrs = base + rows[:, None].to(tl.int64) * row_stride + offs_d[None, :]
    if EVEN_D:
        if ROWS_IN:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=row_valid[:, None], other=0.0)
    else:
        if ROWS_IN:
            x = tl.load(ptrs, mask=(offs_d < head_dim)[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_valid[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    return x


@triton.jit
def _store_rows(base, rows, row_stride, offs_d, head_dim, row_valid, value, EVEN_D: tl.constexpr):
    ptrs = base + rows[:, None].to(tl.int64) * row_stride + offs_d[None, :]
    value = value.to(base.dtype.element_ty)
    if EVEN_D:
        tl.store(ptrs, value, mask=row_valid[:, None])
    else:
        tl.store(ptrs, value, mask=row_valid[:, None] & (offs_d < head_dim)[None, :])


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32; fp32 operands at full precision (no TF32)."""
    if INTERPRET:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _tile(CU, TILE_SEQUENCE, TILE_BLOCK, tile):
    """(sequence, block, start token (int64), length) of a tile; sequence < 0: no tile."""
    sequence = tl.load(TILE_SEQUENCE + tile)
    block = tl.load(TILE_BLOCK + tile)
    safe = tl.maximum(sequence, 0)
    start = tl.load(CU + safe).to(tl.int64)
    end = tl.load(CU + safe + 1).to(tl.int64)
    return sequence, block, start, (end - start).to(tl.int32)


# ---------------------------------------------------------------------------------------------
# Forward.

@triton.jit
def _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n, offs_d, stride_kt,
                   stride_vt, head_dim, length, qk_scale, causal,
                   EVEN_D: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    rows_n = n0 + offs_n
    n_valid = rows_n < length
    k = _load_rows(k_base, rows_n, stride_kt, offs_d, head_dim, n_valid, EVEN_D, not MASKED)
    v = _load_rows(v_base, rows_n, stride_vt, offs_d, head_dim, n_valid, EVEN_D, not MASKED)
    s = _dot(q, tl.trans(k), IEEE) * qk_scale
    if MASKED:
        keep = n_valid[None, :] & ((offs_m[:, None] >= rows_n[None, :]) | (causal == 0))
        s = tl.where(keep, s, float("-inf"))
    # every row sees at least one key of every block visited (see the kernel): m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return acc, l_i, m_new


@triton.jit
def varlen_attention_forward_kernel(
        Q, K, V, O, LSE, CU, TILE_SEQUENCE, TILE_BLOCK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_lse_h, num_heads_q, groups, head_dim, softmax_scale, causal,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """``out[T, Hq, D]``, ``lse[Hq, T]`` of one (query tile, query head)."""
    pid = tl.program_id(0)
    sequence, block, start, length = _tile(CU, TILE_SEQUENCE, TILE_BLOCK, pid // num_heads_q)
    if sequence < 0:
        return
    head = pid % num_heads_q
    kv_head = head // groups
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < length
    q = _load_rows(Q + start * stride_qt + head * stride_qh, offs_m, stride_qt, offs_d, head_dim,
                   m_valid, EVEN_D, False)
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    qk_scale = softmax_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: keys below the tile's first row need no mask (they precede every row and are inside
    # the sequence); non-causal: every whole block inside the sequence. The rest (the diagonal,
    # the partial last block) is masked; each masked block visited holds, for every row (padding
    # rows included), at least one visible key, so the running max stays finite.
    is_causal = causal != 0
    full_end = tl.where(is_causal, block * BLOCK_M, (length // BLOCK_N) * BLOCK_N)
    end = tl.where(is_causal, tl.minimum(length, (block + 1) * BLOCK_M), length)
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n,
                                       offs_d, stride_kt, stride_vt, head_dim, length, qk_scale,
                                       causal, EVEN_D, False, IEEE)
    for n0 in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n,
                                       offs_d, stride_kt, stride_vt, head_dim, length, qk_scale,
                                       causal, EVEN_D, True, IEEE)
    out = acc / l_i[:, None]
    _store_rows(O + start * stride_ot + head * stride_oh, offs_m, stride_ot, offs_d, head_dim,
                m_valid, out, EVEN_D)
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(LSE + head * stride_lse_h + start + offs_m, lse, mask=m_valid)


# ---------------------------------------------------------------------------------------------
# Backward.

@triton.jit
def varlen_attention_backward_preprocess_kernel(
        O, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, stride_delta_h, num_tokens,
        head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``delta[h, t] = sum_d dout[t, h, d] * out[t, h, d]`` (float32) over every token."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    row_valid = rows < num_tokens
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, head_dim, BLOCK_D):
        cols = d0 + offs_d
        mask = row_valid[:, None] & (cols < head_dim)[None, :]
        o = tl.load(O + head * stride_oh + rows[:, None].to(tl.int64) * stride_ot + cols[None, :],
                    mask=mask, other=0.0)
        do = tl.load(DO + head * stride_doh + rows[:, None].to(tl.int64) * stride_dot + cols[None, :],
                     mask=mask, other=0.0)
        acc += tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + head * stride_delta_h + rows, acc, mask=row_valid)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, offs_step, offs_n, offs_d,
               stride_qt, stride_dot, head_dim, length, qk_scale, causal,
               EVEN_D: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Queries ``m0 + offs_step`` against the tile's keys ``offs_n``: accumulate dk, dv."""
    rows_m = m0 + offs_step
    m_valid = rows_m < length
    q = _load_rows(q_base, rows_m, stride_qt, offs_d, head_dim, m_valid, EVEN_D, not MASKED)
    do = _load_rows(do_base, rows_m, stride_dot, offs_d, head_dim, m_valid, EVEN_D, not MASKED)
    if MASKED:
        lse2 = tl.load(lse_base + rows_m, mask=m_valid, other=0.0) * LOG2E
        delta = tl.load(delta_base + rows_m, mask=m_valid, other=0.0)
    else:
        lse2 = tl.load(lse_base + rows_m) * LOG2E
        delta = tl.load(delta_base + rows_m)
    p_t = tl.math.exp2(_dot(k, tl.trans(q), IEEE) * qk_scale - lse2[None, :])   # [BLOCK, STEP]
    if MASKED:
        keep = m_valid[None, :] & ((rows_m[None, :] >= offs_n[:, None]) | (causal == 0))
        p_t = tl.where(keep, p_t, 0.0)
    dv += _dot(p_t.to(do.dtype), do, IEEE)
    dp_t = _dot(v, tl.trans(do), IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_step, offs_d, stride_kt,
             stride_vt, head_dim, length, qk_scale, causal,
             EVEN_D: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """The tile's queries ``offs_m`` against keys ``n0 + offs_step``: accumulate dq."""
    rows_n = n0 + offs_step
    n_valid = rows_n < length
    k = _load_rows(k_base, rows_n, stride_kt, offs_d, head_dim, n_valid, EVEN_D, not MASKED)
    v = _load_rows(v_base, rows_n, stride_vt, offs_d, head_dim, n_valid, EVEN_D, not MASKED)
    p = tl.math.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale - lse2[:, None])      # [BLOCK, STEP]
    if MASKED:
        keep = n_valid[None, :] & ((offs_m[:, None] >= rows_n[None, :]) | (causal == 0))
        p = tl.where(keep, p, 0.0)
    dp = _dot(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, IEEE)
    return dq


@triton.jit
def varlen_attention_backward_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, DK, DV, CU, TILE_SEQUENCE, TILE_BLOCK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
        num_heads_k, groups, head_dim, softmax_scale, causal,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr,
        IEEE: tl.constexpr):
    """dk, dv of one (key tile, KV head) summed over the group's query heads; dq of the same
    tile as queries, for each query head of the group. ``lse``, ``delta``: ``[Hq, T]`` float32
    with head stride ``stride_lse_h``."""
    pid = tl.program_id(0)
    sequence, block, start, length = _tile(CU, TILE_SEQUENCE, TILE_BLOCK, pid // num_heads_k)
    if sequence < 0:
        return
    kv_head = pid % num_heads_k
    qk_scale = softmax_scale * LOG2E
    offs_t = block * BLOCK + tl.arange(0, BLOCK)
    offs_step = tl.arange(0, STEP)
    offs_d = tl.arange(0, HEAD_DIM)
    t_valid = offs_t < length
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    full_rows = (length // STEP) * STEP

    # Phase 1: the tile as keys. Query steps [lo, mid) cross the diagonal (masked), [mid,
    # full_rows) are whole and below it (no mask), the rest is the partial last step (masked).
    k = _load_rows(k_base, offs_t, stride_kt, offs_d, head_dim, t_valid, EVEN_D, False)
    v = _load_rows(v_base, offs_t, stride_vt, offs_d, head_dim, t_valid, EVEN_D, False)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    is_causal = causal != 0
    lo = tl.where(is_causal, block * BLOCK, 0)
    mid = tl.where(is_causal, tl.minimum(block * BLOCK + BLOCK, length), 0)
    tail = tl.maximum(mid, full_rows)
    for g in range(0, groups):
        head = kv_head * groups + g
        q_base = Q + start * stride_qt + head * stride_qh
        do_base = DO + start * stride_dot + head * stride_doh
        lse_base = LSE + head * stride_lse_h + start
        delta_base = DELTA + head * stride_lse_h + start
        for m0 in range(lo, mid, STEP):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, offs_step,
                                offs_t, offs_d, stride_qt, stride_dot, head_dim, length, qk_scale,
                                causal, EVEN_D, True, IEEE)
        for m0 in range(mid, full_rows, STEP):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, offs_step,
                                offs_t, offs_d, stride_qt, stride_dot, head_dim, length, qk_scale,
                                causal, EVEN_D, False, IEEE)
        for m0 in range(tail, length, STEP):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, offs_step,
                                offs_t, offs_d, stride_qt, stride_dot, head_dim, length, qk_scale,
                                causal, EVEN_D, True, IEEE)
    _store_rows(DK + start * stride_dkt + kv_head * stride_dkh, offs_t, stride_dkt, offs_d,
                head_dim, t_valid, dk * softmax_scale, EVEN_D)
    _store_rows(DV + start * stride_dvt + kv_head * stride_dvh, offs_t, stride_dvt, offs_d,
                head_dim, t_valid, dv, EVEN_D)

    # Phase 2: the tile as queries. Key steps [0, full_end) need no mask, [full_end, end) do.
    full_end = tl.where(is_causal, block * BLOCK, full_rows)
    end = tl.where(is_causal, tl.minimum(length, (block + 1) * BLOCK), length)
    for g in range(0, groups):
        head = kv_head * groups + g
        q = _load_rows(Q + start * stride_qt + head * stride_qh, offs_t, stride_qt, offs_d,
                       head_dim, t_valid, EVEN_D, False)
        do = _load_rows(DO + start * stride_dot + head * stride_doh, offs_t, stride_dot, offs_d,
                        head_dim, t_valid, EVEN_D, False)
        lse2 = tl.load(LSE + head * stride_lse_h + start + offs_t, mask=t_valid, other=0.0) * LOG2E
        delta = tl.load(DELTA + head * stride_lse_h + start + offs_t, mask=t_valid, other=0.0)
        dq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        for n0 in range(0, full_end, STEP):
            dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_t, offs_step, offs_d,
                          stride_kt, stride_vt, head_dim, length, qk_scale, causal, EVEN_D, False,
                          IEEE)
        for n0 in range(full_end, end, STEP):
            dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_t, offs_step, offs_d,
                          stride_kt, stride_vt, head_dim, length, qk_scale, causal, EVEN_D, True,
                          IEEE)
        _store_rows(DQ + start * stride_dqt + head * stride_dqh, offs_t, stride_dqt, offs_d,
                    head_dim, t_valid, dq * softmax_scale, EVEN_D)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time configurations.

def _forward_signature(dtype: str) -> dict:
    pointer = f"*{dtype}"
    signature = {"Q": pointer, "K": pointer, "V": pointer, "O": pointer, "LSE": "*fp32",
                 "CU": "*i32", "TILE_SEQUENCE": "*i32", "TILE_BLOCK": "*i32"}
    for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                 "stride_ot", "stride_oh", "stride_lse_h", "num_heads_q", "groups", "head_dim"):
        signature[name] = "i32"
    signature["softmax_scale"] = "fp32"
    signature["causal"] = "i32"
    for name in ("HEAD_DIM", "EVEN_D", "BLOCK_M", "BLOCK_N", "IEEE"):
        signature[name] = "constexpr"
    return signature


def _backward_signature(dtype: str) -> dict:
    pointer = f"*{dtype}"
    signature = {"Q": pointer, "K": pointer, "V": pointer, "DO": pointer, "LSE": "*fp32",
                 "DELTA": "*fp32", "DQ": pointer, "DK": pointer, "DV": pointer, "CU": "*i32",
                 "TILE_SEQUENCE": "*i32", "TILE_BLOCK": "*i32"}
    for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                 "stride_dot", "stride_doh", "stride_dqt", "stride_dqh", "stride_dkt",
                 "stride_dkh", "stride_dvt", "stride_dvh", "stride_lse_h", "num_heads_k",
                 "groups", "head_dim"):
        signature[name] = "i32"
    signature["softmax_scale"] = "fp32"
    signature["causal"] = "i32"
    for name in ("HEAD_DIM", "EVEN_D", "BLOCK", "STEP", "IEEE"):
        signature[name] = "constexpr"
    return signature


def _launch_hints(signature: dict) -> dict:
    """The specialisation of a typical launch, which the compiles of ``tests/triton_aot.py``
    get: the token and head strides of q/k/v/out (and their gradients) and ``head_dim`` are
    multiples of 16 (head dims in use: 64, 80, 96, 128, 192, 256); ``causal`` is 1, which the
    launcher turns into a constant. The lse/delta head stride (the token count), the head
    counts (28 query heads in Qwen2.5-7B) and ``groups`` (GQA: 4, 7, ...) vary; a launch where
    one is a multiple of 16 (or ``groups`` is 1) compiles a variant not compiled here."""
    divisible = [name for name in signature
                 if name.startswith("stride_") and name != "stride_lse_h"] + ["head_dim"]
    return {"divisible_by_16": divisible, "equal_to_1": ["causal"]}


def aot_specs():
    """Every configuration the launcher can pick: forward and backward per dtype, padded head
    dim and even/odd head dim, plus the backward's preprocess kernel per dtype."""
    for dtype in DTYPES:
        for padded in PADDED_HEAD_DIMS:
            for even in (True, False):
                tag = f"{dtype}_d{padded}{'' if even else '_odd'}"
                config = forward_config(dtype, padded)
                yield {"name": f"varlen_attention_forward_{tag}",
                       "fn": varlen_attention_forward_kernel,
                       "signature": _forward_signature(dtype),
                       "constexprs": {"HEAD_DIM": padded, "EVEN_D": even,
                                      "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"],
                                      "IEEE": dtype == "fp32"},
                       "num_warps": config["num_warps"], "num_stages": config["num_stages"],
                       "hints": _launch_hints(_forward_signature(dtype)),
                       "tuning": ("varlen_attention_forward", f"{dtype}_d{padded}"),
                       # only the bf16/fp16 forward at D 64/128 must not spill (the issue)
                       "allow_spills": not (dtype != "fp32" and padded in (64, 128) and even)}
                config = backward_config(dtype, padded)
                yield {"name": f"varlen_attention_backward_{tag}",
                       "fn": varlen_attention_backward_kernel,
                       "signature": _backward_signature(dtype),
                       "constexprs": {"HEAD_DIM": padded, "EVEN_D": even, "BLOCK": config["BLOCK"],
                                      "STEP": config["STEP"], "IEEE": dtype == "fp32"},
                       "num_warps": config["num_warps"], "num_stages": config["num_stages"],
                       "hints": _launch_hints(_backward_signature(dtype)),
                       "tuning": ("varlen_attention_backward", f"{dtype}_d{padded}"),
                       "allow_spills": True}  # spills are recorded in bench/results/
        pointer = f"*{dtype}"
        yield {"name": f"varlen_attention_backward_preprocess_{dtype}",
               "fn": varlen_attention_backward_preprocess_kernel,
               "signature": {"O": pointer, "DO": pointer, "DELTA": "*fp32", "stride_ot": "i32",
                             "stride_oh": "i32", "stride_dot": "i32", "stride_doh": "i32",
                             "stride_delta_h": "i32", "num_tokens": "i32", "head_dim": "i32",
                             "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"},
               "constexprs": {"BLOCK_T": PREPROCESS_BLOCK_T, "BLOCK_D": PREPROCESS_BLOCK_D},
               # as _launch_hints: the token count and the delta head stride (= it) vary
               "hints": {"divisible_by_16": ["stride_ot", "stride_oh", "stride_dot", "stride_doh",
                                             "head_dim"]},
               "num_warps": 4, "num_stages": 1}
