"""Triton kernels of the token-level PPO loss and the value loss (docs/design.md, "Token-level PPO
loss"). Imports triton only.

Each loss is three launches, with no atomics (deterministic) and no host sync:

1. ``*_forward_kernel``: one program per ``BLOCK`` tokens computes every token's loss term and
   its derivative (the loss is a weighted sum, so ``dloss/dx_t`` is known in the forward:
   Liger-Kernel's trick) and writes one row of partial sums (``NUM_COLUMNS`` columns: the
   weighted loss, its parts, the counts behind the metrics, a max);
2. ``loss_finalize_kernel``: one program reduces the partial rows in a fixed order and writes
   the metrics vector ``out[NUM_COLUMNS]`` whose column 0 is the loss and whose last column is
   the scale applied to the weighted sums (``1 / max(N, 1)`` for token-mean with the kernel's
   own count, else 1);
3. ``scale_gradient_kernel`` (backward): ``grad[t] = d[t] * grad_out * scale``, cast to the
   input's dtype.

Compute is float32 whatever the input dtype. ``aot_specs()`` lists the configurations the
launcher in ``agentrl_fast/ops/ppo_loss.py`` picks (``tests/triton_aot.py`` compiles them for
sm_90).
"""

import triton
import triton.language as tl

NUM_COLUMNS = 16  # partial-sum columns of both losses; the last metrics column is the scale
BLOCK = 1024
NUM_WARPS = 4
FINALIZE_BLOCK = 64

# PPO partial/metrics columns
PPO_LOSS, PPO_PG, PPO_KL_LOSS, PPO_ENTROPY_LOSS, PPO_COUNT = 0, 1, 2, 3, 4
PPO_CLIP_UPPER, PPO_CLIP_LOWER, PPO_CLIP_DUAL, PPO_APPROX_KL, PPO_RATIO = 5, 6, 7, 8, 9
PPO_RATIO_MAX, PPO_KL, PPO_ENTROPY = 10, 11, 12
PPO_USED = 13
PPO_SCALED = 0b1111  # columns multiplied by the scale
PPO_MEANS = (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 11) | (1 << 12)
# value-loss columns
VALUE_LOSS, VALUE_COUNT, VALUE_CLIPPED, VALUE_SQUARED_ERROR = 0, 1, 2, 3
VALUE_USED = 4
VALUE_SCALED = 0b1
VALUE_MEANS = (1 << 2) | (1 << 3)
SCALE_COLUMN = NUM_COLUMNS - 1

KL_NONE, KL_K1, KL_K2, KL_K3 = 0, 1, 2, 3


@triton.jit
def _store_row(row_ptr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12,
               NUM_COLUMNS: tl.constexpr):
    """Writes 13 scalars and zeros as one row of ``NUM_COLUMNS``."""
    cols = tl.arange(0, NUM_COLUMNS)
    row = tl.where(cols == 0, c0, 0.0)
    row = tl.where(cols == 1, c1, row)
    row = tl.where(cols == 2, c2, row)
    row = tl.where(cols == 3, c3, row)
    row = tl.where(cols == 4, c4, row)
    row = tl.where(cols == 5, c5, row)
    row = tl.where(cols == 6, c6, row)
    row = tl.where(cols == 7, c7, row)
    row = tl.where(cols == 8, c8, row)
    row = tl.where(cols == 9, c9, row)
    row = tl.where(cols == 10, c10, row)
    row = tl.where(cols == 11, c11, row)
    row = tl.where(cols == 12, c12, row)
    tl.store(row_ptr + cols, row)


