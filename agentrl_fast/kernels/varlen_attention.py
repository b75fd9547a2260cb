"""Triton kernels of ``varlen_attention`` (docs/design.md, "Attention over packed trajectories").

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
- ``varlen_attention_backward_dkdv_kernel``: FlashAttention-2's backward, one program per (key
  tile of ``BLOCK`` tokens, KV head): ``dk``, ``dv`` summed in registers over the query heads of
  the group and over query blocks of ``STEP`` rows (from the diagonal on under a causal mask);
  per block pair ``S^T = K Q^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dK += dS^T Q`` and, with
  ``ATOMIC_DQ`` (the default), ``dQ^T += K^T dS^T`` added to a float32 buffer by atomics (relaxed
  reductions): 5 matrix products. The order of those float32 additions varies run to run.
- ``varlen_attention_backward_dq_kernel``: the deterministic backward's second pass (the dk/dv
  kernel then runs without ``ATOMIC_DQ``): one program per (query tile of ``BLOCK_M``, query
  head) over key blocks of ``BLOCK_N``: ``S``, ``dP`` again and ``dQ += dS K`` (3 products; 7
  per block pair in all), bitwise reproducible.

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
# PROBE ONLY (bench/attention_backward_probe.py): the atomic dq as dS K ([STEP, HEAD_DIM], rows
# of dq) instead of (K^T dS^T) ([HEAD_DIM, STEP]).
DQ_ROWS = tl.constexpr(os.environ.get("AGENTRL_FAST_PROBE_DQ_ROWS") == "1")

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
    for this GPU where it wrote one (``agentrl_fast/kernels/tuned.py``), else the defaults below."""
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
    if padded <= 64:  # (triton 3.6: 199 registers, S by m64n128k16; was 128 x 64, 4 warps,
        # 3 stages: 226, m64n64k16)
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    if padded == 128:  # (128 x 128 needs 255 registers and 224 KB of shared memory at 3 stages,
        # spills at 2)
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)


def backward_config(dtype: str, head_dim: int) -> dict:
    """Launch configuration of the backward's dk/dv kernel (the sweep's where it wrote one, as
    the forward): key tiles of ``BLOCK`` tokens, query blocks of ``STEP`` rows."""
    padded = padded_head_dim(head_dim)
    return tuned("varlen_attention_backward", f"{dtype}_d{padded}",
                 default_backward_config(dtype, padded))


def default_backward_config(dtype: str, padded: int) -> dict:
    """Hinted sm_90 compiles (bench/results/triton_compile.md). In bf16/fp16 ``STEP`` is 64:
    the atomic dq's ``K^T dS^T`` takes ``dS^T`` ([BLOCK, STEP], a wgmma result) from shared
    memory, and with STEP 16 or 32 triton stores it there with a 32- or 64-byte swizzle, the
    store that every wrong or crashing launch on the H200 had (triton 3.6; ``tests/triton_aot.py``
    fails a configuration with one, ``narrow_mma_stores``). D 64: 64 x 64 with one warpgroup
    (all wgmma m64n64k16), 1 stage, right on the H200. D 128: 64 x 64 with 8 warps, 2 stages
    (cp.async loads of q and dO; 1 stage spills 16 bytes, 128 keys 140). D 256: the same
    (spills 132-300 bytes, as its STEP-32 predecessor did 116-296)."""
    if dtype == "fp32":  # IEEE fp32 products take no wgmma; spills allowed (not a hot path)
        if padded <= 64:
            return dict(BLOCK=64, STEP=32, num_warps=8, num_stages=1)
        return dict(BLOCK=32, STEP=16, num_warps=8, num_stages=1)
    if padded <= 64:
        return dict(BLOCK=64, STEP=64, num_warps=4, num_stages=1)
    return dict(BLOCK=64, STEP=64, num_warps=8, num_stages=2)


def backward_dq_config(dtype: str, head_dim: int) -> dict:
    """Launch configuration of the deterministic backward's dq kernel: query tiles of
    ``BLOCK_M``, key blocks of ``BLOCK_N``."""
    padded = padded_head_dim(head_dim)
    return tuned("varlen_attention_backward_dq", f"{dtype}_d{padded}",
                 default_backward_dq_config(dtype, padded))


