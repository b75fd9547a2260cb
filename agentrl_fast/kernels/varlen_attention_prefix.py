"""Triton kernels of ``varlen_attention``'s prefix-shared mode (``prefix_of``; issue 47).

A segment ``s`` of the packed batch may be the suffix of a prefix segment ``PREFIX[s]``: its
queries attend to every key of the prefix, then causally to their own keys, as if the prefix's
tokens were laid right before them (always causal). The launcher is
``agentrl_fast/ops/varlen_attention_triton.py``; the plain kernels, whose helpers, tiling and
launch configurations these reuse, are ``varlen_attention.py`` beside this module.

Tables (built on the device by the launcher, indexed like its tile table: sequence ``i`` spans
``CU[i]:CU[i+1]``, the first and last being the gaps around ``cu_seqlens``):

- ``PREFIX[i]`` int32: the prefix sequence of sequence ``i``, or -1 (sanitized: a bad
  ``prefix_of`` entry reads as -1, so every index here is in range).
- ``QUERY_PTR[i]:QUERY_PTR[i+1]`` (CSR, int32) index ``QUERY_ROW``/``QUERY_COUNT``: the query
  blocks of ``STEP`` rows of every suffix of prefix ``i`` (first token, rows in the block),
  suffixes in segment order: the order a prefix key tile adds their shares to dk/dv (fixed: no
  atomics, bitwise reproducible).
- ``PART_ROW[i]`` int32: where prefix sequence ``i``'s rows start in the split sums' buffers
  (the prefixes' rows packed one after another).

Kernels (grids as the plain ones: one program per (tile, head), longest work first; the
dk/dv kernel's split programs first):

- ``varlen_attention_prefix_forward_kernel``: one online softmax over the prefix's key blocks
  (unmasked but the partial last) and then the own keys (as the plain causal forward).
- ``varlen_attention_prefix_backward_dkdv_kernel``: one program per (key tile, KV head,
  split): the own queries from the diagonal (as the plain kernel), then every query block of
  the sequence's suffixes (``QUERY_PTR``), unmasked but for padding rows; ``ATOMIC_DQ`` as the
  plain kernel (the suffix queries' dq gets the prefix keys' share there too). A prefix's tile
  sees all its suffixes' queries, far more than a plain tile's, so its list is split over
  ``splits`` programs whose float32 sums (``PART_DK``/``PART_DV``, rows at ``PART_ROW``) the
  launcher adds in a fixed order: no atomics, bitwise reproducible for a given split count.
- ``varlen_attention_prefix_backward_dq_kernel``: the deterministic backward's dq: prefix keys
  then own keys.

Configurations are the plain kernels' (``forward_config``, ``backward_config``,
``backward_dq_config``, tuned ones included): the same tiles with one more loop.
"""

import triton
import triton.language as tl

from .varlen_attention import (DTYPES, LN2, LOG2E, PADDED_HEAD_DIMS, _dkdv_step, _dq_step,
                               _forward_block, _launch_hints, _load_rows, _store_rows, _tile,
                               backward_config, backward_dq_config, forward_config)


@triton.jit
def _prefix_span(CU, PREFIX, sequence):
    """(start token (int64), length) of ``sequence``'s prefix; length 0 when it has none."""
    prefix = tl.load(PREFIX + sequence)
    safe = tl.maximum(prefix, 0)
    start = tl.load(CU + safe).to(tl.int64)
    end = tl.load(CU + safe + 1).to(tl.int64)
    return start, tl.where(prefix >= 0, (end - start).to(tl.int32), 0)


# ---------------------------------------------------------------------------------------------
# Forward.

