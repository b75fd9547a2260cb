"""Triton kernels of ``token_logprobs`` (docs/design.md, "Token-level PPO loss", log-probs).

For each row ``t`` of ``logits[T, V]`` and tempered logits ``z = logits[t] / temperature``:

    logp[t]    = z[labels[t]] - logsumexp(z)          (clamped to <= 0)
    entropy[t] = logsumexp(z) - sum_j p_j z_j          (clamped to >= 0), p = softmax(z)
    lse[t]     = logsumexp(z)                          (kept for the backward)

Rows whose label equals ``ignore_index`` get ``logp = entropy = 0`` and a zero gradient.

Forward: one program per row, one pass over the vocabulary in ``BLOCK_V`` blocks with an online
log-sum-exp (one exponential per element). The entropy rides along as
``t = sum_j e_j (x_j - m)`` with ``e_j = exp(x_j - m)`` rescaled when the running max ``m``
changes, so ``entropy = log(s) - t / s``: every term of ``t`` is <= 0, so no cancellation
between large numbers, and the entropy is >= 0 by construction. (Natural units, not base 2:
scaling by log2(e) would overflow logits near the float32 maximum.)

Backward: one program per row, one pass: ``d logits_j = (g_logp (1[j = label] - p_j)
- g_entropy p_j (log p_j + entropy)) / temperature``, written into ``grad_logits`` (which may
be the logits buffer itself: each program reads a block before writing it).

Kernels assume valid metadata (the launcher in ``agentrl_fast/ops/token_logprobs.py`` checks);
labels are clamped into ``[0, V)`` so unvalidated labels give wrong numbers, never a bad access.
This module imports triton only.
"""

import triton
import triton.language as tl

from .tuned import tuned

# The launcher picks BLOCK_V by vocabulary size: (V below which it applies, BLOCK_V, num_warps).
# Every entry is compiled for sm_90 by aot_specs().
BLOCK_CONFIGS = ((16384, 1024, 4), (None, 4096, 8))
LOGIT_DTYPES = ("bf16", "fp16", "fp32")