@triton.jit
def ppo_loss_forward_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr, entropy_ptr, rollout_ptr,
    dlogp_ptr, dentropy_ptr, partial_ptr,
    num_tokens, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tis_cap,
    HAS_WEIGHTS: tl.constexpr, HAS_DUAL: tl.constexpr, KL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_ROLLOUT: tl.constexpr, NEED_GRAD_LOGP: tl.constexpr,
    NEED_GRAD_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, NUM_COLUMNS: tl.constexpr,
):
    """Per action token ``t`` (``mask[t] != 0``), with ``w_t`` = ``weight[t]`` (HAS_WEIGHTS) or 1:
    ``l_t = pg_t * tis_t + kl_coef * KL_t - entropy_coef * entropy_t``; writes
    ``dlogp[t] = w_t * dl_t/dlogp_t`` and ``dentropy[t] = -entropy_coef * w_t`` (0 off actions)
    and the program's row of partial sums (columns ``PPO_*``)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num_tokens
    act = (tl.load(mask_ptr + offs, mask=inside, other=0) != 0) & inside
    logp = tl.load(logp_ptr + offs, mask=act, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=act, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=act, other=0.0).to(tl.float32)
    if HAS_WEIGHTS:
        w = tl.load(weight_ptr + offs, mask=act, other=0.0).to(tl.float32)
    else:
        w = act.to(tl.float32)

    # ratio = exp(clamp(logp - old, -20, 20)); d ratio / d logp = ratio inside the clamp
    diff = logp - old
    log_ratio = tl.minimum(tl.maximum(diff, -20.0), 20.0)
    ratio = tl.exp(log_ratio)
    dratio = tl.where((diff >= -20.0) & (diff <= 20.0), ratio, 0.0)
    low = 1.0 - clip_low
    high = 1.0 + clip_high
    clipped = tl.minimum(tl.maximum(ratio, low), high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped
    pg = tl.maximum(pg1, pg2)
    # the unclipped branch carries the gradient where it is the max or where the clip is idle
    passes = (pg1 >= pg2) | ((ratio >= low) & (ratio <= high))
    dpg = tl.where(passes, -adv * dratio, 0.0)
    clip_upper = act & (adv > 0) & (ratio > high)
    clip_lower = act & (adv < 0) & (ratio < low)
    if HAS_DUAL:
        pg3 = -adv * dual_clip
        dual = (adv < 0) & (pg3 < pg)
        pg = tl.where(dual, pg3, pg)
        dpg = tl.where(dual, 0.0, dpg)
        clip_dual = act & dual
    else:
        clip_dual = act & (adv != adv)  # all False
    if HAS_ROLLOUT:
        rollout = tl.load(rollout_ptr + offs, mask=act, other=0.0).to(tl.float32)
        tis = tl.minimum(tl.exp(tl.minimum(old - rollout, 20.0)), tis_cap)
        pg = pg * tis
        dpg = dpg * tis
    term = pg
    dterm = dpg
    kl = tl.zeros([BLOCK], dtype=tl.float32)
    if KL != 0:
        ref = tl.load(ref_ptr + offs, mask=act, other=0.0).to(tl.float32)
        if KL == 1:  # k1
            kl = logp - ref
            dkl = tl.full([BLOCK], 1.0, tl.float32)
        elif KL == 2:  # k2
            kl = 0.5 * (logp - ref) * (logp - ref)
            dkl = logp - ref
        else:  # k3 (verl's low_var_kl): clamp(exp(r) - r - 1, -10, 10), r = clamp(ref - logp, +-20)
            r_raw = ref - logp
            r = tl.minimum(tl.maximum(r_raw, -20.0), 20.0)
            e = tl.exp(r)
            k3 = e - r - 1.0
            kl = tl.minimum(tl.maximum(k3, -10.0), 10.0)
            live = (r_raw >= -20.0) & (r_raw <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)
            dkl = tl.where(live, 1.0 - e, 0.0)
        kl = tl.where(act, kl, 0.0)
        term = term + kl_coef * kl
        dterm = dterm + kl_coef * dkl
    ent = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_ENTROPY:
        ent = tl.load(entropy_ptr + offs, mask=act, other=0.0).to(tl.float32)
        term = term - entropy_coef * ent
    pg = tl.where(act, pg, 0.0)
    term = tl.where(act, term, 0.0)
    if NEED_GRAD_LOGP:
        tl.store(dlogp_ptr + offs, tl.where(act, w * dterm, 0.0), mask=inside)
    if NEED_GRAD_ENTROPY:
        tl.store(dentropy_ptr + offs, tl.where(act, -entropy_coef * w, 0.0), mask=inside)

    actf = act.to(tl.float32)
    _store_row(partial_ptr + pid.to(tl.int64) * NUM_COLUMNS,
               tl.sum(w * term, 0), tl.sum(w * pg, 0), tl.sum(w * kl, 0), tl.sum(w * ent, 0),
               tl.sum(actf, 0), tl.sum(clip_upper.to(tl.float32), 0),
               tl.sum(clip_lower.to(tl.float32), 0), tl.sum(clip_dual.to(tl.float32), 0),
               tl.sum(tl.where(act, old - logp, 0.0), 0), tl.sum(tl.where(act, ratio, 0.0), 0),
               tl.max(tl.where(act, ratio, 0.0), 0), tl.sum(kl, 0), tl.sum(ent, 0),
               NUM_COLUMNS)


@triton.jit
def value_loss_forward_kernel(
    values_ptr, old_ptr, returns_ptr, mask_ptr, weight_ptr, dvalues_ptr, partial_ptr,
    num_tokens, clip,
    HAS_WEIGHTS: tl.constexpr, HAS_CLIP: tl.constexpr, NEED_GRAD: tl.constexpr,
    BLOCK: tl.constexpr, NUM_COLUMNS: tl.constexpr,
):
    """Per action token: ``l_t = 0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2)``; writes
    ``dvalues[t] = w_t * dl_t/dv_t`` and the row of partial sums (columns ``VALUE_*``)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num_tokens
    act = (tl.load(mask_ptr + offs, mask=inside, other=0) != 0) & inside
    v = tl.load(values_ptr + offs, mask=act, other=0.0).to(tl.float32)
    ret = tl.load(returns_ptr + offs, mask=act, other=0.0).to(tl.float32)
    if HAS_WEIGHTS:
        w = tl.load(weight_ptr + offs, mask=act, other=0.0).to(tl.float32)
    else:
        w = act.to(tl.float32)
    err = v - ret
    loss1 = err * err
    loss = loss1
    dloss = err  # d (0.5 * loss) / dv
    clipped = act & (v != v)  # all False
    if HAS_CLIP:
        old = tl.load(old_ptr + offs, mask=act, other=0.0).to(tl.float32)
        low = old - clip
        high = old + clip
        vc = tl.minimum(tl.maximum(v, low), high)
        err2 = vc - ret
        loss2 = err2 * err2
        clipped = act & (loss2 > loss1)
        loss = tl.maximum(loss1, loss2)
        dloss = tl.where(clipped, tl.where((v >= low) & (v <= high), err2, 0.0), err)
    half = tl.where(act, 0.5 * loss, 0.0)
    if NEED_GRAD:
        tl.store(dvalues_ptr + offs, tl.where(act, w * dloss, 0.0), mask=inside)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    _store_row(partial_ptr + pid.to(tl.int64) * NUM_COLUMNS,
               tl.sum(w * half, 0), tl.sum(act.to(tl.float32), 0),
               tl.sum(clipped.to(tl.float32), 0), tl.sum(tl.where(act, loss1, 0.0), 0),
               zero, zero, zero, zero, zero, zero, zero, zero, zero, NUM_COLUMNS)