@triton.jit
def varlen_attention_prefix_forward_kernel(
        Q, K, V, O, LSE, CU, PREFIX, TILE_SEQUENCE, TILE_BLOCK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_lse_h, num_heads_q, groups, head_dim, softmax_scale,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """``out[T, Hq, D]``, ``lse[Hq, T]`` of one (query tile, query head): prefix keys, then
    own keys causally."""
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
    qk_scale = softmax_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # The prefix: every key visible to every row (padding rows too), so the first block visited
    # makes the running max finite, as the plain kernel's first block does.
    p_start, p_length = _prefix_span(CU, PREFIX, sequence)
    k_base = K + p_start * stride_kt + kv_head * stride_kh
    v_base = V + p_start * stride_vt + kv_head * stride_vh
    p_full = (p_length // BLOCK_N) * BLOCK_N
    for n0 in range(0, p_full, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n,
                                       offs_d, stride_kt, stride_vt, head_dim, p_length, qk_scale,
                                       0, EVEN_D, False, IEEE)
    for n0 in range(p_full, p_length, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n,
                                       offs_d, stride_kt, stride_vt, head_dim, p_length, qk_scale,
                                       0, EVEN_D, True, IEEE)
    # Own keys, causal: as varlen_attention_forward_kernel.
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    full_end = (block * BLOCK_M // BLOCK_N) * BLOCK_N
    end = tl.minimum(length, (block + 1) * BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n,
                                       offs_d, stride_kt, stride_vt, head_dim, length, qk_scale,
                                       1, EVEN_D, False, IEEE)
    for n0 in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_n,
                                       offs_d, stride_kt, stride_vt, head_dim, length, qk_scale,
                                       1, EVEN_D, True, IEEE)
    out = acc / l_i[:, None]
    _store_rows(O + start * stride_ot + head * stride_oh, offs_m, stride_ot, offs_d, head_dim,
                m_valid, out, EVEN_D)
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(LSE + head * stride_lse_h + start + offs_m, lse, mask=m_valid)


# ---------------------------------------------------------------------------------------------
# Backward (the preprocess, delta = rowsum(dout * out), is the plain kernel's).

@triton.jit
def varlen_attention_prefix_backward_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, DK, DV, PART_DK, PART_DV, CU, TILE_SEQUENCE, TILE_BLOCK,
        QUERY_PTR, QUERY_ROW, QUERY_COUNT, PART_ROW, SPLIT_TILE,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
        stride_ps, stride_pt, stride_ph, num_heads_k, groups, splits, extra, head_dim,
        softmax_scale,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, STEP: tl.constexpr,
        BLOCK: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """dk, dv of one (key tile of ``BLOCK`` tokens, KV head, split): the own queries (causal,
    from the diagonal on) and every query of the sequence's suffixes (``QUERY_PTR``'s blocks),
    summed over the group's query heads in registers; ``ATOMIC_DQ`` as the plain kernel.

    With ``splits`` > 1 a prefix's tile (one with suffix blocks) splits its (head, block) list
    into ``splits`` contiguous chunks, one program each, which store their unscaled float32
    sums at ``PART_*[split, PART_ROW[sequence] + row]`` for the launcher to add; every other
    tile runs whole and stores dk (scaled) and dv. Programs: first the ``extra`` ones, every
    split of the prefixes' tiles (``SPLIT_TILE``: their slots in the tile table, longest
    first), a tile's splits side by side so that its chunks start together; then every tile
    of the table in its order, the prefixes' tiles returning at once when split."""
    pid = tl.program_id(0)
    if pid < extra:
        split = pid % splits
        work = pid // splits
        kv_head = work % num_heads_k
        tile = tl.load(SPLIT_TILE + work // num_heads_k)
    else:
        split = pid * 0  # (a tensor in both branches)
        kv_head = (pid - extra) % num_heads_k
        tile = (pid - extra) // num_heads_k
    sequence, block, start, length = _tile(CU, TILE_SEQUENCE, TILE_BLOCK, tile)
    if sequence < 0:
        return
    # One loop over the query blocks that see the tile, as the plain kernel's (flattened with
    # the group loop, every block masked; two loops, own then suffixes, spilled 1.4 KB at
    # bf16 D 128): first the own queries from the diagonal on (causal, rows counted from the
    # sequence's start), then the suffixes' blocks in the table's order (each at row 0 of its
    # `count` valid rows, no causal mask: they see every key of the prefix).
    own = tl.cdiv(length - block * BLOCK, STEP)
    first = tl.load(QUERY_PTR + sequence)
    total = own + tl.load(QUERY_PTR + sequence + 1) - first
    shared = (total > own) & (splits > 1)
    if shared & (pid >= extra):  # (its splits ran among the first programs)
        return
    entries = groups * total
    j0 = tl.where(shared, split * entries // splits, 0)
    j1 = tl.where(shared, (split + 1) * entries // splits, entries)
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
    for j in range(j0, j1):
        g = j // total
        i = j - g * total
        head = kv_head * groups + g
        is_own = i < own
        entry = first + i - own  # (read only for a suffix block)
        row = tl.where(is_own, start,
                       tl.load(QUERY_ROW + entry, mask=i >= own, other=0).to(tl.int64))
        rows = tl.where(is_own, length, tl.load(QUERY_COUNT + entry, mask=i >= own, other=0))
        m0 = tl.where(is_own, block * BLOCK + i * STEP, 0)
        dk, dv = _dkdv_step(dk, dv, k, v, Q + row * stride_qt + head * stride_qh,
                            DO + row * stride_dot + head * stride_doh,
                            LSE + head * stride_lse_h + row, DELTA + head * stride_lse_h + row,
                            m0, offs_m, offs_n, offs_d, stride_qt, stride_dot, head_dim, rows,
                            qk_scale, is_own.to(tl.int32),
                            DQ + row * stride_dqt + head * stride_dqh, stride_dqt, EVEN_D,
                            IEEE, ATOMIC_DQ)
    if shared:
        part = (tl.load(PART_ROW + sequence).to(tl.int64) * stride_pt
                + split.to(tl.int64) * stride_ps + kv_head * stride_ph)
        _store_rows(PART_DK + part, offs_n, stride_pt, offs_d, head_dim, n_valid, dk, EVEN_D)
        _store_rows(PART_DV + part, offs_n, stride_pt, offs_d, head_dim, n_valid, dv, EVEN_D)
    else:
        _store_rows(DK + start * stride_dkt + kv_head * stride_dkh, offs_n, stride_dkt, offs_d,
                    head_dim, n_valid, dk * softmax_scale, EVEN_D)
        _store_rows(DV + start * stride_dvt + kv_head * stride_dvh, offs_n, stride_dvt, offs_d,
                    head_dim, n_valid, dv, EVEN_D)


@triton.jit
def varlen_attention_prefix_add_splits_kernel(
        PART_DK, PART_DV, PART_TOKENS, DK, DV, stride_ps, stride_pt, stride_ph, stride_dkt,
        stride_dkh, stride_dvt, stride_dvh, num_rows, splits, head_dim, softmax_scale,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """dk, dv of ``BLOCK_R`` of the prefixes' ``num_rows`` packed rows, one KV head: the
    splits' float32 sums (``PART_*[split, row, head]``) added in split order (the same bits
    every run), dk scaled, stored at the rows' tokens (``PART_TOKENS``, int64): one pass over
    the sums instead of a reduction, two casts and two scatters."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1)
    valid = rows < num_rows
    offs_d = tl.arange(0, HEAD_DIM)
    offset = head.to(tl.int64) * stride_ph
    dk = _load_rows(PART_DK + offset, rows, stride_pt, offs_d, head_dim, valid, EVEN_D, False)
    dv = _load_rows(PART_DV + offset, rows, stride_pt, offs_d, head_dim, valid, EVEN_D, False)
    for _ in range(1, splits):
        offset += stride_ps
        dk += _load_rows(PART_DK + offset, rows, stride_pt, offs_d, head_dim, valid, EVEN_D,
                         False)
        dv += _load_rows(PART_DV + offset, rows, stride_pt, offs_d, head_dim, valid, EVEN_D,
                         False)
    tokens = tl.load(PART_TOKENS + rows, mask=valid, other=0)
    _store_rows(DK + head * stride_dkh, tokens, stride_dkt, offs_d, head_dim, valid,
                dk * softmax_scale, EVEN_D)
    _store_rows(DV + head * stride_dvh, tokens, stride_dvt, offs_d, head_dim, valid, dv, EVEN_D)


# The split sums' rows per program: 4096 float32 values of each of dk and dv (64 registers a
# thread at 4 warps).
ADD_SPLITS_VALUES = 4096
ADD_SPLITS_LAUNCH = dict(num_warps=4, num_stages=1)


def add_splits_rows(padded: int) -> int:
    """``BLOCK_R`` of ``varlen_attention_prefix_add_splits_kernel`` at padded head dim
    ``padded``."""
    return ADD_SPLITS_VALUES // padded


@triton.jit
def varlen_attention_prefix_backward_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU, PREFIX, TILE_SEQUENCE, TILE_BLOCK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dqt, stride_dqh, stride_lse_h, num_heads_q, groups, head_dim, softmax_scale,
        HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """dq of one (query tile of ``BLOCK_M``, query head): prefix keys, then own keys causally
    (the deterministic backward's second pass)."""
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
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    p_start, p_length = _prefix_span(CU, PREFIX, sequence)
    k_base = K + p_start * stride_kt + kv_head * stride_kh
    v_base = V + p_start * stride_vt + kv_head * stride_vh
    p_full = (p_length // BLOCK_N) * BLOCK_N
    for n0 in range(0, p_full, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_n, offs_d,
                      stride_kt, stride_vt, head_dim, p_length, qk_scale, 0, EVEN_D, False, IEEE)
    for n0 in range(p_full, p_length, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_n, offs_d,
                      stride_kt, stride_vt, head_dim, p_length, qk_scale, 0, EVEN_D, True, IEEE)
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    full_end = (block * BLOCK_M // BLOCK_N) * BLOCK_N
    end = tl.minimum(length, (block + 1) * BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_n, offs_d,
                      stride_kt, stride_vt, head_dim, length, qk_scale, 1, EVEN_D, False, IEEE)
    for n0 in range(full_end, end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_n, offs_d,
                      stride_kt, stride_vt, head_dim, length, qk_scale, 1, EVEN_D, True, IEEE)
    _store_rows(DQ + start * stride_dqt + head * stride_dqh, offs_m, stride_dqt, offs_d, head_dim,
                m_valid, dq * softmax_scale, EVEN_D)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time configurations.

def _signature(dtype: str, pointers: tuple, fp32: tuple, tables: tuple, integers: tuple) -> dict:
    """``pointers`` of ``dtype`` but those in ``fp32`` (float32), int32 ``tables``, i32
    ``integers`` and the float32 ``softmax_scale``."""
    signature = {name: "*fp32" if name in fp32 else f"*{dtype}" for name in pointers}
    signature.update({name: "*i32" for name in tables})
    signature.update({name: "i32" for name in integers})
    signature["softmax_scale"] = "fp32"
    return signature


_QKV_STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh")


def _forward_signature(dtype: str) -> dict:
    signature = _signature(dtype, ("Q", "K", "V", "O", "LSE"), ("LSE",),
                           ("CU", "PREFIX", "TILE_SEQUENCE", "TILE_BLOCK"),
                           _QKV_STRIDES + ("stride_ot", "stride_oh", "stride_lse_h",
                                           "num_heads_q", "groups", "head_dim"))
    signature.update({name: "constexpr" for name in ("HEAD_DIM", "EVEN_D", "BLOCK_M", "BLOCK_N",
                                                     "IEEE")})
    return signature


def _backward_dkdv_signature(dtype: str) -> dict:
    signature = _signature(dtype, ("Q", "K", "V", "DO", "LSE", "DELTA", "DQ", "DK", "DV",
                                   "PART_DK", "PART_DV"),
                           # DQ: the atomic float32 accumulator; PART_*: the splits' sums
                           ("LSE", "DELTA", "DQ", "PART_DK", "PART_DV"),
                           ("CU", "TILE_SEQUENCE", "TILE_BLOCK", "QUERY_PTR", "QUERY_ROW",
                            "QUERY_COUNT", "PART_ROW", "SPLIT_TILE"),
                           _QKV_STRIDES + ("stride_dot", "stride_doh", "stride_dqt",
                                           "stride_dqh", "stride_dkt", "stride_dkh", "stride_dvt",
                                           "stride_dvh", "stride_lse_h", "stride_ps", "stride_pt",
                                           "stride_ph", "num_heads_k", "groups", "splits",
                                           "extra", "head_dim"))
    signature.update({name: "constexpr" for name in ("HEAD_DIM", "EVEN_D", "STEP", "BLOCK",
                                                     "IEEE", "ATOMIC_DQ")})
    return signature


def _backward_dq_signature(dtype: str) -> dict:
    signature = _signature(dtype, ("Q", "K", "V", "DO", "LSE", "DELTA", "DQ"), ("LSE", "DELTA"),
                           ("CU", "PREFIX", "TILE_SEQUENCE", "TILE_BLOCK"),
                           _QKV_STRIDES + ("stride_dot", "stride_doh", "stride_dqt", "stride_dqh",
                                           "stride_lse_h", "num_heads_q", "groups", "head_dim"))
    signature.update({name: "constexpr" for name in ("HEAD_DIM", "EVEN_D", "BLOCK_M", "BLOCK_N",
                                                     "IEEE")})
    return signature


def _add_splits_signature(dtype: str) -> dict:
    signature = _signature(dtype, ("PART_DK", "PART_DV", "DK", "DV"), ("PART_DK", "PART_DV"),
                           (), ("stride_ps", "stride_pt", "stride_ph", "stride_dkt",
                                "stride_dkh", "stride_dvt", "stride_dvh", "num_rows", "splits",
                                "head_dim"))
    signature = {"PART_TOKENS": "*i64", **signature}
    signature.update({name: "constexpr" for name in ("HEAD_DIM", "EVEN_D", "BLOCK_R")})
    return signature


# The configurations CI compiles (``tests/triton_aot.py --sample``): the hot ones, and one of
# each other code path (float32's IEEE dots and its small tiles, an odd head dim's masks, the
# widest head); the rest differ in sizes (``python tests/triton_aot.py`` compiles every one).
SAMPLE = {("bf16", 64, False), ("fp32", 64, True), ("fp32", 256, True), ("bf16", 256, True)}


def _spec(name: str, fn, signature: dict, constexprs: dict, config: dict,
          tuning: tuple | None, hot: bool, sample: bool) -> dict:
    hints = _launch_hints(signature)
    hints["equal_to_1"] = []  # no causal argument: the prefix mode is always causal
    spec = {"name": name, "fn": fn, "signature": signature, "constexprs": constexprs,
            "num_warps": config["num_warps"], "num_stages": config["num_stages"],
            "hints": hints, "allow_spills": not hot, "sample": sample}
    if tuning:  # (the tuned launches' name; the split sums' kernel has none)
        spec["tuning"] = tuning
    return spec


def _one_split(spec: dict) -> dict:
    """The dk/dv launch without split prefix tiles, as triton specialises it: ``splits`` the
    constant 1 and ``extra`` 0 (divisible by 16); the spec it comes from has both as they
    vary, which a split launch matches."""
    hints = {"divisible_by_16": spec["hints"]["divisible_by_16"] + ["extra"],
             "equal_to_1": ["splits"]}
    variant = {k: v for k, v in spec.items() if k != "tuning"}  # (tuned: compiled once)
    return {**variant, "name": spec["name"] + "_one_split", "hints": hints}


def aot_specs():
    """Every configuration the launcher can pick (the plain kernels' configurations, tuned ones
    included through ``tuning``): forward, dk/dv with the atomic dq and without
    (deterministic), and the deterministic dq, per dtype, padded head dim and even/odd head
    dim; bf16/fp16 at D 64/128 must not spill (the issue)."""
    for dtype in DTYPES:
        for padded in PADDED_HEAD_DIMS:
            for even in (True, False):
                tag = f"{dtype}_d{padded}{'' if even else '_odd'}"
                key = f"{dtype}_d{padded}"
                hot = dtype != "fp32" and padded in (64, 128) and even
                sample = hot or (dtype, padded, even) in SAMPLE
                base = {"HEAD_DIM": padded, "EVEN_D": even, "IEEE": dtype == "fp32"}
                config = forward_config(dtype, padded)
                yield _spec(f"varlen_attention_prefix_forward_{tag}",
                            varlen_attention_prefix_forward_kernel, _forward_signature(dtype),
                            {**base, "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"]},
                            config, ("varlen_attention_forward", key), hot, sample)
                config = backward_config(dtype, padded)
                for atomic in (True, False):
                    name = f"varlen_attention_prefix_backward{'' if atomic else '_dkdv'}_{tag}"
                    spec = _spec(name, varlen_attention_prefix_backward_dkdv_kernel,
                                 _backward_dkdv_signature(dtype),
                                 {**base, "BLOCK": config["BLOCK"], "STEP": config["STEP"],
                                  "ATOMIC_DQ": atomic},
                                 config, ("varlen_attention_backward", key), hot, sample)
                    yield spec
                    if hot:
                        yield _one_split(spec)
                yield _spec(f"varlen_attention_prefix_add_splits_{tag}",
                            varlen_attention_prefix_add_splits_kernel,
                            _add_splits_signature(dtype),
                            {"HEAD_DIM": padded, "EVEN_D": even,
                             "BLOCK_R": add_splits_rows(padded)},
                            ADD_SPLITS_LAUNCH, None, hot, sample)
                config = backward_dq_config(dtype, padded)
                yield _spec(f"varlen_attention_prefix_backward_dq_{tag}",
                            varlen_attention_prefix_backward_dq_kernel,
                            _backward_dq_signature(dtype),
                            {**base, "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"]},
                            config, ("varlen_attention_backward_dq", key), hot, sample)