def block_config(vocab_size: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` the launcher uses for a vocabulary of ``vocab_size``: the range's
    default, or the tuning sweep's for this GPU (``agentrl_fast/kernels/tuned.py``, key ``block<default>``)."""
    for limit, block_v, num_warps in BLOCK_CONFIGS:
        if limit is None or vocab_size < limit:
            config = tuned("token_logprobs", f"block{block_v}",
                           {"BLOCK_V": block_v, "num_warps": num_warps})
            return config["BLOCK_V"], config["num_warps"]
    raise AssertionError("unreachable")


@triton.jit
def token_logprobs_forward_kernel(
    logits_ptr,          # [T, V] (row stride stride_row, column stride 1), bf16/fp16/fp32
    labels_ptr,          # [T] int64
    logp_ptr,            # [T] fp32 out
    entropy_ptr,         # [T] fp32 out (untouched unless COMPUTE_ENTROPY)
    lse_ptr,             # [T] fp32 out: logsumexp of the tempered row (natural log)
    stride_row,
    V,
    inv_temperature,
    ignore_index,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    columns = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)  # running max of the tempered logits
    s = tl.zeros([], tl.float32)                # sum exp(x - m)
    t = tl.zeros([], tl.float32)                # sum exp(x - m) (x - m)
    for start in range(0, V, BLOCK_V):
        cols = start + columns
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)  # 0 while m is -inf
        e = tl.exp(x - shift)
        if COMPUTE_ENTROPY:
            # Lanes with e = 0 (masked, -inf or underflowed) contribute 0, never 0 * -inf.
            d = tl.where(e > 0, x - shift, 0.0)
            m_finite = tl.where(m == float("-inf"), shift, m)  # while m = -inf, s = t = 0
            t = alpha * (t + s * (m_finite - shift)) + tl.sum(e * d, axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    lse = tl.where(m == float("-inf"), 0.0, m) + log_s
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    label = tl.minimum(tl.maximum(label, 0), V - 1).to(tl.int64)
    x_label = tl.load(base + label).to(tl.float32) * inv_temperature
    logp = tl.minimum(x_label - lse, 0.0)
    tl.store(logp_ptr + row, tl.where(ignored, 0.0, logp))
    tl.store(lse_ptr + row, lse)
    if COMPUTE_ENTROPY:
        entropy = tl.maximum(log_s - t / s, 0.0)
        tl.store(entropy_ptr + row, tl.where(ignored, 0.0, entropy))


@triton.jit
def token_logprobs_backward_kernel(
    logits_ptr,          # [T, V] row stride stride_row, bf16/fp16/fp32
    grad_logits_ptr,     # [T, V] row stride grad_stride_row, dtype of logits (may be logits_ptr)
    labels_ptr,          # [T] int64
    lse_ptr,             # [T] fp32
    entropy_ptr,         # [T] fp32 (read only when HAS_GRAD_ENTROPY)
    grad_logp_ptr,       # [T] fp32
    grad_entropy_ptr,    # [T] fp32 (read only when HAS_GRAD_ENTROPY)
    stride_row,
    grad_stride_row,
    V,
    inv_temperature,
    ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    grad_base = grad_logits_ptr + row * grad_stride_row
    label = tl.load(labels_ptr + row)
    keep = (label != ignore_index).to(tl.float32)
    label = tl.minimum(tl.maximum(label, 0), V - 1).to(tl.int64)
    # Gradients already carry 1/temperature and the ignore mask, once per row.
    g_logp = tl.load(grad_logp_ptr + row) * keep * inv_temperature
    lse = tl.load(lse_ptr + row)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(grad_entropy_ptr + row) * keep * inv_temperature
        entropy = tl.load(entropy_ptr + row)
    columns = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + columns
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        log_p = x - lse
        p = tl.exp(log_p)
        grad = tl.where(cols == label, g_logp, 0.0) - g_logp * p
        if HAS_GRAD_ENTROPY:
            log_p = tl.where(p > 0, log_p, 0.0)  # p = 0: the term is 0, never 0 * -inf
            grad -= g_entropy * p * (log_p + entropy)
        grad = grad * keep  # exact zeros on ignored rows (even where p is not finite)
        tl.store(grad_base + cols, grad.to(grad_logits_ptr.dtype.element_ty), mask=inside)


def aot_specs():
    """Every configuration the launcher can pick, for tests/triton_aot.py (sm_90). Launch hints
    (the specialisation the compiles get): vocabularies are padded to multiples of 16 (151936,
    152064, 128256, 32000), so are ``V`` and the row strides; ``ignore_index`` (-100) is not."""
    for dtype in LOGIT_DTYPES:
        for _, block_v, num_warps in BLOCK_CONFIGS:
            for with_entropy in (False, True):
                suffix = f"{dtype}_block{block_v}{'_entropy' if with_entropy else ''}"
                yield {
                    "name": f"token_logprobs_forward_{suffix}",
                    "fn": token_logprobs_forward_kernel,
                    "signature": {"logits_ptr": f"*{dtype}", "labels_ptr": "*i64",
                                  "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "lse_ptr": "*fp32",
                                  "stride_row": "i32", "V": "i32", "inv_temperature": "fp32",
                                  "ignore_index": "i32", "COMPUTE_ENTROPY": "constexpr",
                                  "BLOCK_V": "constexpr"},
                    "constexprs": {"COMPUTE_ENTROPY": with_entropy, "BLOCK_V": block_v},
                    "hints": {"divisible_by_16": ["stride_row", "V"]},
                    "num_warps": num_warps, "num_stages": 1,
                    "tuning": ("token_logprobs", f"block{block_v}"),
                }
                yield {
                    "name": f"token_logprobs_backward_{suffix}",
                    "fn": token_logprobs_backward_kernel,
                    "signature": {"logits_ptr": f"*{dtype}", "grad_logits_ptr": f"*{dtype}",
                                  "labels_ptr": "*i64", "lse_ptr": "*fp32",
                                  "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32",
                                  "grad_entropy_ptr": "*fp32", "stride_row": "i32",
                                  "grad_stride_row": "i32", "V": "i32", "inv_temperature": "fp32",
                                  "ignore_index": "i32", "HAS_GRAD_ENTROPY": "constexpr",
                                  "BLOCK_V": "constexpr"},
                    "constexprs": {"HAS_GRAD_ENTROPY": with_entropy, "BLOCK_V": block_v},
                    "hints": {"divisible_by_16": ["stride_row", "grad_stride_row", "V"]},
                    "num_warps": num_warps, "num_stages": 1,
                    "tuning": ("token_logprobs", f"block{block_v}"),
                }