def default_backward_dq_config(dtype: str, padded: int) -> dict:
    """128 queries x 64 keys with 8 warps: no spills in bf16/fp16 at D 64/128 under triton 3.6
    with 2 stages (158 / 205 registers), every wgmma m64n64k16 or m64n128k16."""
    if dtype == "fp32":
        if padded <= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=1)
    if padded <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)


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
    # Causal: whole key blocks below the tile's first row need no mask (they precede every row
    # and are inside the sequence); non-causal: every whole block inside the sequence. The rest
    # (the diagonal, the partial last block) is masked. The first block visited holds a visible
    # key for every row (padding rows included), so the running max is finite from then on and
    # a later block masked out for a row adds exp2(-inf) = 0. Key blocks start on multiples of
    # BLOCK_N whatever BLOCK_M is, so any tuned pair of block sizes computes the same function.
    is_causal = causal != 0
    full_end = tl.where(is_causal, (block * BLOCK_M // BLOCK_N) * BLOCK_N,
                        (length // BLOCK_N) * BLOCK_N)
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
               stride_qt, stride_dot, head_dim, length, qk_scale, causal, dq_base, stride_dqt,
               EVEN_D: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Queries ``m0 + offs_step`` against the tile's keys ``offs_n`` (masked): accumulate dk,
    dv; with ``ATOMIC_DQ`` also add these keys' share of dq (unscaled, float32) at
    ``dq_base``: 5 matrix products, 4 without."""
    rows_m = m0 + offs_step
    m_valid = rows_m < length
    q = _load_rows(q_base, rows_m, stride_qt, offs_d, head_dim, m_valid, EVEN_D, False)
    do = _load_rows(do_base, rows_m, stride_dot, offs_d, head_dim, m_valid, EVEN_D, False)
    lse2 = tl.load(lse_base + rows_m, mask=m_valid, other=0.0) * LOG2E
    delta = tl.load(delta_base + rows_m, mask=m_valid, other=0.0)
    p_t = tl.math.exp2(_dot(k, tl.trans(q), IEEE) * qk_scale - lse2[None, :])   # [BLOCK, STEP]
    keep = m_valid[None, :] & ((rows_m[None, :] >= offs_n[:, None]) | (causal == 0))
    p_t = tl.where(keep, p_t, 0.0)
    dv += _dot(p_t.to(do.dtype), do, IEEE)
    dp_t = _dot(v, tl.trans(do), IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, IEEE)
    if ATOMIC_DQ and DQ_ROWS:
        dq_r = _dot(tl.trans(ds_t).to(k.dtype), k, IEEE)                        # [STEP, HEAD_DIM]
        ptrs = dq_base + rows_m[:, None].to(tl.int64) * stride_dqt + offs_d[None, :]
        if EVEN_D:
            tl.atomic_add(ptrs, dq_r, mask=m_valid[:, None], sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq_r, mask=m_valid[:, None] & (offs_d < head_dim)[None, :],
                          sem="relaxed")
    elif ATOMIC_DQ:  # relaxed: a reduction needs no ordering (RED, no fences)
        # dq^T = k^T ds^T: M = HEAD_DIM, so the product stays on wgmma when STEP < 64 (dS K with
        # M = STEP = 32 took mma.sync at D 128); the atomics are still 4-wide along D.
        dq_t = _dot(tl.trans(k), ds_t.to(k.dtype), IEEE)                        # [HEAD_DIM, STEP]
        ptrs = dq_base + rows_m[None, :].to(tl.int64) * stride_dqt + offs_d[:, None]
        if EVEN_D:
            tl.atomic_add(ptrs, dq_t, mask=m_valid[None, :], sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq_t, mask=m_valid[None, :] & (offs_d < head_dim)[:, None],
                          sem="relaxed")
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
def varlen_attention_backward_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, DK, DV, CU, TILE_SEQUENCE, TILE_BLOCK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
        num_heads_k, groups, head_dim, softmax_scale, causal,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, STEP: tl.constexpr,
        BLOCK: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """dk, dv of one (key tile of ``BLOCK`` tokens, KV head), summed over the group's query
    heads in registers, over query blocks of ``STEP`` rows. With ``ATOMIC_DQ`` each block pair
    also adds ``ds^T k`` to the float32 ``DQ`` (unscaled): FlashAttention-2's 5 products;
    without, ``varlen_attention_backward_dq_kernel`` computes dq."""
    pid = tl.program_id(0)
    sequence, block, start, length = _tile(CU, TILE_SEQUENCE, TILE_BLOCK, pid // num_heads_k)
    if sequence < 0:
        return
    kv_head = pid % num_heads_k
    qk_scale = softmax_scale * LOG2E
    offs_n = block * BLOCK + tl.arange(0, BLOCK)
    offs_m = tl.arange(0, STEP)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < length
    k = _load_rows(K + start * stride_kt + kv_head * stride_kh, offs_n, stride_kt, offs_d,
                   head_dim, n_valid, EVEN_D, False)
    v = _load_rows(V + start * stride_vt + kv_head * stride_vh, offs_n, stride_vt, offs_d,
                   head_dim, n_valid, EVEN_D, False)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # One loop over the query blocks that see the tile (from its diagonal on, under a causal
    # mask), every block masked: three loops (diagonal / interior / tail, as the forward) cost
    # 60-250 bytes of spills under triton 3.6 (their hoisted invariants stay live). Padding key
    # rows are zeros: their dk/dv are not stored and their share of dq (ds^T k) is 0.
    # The group and query-block loops are flattened into one (triton's FuseNestedLoops), so a
    # pipelined launch (num_stages > 1: q, dO by cp.async) prefetches across query heads with
    # no prologue per head, and keeps fewer values live: under triton 3.6 the defaults with
    # 2 stages spill nothing (they spilled 12 B at D 64, 56 B at D 128 without it). Not in
    # fp32 (1 stage; flattened, D 64 spills 684 B under 3.6, 0 without).
    lo = tl.where(causal != 0, block * BLOCK, 0)
    for g in tl.range(0, groups, flatten=not IEEE):
        head = kv_head * groups + g
        q_base = Q + start * stride_qt + head * stride_qh
        do_base = DO + start * stride_dot + head * stride_doh
        dq_base = DQ + start * stride_dqt + head * stride_dqh
        lse_base = LSE + head * stride_lse_h + start
        delta_base = DELTA + head * stride_lse_h + start
        for m0 in range(lo, length, STEP):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, offs_m,
                                offs_n, offs_d, stride_qt, stride_dot, head_dim, length, qk_scale,
                                causal, dq_base, stride_dqt, EVEN_D, IEEE, ATOMIC_DQ)
    _store_rows(DK + start * stride_dkt + kv_head * stride_dkh, offs_n, stride_dkt, offs_d,
                head_dim, n_valid, dk * softmax_scale, EVEN_D)
    _store_rows(DV + start * stride_dvt + kv_head * stride_dvh, offs_n, stride_dvt, offs_d,
                head_dim, n_valid, dv, EVEN_D)


@triton.jit
def varlen_attention_backward_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU, TILE_SEQUENCE, TILE_BLOCK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dqt, stride_dqh, stride_lse_h, num_heads_q, groups, head_dim, softmax_scale,
        causal, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """dq of one (query tile of ``BLOCK_M``, query head) over key blocks of ``BLOCK_N``: the
    deterministic second pass (3 products per block pair)."""
    pid = tl.program_id(0)
    sequence, block, start, length = _tile(CU, TILE_SEQUENCE, TILE_BLOCK, pid // num_heads_q)
    if sequence < 0:
        return
    head = pid % num_heads_q
    kv_head = head // groups
    qk_scale = softmax_scale * LOG2E
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < length
    q = _load_rows(Q + start * stride_qt + head * stride_qh, offs_m, stride_qt, offs_d, head_dim,
                   m_valid, EVEN_D, False)
    do = _load_rows(DO + start * stride_dot + head * stride_doh, offs_m, stride_dot, offs_d,
                    head_dim, m_valid, EVEN_D, False)
    lse2 = tl.load(LSE + head * stride_lse_h + start + offs_m, mask=m_valid, other=0.0) * LOG2E
    delta = tl.load(DELTA + head * stride_lse_h + start + offs_m, mask=m_valid, other=0.0)
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Key blocks [0, full_end) need no mask, [full_end, end) do (the diagonal, the partial tail).
    is_causal = causal != 0
    full_end = tl.where(is_causal, (block * BLOCK_M // BLOCK_N) * BLOCK_N,
                        (length // BLOCK_N) * BLOCK_N)
    end = tl.where(is_causal, tl.minimum(length, (block + 1) * BLOCK_M), length)
    for n0 in range(0, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_n, offs_d,
                      stride_kt, stride_vt, head_dim, length, qk_scale, causal, EVEN_D, False, IEEE)
    for n0 in range(full_end, end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_n, offs_d,
                      stride_kt, stride_vt, head_dim, length, qk_scale, causal, EVEN_D, True, IEEE)
    _store_rows(DQ + start * stride_dqt + head * stride_dqh, offs_m, stride_dqt, offs_d, head_dim,
                m_valid, dq * softmax_scale, EVEN_D)


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


def _backward_dkdv_signature(dtype: str) -> dict:
    pointer = f"*{dtype}"
    signature = {"Q": pointer, "K": pointer, "V": pointer, "DO": pointer, "LSE": "*fp32",
                 "DELTA": "*fp32", "DQ": "*fp32", "DK": pointer, "DV": pointer, "CU": "*i32",
                 "TILE_SEQUENCE": "*i32", "TILE_BLOCK": "*i32"}  # DQ: the atomic accumulator
    for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                 "stride_dot", "stride_doh", "stride_dqt", "stride_dqh", "stride_dkt",
                 "stride_dkh", "stride_dvt", "stride_dvh", "stride_lse_h", "num_heads_k",
                 "groups", "head_dim"):
        signature[name] = "i32"
    signature["softmax_scale"] = "fp32"
    signature["causal"] = "i32"
    for name in ("HEAD_DIM", "EVEN_D", "BLOCK", "STEP", "IEEE", "ATOMIC_DQ"):
        signature[name] = "constexpr"
    return signature


def _backward_dq_signature(dtype: str) -> dict:
    pointer = f"*{dtype}"
    signature = {"Q": pointer, "K": pointer, "V": pointer, "DO": pointer, "LSE": "*fp32",
                 "DELTA": "*fp32", "DQ": pointer, "CU": "*i32", "TILE_SEQUENCE": "*i32",
                 "TILE_BLOCK": "*i32"}
    for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                 "stride_dot", "stride_doh", "stride_dqt", "stride_dqh", "stride_lse_h",
                 "num_heads_q", "groups", "head_dim"):
        signature[name] = "i32"
    signature["softmax_scale"] = "fp32"
    signature["causal"] = "i32"
    for name in ("HEAD_DIM", "EVEN_D", "BLOCK_M", "BLOCK_N", "IEEE"):
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


def _backward_specs(dtype: str, padded: int, even: bool, tag: str):
    """The dk/dv kernel with the atomic dq (the default) and without (deterministic), and the
    deterministic backward's dq kernel."""
    hot = dtype != "fp32" and padded in (64, 128) and even  # must not spill (the issue)
    config = backward_config(dtype, padded)
    for atomic in (True, False):
        yield {"name": f"varlen_attention_backward{'' if atomic else '_dkdv'}_{tag}",
               "fn": varlen_attention_backward_dkdv_kernel,
               "signature": _backward_dkdv_signature(dtype),
               "constexprs": {"HEAD_DIM": padded, "EVEN_D": even, "BLOCK": config["BLOCK"],
                              "STEP": config["STEP"], "IEEE": dtype == "fp32",
                              "ATOMIC_DQ": atomic},
               "num_warps": config["num_warps"], "num_stages": config["num_stages"],
               "hints": _launch_hints(_backward_dkdv_signature(dtype)),
               "tuning": ("varlen_attention_backward", f"{dtype}_d{padded}"),
               "allow_spills": not hot}
    config = backward_dq_config(dtype, padded)
    yield {"name": f"varlen_attention_backward_dq_{tag}",
           "fn": varlen_attention_backward_dq_kernel,
           "signature": _backward_dq_signature(dtype),
           "constexprs": {"HEAD_DIM": padded, "EVEN_D": even, "BLOCK_M": config["BLOCK_M"],
                          "BLOCK_N": config["BLOCK_N"], "IEEE": dtype == "fp32"},
           "num_warps": config["num_warps"], "num_stages": config["num_stages"],
           "hints": _launch_hints(_backward_dq_signature(dtype)),
           "tuning": ("varlen_attention_backward_dq", f"{dtype}_d{padded}"),
           "allow_spills": not hot}


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
                yield from _backward_specs(dtype, padded, even, tag)
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