@triton.jit
def loss_finalize_kernel(
    partial_ptr, out_ptr, num_rows, count_override,
    TOKEN_MEAN: tl.constexpr, USED: tl.constexpr, COUNT_COLUMN: tl.constexpr,
    MAX_COLUMN: tl.constexpr, SCALED: tl.constexpr, MEANS: tl.constexpr,
    NUM_COLUMNS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """One program: ``out[c] = sum_rows partial[:, c]`` (``max`` for ``MAX_COLUMN``), times the
    scale for the ``SCALED`` columns, over ``max(count, 1)`` for the ``MEANS`` columns;
    ``out[NUM_COLUMNS - 1]`` = the scale: ``1 / max(N, 1)`` with ``N = count_override`` when
    positive, else the summed ``COUNT_COLUMN`` (TOKEN_MEAN), else 1."""
    cols = tl.arange(0, NUM_COLUMNS)
    rows = tl.arange(0, BLOCK_ROWS)
    used = cols < USED
    total = tl.zeros([BLOCK_ROWS, NUM_COLUMNS], dtype=tl.float32)
    top = tl.zeros([BLOCK_ROWS, NUM_COLUMNS], dtype=tl.float32)
    for start in range(0, num_rows, BLOCK_ROWS):
        r = start + rows
        tile = tl.load(partial_ptr + r[:, None].to(tl.int64) * NUM_COLUMNS + cols[None, :],
                       mask=(r[:, None] < num_rows) & used[None, :], other=0.0)
        total += tile
        top = tl.maximum(top, tile)
    sums = tl.sum(total, 0)
    maxes = tl.max(top, 0)
    count = tl.sum(tl.where(cols == COUNT_COLUMN, sums, 0.0), 0)
    if TOKEN_MEAN:
        n = tl.where(count_override > 0, count_override, count)
        scale = 1.0 / tl.maximum(n, 1.0)
    else:
        scale = count * 0.0 + 1.0
    out = tl.where(cols == MAX_COLUMN, maxes, sums)
    out = tl.where(((SCALED >> cols) & 1) != 0, out * scale, out)
    out = tl.where(((MEANS >> cols) & 1) != 0, out / tl.maximum(count, 1.0), out)
    out = tl.where(cols == NUM_COLUMNS - 1, scale, out)
    tl.store(out_ptr + cols, out)


@triton.jit
def scale_gradient_kernel(d_ptr, grad_out_ptr, metrics_ptr, out_ptr, num_tokens,
                          SCALE_COLUMN: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = d[t] * grad_out[0] * metrics[SCALE_COLUMN]`` (the backward of a weighted sum)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num_tokens
    factor = tl.load(grad_out_ptr).to(tl.float32) * tl.load(metrics_ptr + SCALE_COLUMN)
    d = tl.load(d_ptr + offs, mask=inside, other=0.0)
    tl.store(out_ptr + offs, (d * factor).to(out_ptr.dtype.element_ty), mask=inside)


# ---------------------------------------------------------------------------------------------
# Configurations (tests/triton_aot.py compiles each for sm_90).

TRITON_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def ppo_forward_signature(dtype: str, weights: bool = True) -> dict:
    """Triton signature of ``ppo_loss_forward_kernel`` with the per-token inputs in ``dtype``
    (fp32/bf16/fp16; advantages and weights float32)."""
    p = f"*{dtype}"
    return {"logp_ptr": p, "old_ptr": p, "adv_ptr": "*fp32", "mask_ptr": "*u8",
            "weight_ptr": "*fp32", "ref_ptr": p, "entropy_ptr": p, "rollout_ptr": p,
            "dlogp_ptr": "*fp32", "dentropy_ptr": "*fp32", "partial_ptr": "*fp32",
            "num_tokens": "i32", "clip_low": "fp32", "clip_high": "fp32", "dual_clip": "fp32",
            "kl_coef": "fp32", "entropy_coef": "fp32", "tis_cap": "fp32",
            "HAS_WEIGHTS": "constexpr", "HAS_DUAL": "constexpr", "KL": "constexpr",
            "HAS_ENTROPY": "constexpr", "HAS_ROLLOUT": "constexpr",
            "NEED_GRAD_LOGP": "constexpr", "NEED_GRAD_ENTROPY": "constexpr",
            "BLOCK": "constexpr", "NUM_COLUMNS": "constexpr"}


def aot_specs():
    """The shipped configurations: every feature flag of the forward on (each KL estimator) and
    all off, for fp32 and bf16 inputs; the value loss with and without clipping; the finalize
    for both column layouts; the backward for each output dtype. No integer launch hints (see
    tests/triton_aot.py): the token and row counts are arbitrary, and more than 1 in use."""
    for dtype in ("fp32", "bf16"):
        flag_sets = [dict(HAS_WEIGHTS=False, HAS_DUAL=False, KL=KL_NONE, HAS_ENTROPY=False,
                          HAS_ROLLOUT=False, NEED_GRAD_LOGP=True, NEED_GRAD_ENTROPY=False)]
        for kl in (KL_K1, KL_K2, KL_K3):
            flag_sets.append(dict(HAS_WEIGHTS=True, HAS_DUAL=True, KL=kl, HAS_ENTROPY=True,
                                  HAS_ROLLOUT=True, NEED_GRAD_LOGP=True, NEED_GRAD_ENTROPY=True))
        for flags in flag_sets:
            name = "ppo_loss_forward_" + dtype + "_" + "_".join(
                f"{k.lower()}{int(v)}" for k, v in flags.items())
            yield {"name": name, "fn": ppo_loss_forward_kernel,
                   "signature": ppo_forward_signature(dtype),
                   "constexprs": dict(flags, BLOCK=BLOCK, NUM_COLUMNS=NUM_COLUMNS),
                   "num_warps": NUM_WARPS, "num_stages": 1}
        p = f"*{dtype}"
        for clip in (False, True):
            yield {"name": f"value_loss_forward_{dtype}_clip{int(clip)}", "fn": value_loss_forward_kernel,
                   "signature": {"values_ptr": p, "old_ptr": p, "returns_ptr": "*fp32",
                                 "mask_ptr": "*u8", "weight_ptr": "*fp32", "dvalues_ptr": "*fp32",
                                 "partial_ptr": "*fp32", "num_tokens": "i32", "clip": "fp32",
                                 "HAS_WEIGHTS": "constexpr", "HAS_CLIP": "constexpr",
                                 "NEED_GRAD": "constexpr", "BLOCK": "constexpr",
                                 "NUM_COLUMNS": "constexpr"},
                   "constexprs": dict(HAS_WEIGHTS=True, HAS_CLIP=clip, NEED_GRAD=True, BLOCK=BLOCK,
                                      NUM_COLUMNS=NUM_COLUMNS),
                   "num_warps": NUM_WARPS, "num_stages": 1}
        yield {"name": f"scale_gradient_{dtype}", "fn": scale_gradient_kernel,
               "signature": {"d_ptr": "*fp32", "grad_out_ptr": "*fp32", "metrics_ptr": "*fp32",
                             "out_ptr": p, "num_tokens": "i32", "SCALE_COLUMN": "constexpr",
                             "BLOCK": "constexpr"},
               "constexprs": {"SCALE_COLUMN": SCALE_COLUMN, "BLOCK": BLOCK},
               "num_warps": NUM_WARPS, "num_stages": 1}
    layouts = {"ppo": (PPO_USED, PPO_COUNT, PPO_RATIO_MAX, PPO_SCALED, PPO_MEANS),
               "value": (VALUE_USED, VALUE_COUNT, -1, VALUE_SCALED, VALUE_MEANS)}
    for name, (used, count, top, scaled, means) in layouts.items():
        for token_mean in (False, True):
            yield {"name": f"loss_finalize_{name}_token_mean{int(token_mean)}",
                   "fn": loss_finalize_kernel,
                   "signature": {"partial_ptr": "*fp32", "out_ptr": "*fp32", "num_rows": "i32",
                                 "count_override": "fp32", "TOKEN_MEAN": "constexpr",
                                 "USED": "constexpr", "COUNT_COLUMN": "constexpr",
                                 "MAX_COLUMN": "constexpr", "SCALED": "constexpr",
                                 "MEANS": "constexpr", "NUM_COLUMNS": "constexpr",
                                 "BLOCK_ROWS": "constexpr"},
                   "constexprs": dict(TOKEN_MEAN=token_mean, USED=used, COUNT_COLUMN=count,
                                      MAX_COLUMN=top, SCALED=scaled, MEANS=means,
                                      NUM_COLUMNS=NUM_COLUMNS, BLOCK_ROWS=FINALIZE_BLOCK),
                   "num_warps": NUM_WARPS, "num_stages": 1}
