"""Token-level PPO loss, loss weights and value loss on the torch (CPU) path, against the
float64 references of ``agentrl_fast/ops/reference.py``: values, gradients, every
aggregation mode, exactly zero gradient on masked tokens, no NaN on fully masked sequences,
metrics, and micro-batch exactness (any split, token_weights sliced from the full batch,
accumulates to the full-batch gradient). Bad arguments are checked in a child process.

The Triton path runs the same checks under the interpreter: tests/interpret/test_ppo_loss.py.
"""

import textwrap

import pytest
import torch
from error_cases import bad_input_tests

from agentrl_fast.ops.reference import (loss_weights_reference, ppo_loss_reference,
                                                  value_loss_reference)
from agentrl_fast.ops.ppo_loss import LOSS_AGG_MODES, loss_weights, ppo_loss, value_loss

BACKEND = "torch"
NORM = 37.0


def make_batch(lengths, seed, *, dtype=torch.float32, masked_sequences=(), num_rollouts=None):
    """A packed batch: prompt then alternating action/observation spans per sequence; the
    sequences whose index is in ``masked_sequences`` are fully masked; ``rollout_ids`` groups
    sequences into ``num_rollouts`` rollouts (interleaved, so a rollout's sub-traces are far
    apart)."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    parts = []
    for b, n in enumerate(lengths):
        mask = torch.zeros(n, dtype=torch.bool)
        t = int(torch.randint(1, 4, (), generator=gen)) if n else 0
        while t < n:
            run = int(torch.randint(1, 9, (), generator=gen))
            mask[t:t + run] = True
            t += run + int(torch.randint(0, 6, (), generator=gen))
        if b in masked_sequences:
            mask[:] = False
        parts.append(mask)
    mask = torch.cat(parts)
    T = mask.numel()
    logp = -torch.rand(T, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)
    batch = {
        "cu_seqlens": cu, "action_mask": mask,
        "logprobs": logp.to(dtype), "old_logprobs": old.to(dtype),
        "advantages": torch.randn(T, generator=gen, dtype=torch.float64).to(dtype),
        "ref_logprobs": (logp + 0.4 * torch.randn(T, generator=gen, dtype=torch.float64)).to(dtype),
        "entropy": (torch.rand(T, generator=gen, dtype=torch.float64) * 2).to(dtype),
        "rollout_logprobs": (old + 0.2 * torch.randn(T, generator=gen, dtype=torch.float64)).to(dtype),
        "values": torch.randn(T, generator=gen, dtype=torch.float64).to(dtype),
        "returns": torch.randn(T, generator=gen, dtype=torch.float64).to(dtype),
    }
    batch["old_values"] = (batch["values"].double()
                           + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)).to(dtype)
    num_rollouts = num_rollouts or max(1, len(lengths) // 3)
    batch["rollout_ids"] = (torch.arange(len(lengths)) % num_rollouts) * 7 + 100
    return batch


LENGTHS = [40, 0, 1, 23, 64, 17, 5, 90, 33, 2, 48, 11]
FEATURES = {
    "plain": {},
    "asymmetric": {"clip_low": 0.1, "clip_high": 0.28},
    "dual_clip": {"dual_clip": 2.0},
    "kl_k1": {"kl_estimator": "k1", "kl_coef": 0.3},
    "kl_k2": {"kl_estimator": "k2", "kl_coef": 0.3},
    "kl_k3": {"kl_estimator": "k3", "kl_coef": 0.3},
    "entropy": {"entropy_coef": 0.05},
    "tis": {"tis_cap": 1.2},
    "all": {"dual_clip": 3.0, "kl_estimator": "k3", "kl_coef": 0.1, "entropy_coef": 0.01,
            "tis_cap": 2.0, "clip_high": 0.28},
}


def feature_kwargs(name, batch, *, entropy=None):
    kw = dict(FEATURES[name])
    if "kl_coef" in kw:
        kw["ref_logprobs"] = batch["ref_logprobs"]
    if "entropy_coef" in kw:
        kw["entropy"] = batch["entropy"] if entropy is None else entropy
    if "tis_cap" in kw:
        kw["rollout_logprobs"] = batch["rollout_logprobs"]
    return kw


def mode_kwargs(mode, batch):
    return {"loss_agg_mode": mode, "cu_seqlens": batch["cu_seqlens"],
            "rollout_ids": batch["rollout_ids"] if mode == "rollout-mean" else None,
            "norm_constant": NORM if mode == "seq-mean-token-sum-norm" else None}


def reference_weights(mode, batch, **kw):
    return loss_weights_reference(mode, batch["action_mask"], batch["cu_seqlens"],
                                  batch["rollout_ids"], NORM, **kw)


def run_ppo(batch, mode=None, features="plain", backend=BACKEND, token_weights=None, *,
            entropy_grad=True, **extra):
    """Our loss and its gradients ``(loss, metrics, dlogp, dentropy)`` (``dentropy`` None
    without an entropy term or with ``entropy_grad=False``: a frozen entropy)."""
    logp = batch["logprobs"].clone().requires_grad_()
    entropy = batch["entropy"].clone().requires_grad_(entropy_grad)
    kw = feature_kwargs(features, batch, entropy=entropy)
    if token_weights is None:
        kw.update(mode_kwargs(mode, batch))
    kw.update(extra)
    loss, metrics = ppo_loss(logp, batch["old_logprobs"], batch["advantages"], batch["action_mask"],
                             token_weights=token_weights, backend=backend, **kw)
    inputs = [logp] + ([entropy] if "entropy" in kw and entropy_grad else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return loss.detach(), metrics, grads[0], (grads[1] if len(grads) > 1 else None)


def reference_ppo(batch, weights, features="plain"):
    logp = batch["logprobs"].double().requires_grad_()
    entropy = batch["entropy"].double().requires_grad_()
    kw = feature_kwargs(features, batch, entropy=entropy)
    loss, metrics = ppo_loss_reference(logp, batch["old_logprobs"], batch["advantages"],
                                       batch["action_mask"], weights=weights, **kw)
    inputs = [logp] + ([entropy] if "entropy" in kw else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None, None]
    dlogp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
    dent = None
    if "entropy" in kw:
        dent = grads[1] if grads[1] is not None else torch.zeros_like(entropy)
    return loss.detach(), metrics, dlogp, dent


def tolerance(dtype):
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}[dtype]


def assert_close(name, got, want, scale, dtype):
    got = got.detach().double()
    want = want.double()
    atol = tolerance(dtype) * max(1.0, scale)
    error = (got - want).abs().max().item() if got.numel() else 0.0
    assert error <= atol, f"{name}: max error {error:.3g} > {atol:.3g}"


# ---------------------------------------------------------------------------------------------
# Loss weights


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_weights_match_reference(mode, seed):
    batch = make_batch(LENGTHS, seed, masked_sequences=(3, 8))
    got = loss_weights(mode, batch["action_mask"], batch["cu_seqlens"], batch["rollout_ids"], NORM)
    want = reference_weights(mode, batch)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got[~batch["action_mask"]] == 0).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    if mode in ("token-mean", "seq-mean-token-mean", "rollout-mean"):
        # means: the weights of a non-empty batch sum to 1
        assert abs(float(got.double().sum()) - 1) < 1e-5


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_weights_global_counts(mode):
    batch = make_batch(LENGTHS, 2)
    got = loss_weights(mode, batch["action_mask"], batch["cu_seqlens"], batch["rollout_ids"], NORM,
                       global_tokens=1000, global_sequences=torch.tensor(40.0))
    want = reference_weights(mode, batch, global_tokens=1000, global_sequences=40)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_rollout_mean_weighs_rollouts_equally():
    # rollout 5 is cut into 3 sub-traces, rollout 9 into 1: each rollout sums to 1/2
    cu = torch.tensor([0, 4, 10, 13, 20], dtype=torch.int32)
    mask = torch.ones(20, dtype=torch.bool)
    mask[[0, 4, 10, 13]] = False
    ids = torch.tensor([5, 5, 9, 5])
    w = loss_weights("rollout-mean", mask, cu, ids)
    seq = torch.repeat_interleave(torch.arange(4), cu.diff().long())
    per_rollout = {5: float(w[(seq != 2)].sum()), 9: float(w[seq == 2].sum())}
    assert per_rollout == pytest.approx({5: 0.5, 9: 0.5})


def test_fully_masked_batch_gives_zero_weights():
    mask = torch.zeros(7, dtype=torch.bool)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    for mode in LOSS_AGG_MODES:
        w = loss_weights(mode, mask, cu, torch.tensor([0, 0]), NORM)
        assert torch.isfinite(w).all() and (w == 0).all()


# ---------------------------------------------------------------------------------------------
# PPO loss: values, gradients, metrics


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_loss_matches_reference(mode, features):
    batch = make_batch(LENGTHS, 3, masked_sequences=(4,))
    loss, metrics, dlogp, dent = run_ppo(batch, mode, features)
    weights = reference_weights(mode, batch)
    ref_loss, ref_metrics, ref_dlogp, ref_dent = reference_ppo(batch, weights, features)
    scale = float(weights.abs().max()) * batch["action_mask"].sum().item()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close("loss", loss, ref_loss, scale, torch.float32)
    assert_close("dlogprobs", dlogp, ref_dlogp, float(weights.abs().max()) * 10, torch.float32)
    if dent is not None:
        assert_close("dentropy", dent, ref_dent, float(weights.abs().max()), torch.float32)
    for name, want in ref_metrics.items():
        assert metrics[name].dim() == 0, name
        assert_close(name, metrics[name], want, abs(float(want)) + scale, torch.float32)
    off = ~batch["action_mask"]
    assert (dlogp[off] == 0).all() and (dent is None or (dent[off] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_ppo_loss_dtypes(dtype):
    batch = make_batch(LENGTHS, 4, dtype=dtype)
    loss, _, dlogp, dent = run_ppo(batch, "seq-mean-token-mean", "all")
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert dlogp.dtype == dtype and dent.dtype == dtype
    weights = reference_weights("seq-mean-token-mean", batch)
    ref_loss, _, ref_dlogp, _ = reference_ppo(batch, weights, "all")  # on the rounded inputs
    assert_close("loss", loss, ref_loss, 1.0, dtype)
    # the gradient is rounded to the input dtype at the end
    eps = torch.finfo(dtype).eps
    error = (dlogp.double() - ref_dlogp).abs().max().item()
    assert error <= 2 * eps * ref_dlogp.abs().max().item() + 1e-7


def test_ppo_loss_token_weights_equal_mode_weights():
    batch = make_batch(LENGTHS, 5)
    for mode in LOSS_AGG_MODES:
        w = loss_weights(mode, batch["action_mask"], batch["cu_seqlens"], batch["rollout_ids"], NORM)
        a = run_ppo(batch, mode, "all")
        b = run_ppo(batch, features="all", token_weights=w)
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-9)


def test_masked_tokens_get_exactly_zero_gradient_even_with_nan_there():
    batch = make_batch(LENGTHS, 6)
    off = ~batch["action_mask"]
    for key in ("logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy",
                "rollout_logprobs"):
        batch[key] = batch[key].masked_fill(off, float("nan"))
    loss, metrics, dlogp, dent = run_ppo(batch, "seq-mean-token-mean", "all")
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert (dlogp[off] == 0).all() and (dent[off] == 0).all()
    assert torch.isfinite(dlogp).all() and (dlogp[~off] != 0).any()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_sequences_and_batches_give_no_nan(mode):
    batch = make_batch(LENGTHS, 7, masked_sequences=tuple(range(len(LENGTHS) - 1)))
    loss, metrics, dlogp, dent = run_ppo(batch, mode, "all")
    assert torch.isfinite(loss) and torch.isfinite(dlogp).all() and torch.isfinite(dent).all()
    batch["action_mask"][:] = False
    loss, metrics, dlogp, dent = run_ppo(batch, mode, "all")
    assert float(loss) == 0 and (dlogp == 0).all() and (dent == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert float(metrics["action_tokens"]) == 0


def test_empty_batch():
    batch = make_batch([0, 0], 8)
    loss, metrics, dlogp, _ = run_ppo(batch, "seq-mean-token-mean", "kl_k3")
    assert float(loss) == 0 and dlogp.shape == (0,)


def test_clip_and_dual_clip_semantics():
    # ratio 2 with A > 0: clipped at 1.2 (no gradient); ratio 0.5 with A < 0: clipped at 0.8;
    # ratio 5 with A < 0 and dual clip 3: loss -A * 3 (no gradient)
    logp = torch.log(torch.tensor([2.0, 0.5, 5.0, 1.1])).requires_grad_()
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, dtype=torch.bool)
    loss, metrics = ppo_loss(logp, old, adv, mask, loss_agg_mode="token-sum", dual_clip=3.0,
                             backend=BACKEND)
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(loss.detach()) == pytest.approx(-1.2 + 0.8 + 3.0 - 1.1)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 0.0, -1.1])
    assert float(metrics["pg_clipfrac_upper"]) == 0.25
    assert float(metrics["pg_clipfrac_lower"]) == 0.25
    assert float(metrics["pg_clipfrac_dual"]) == 0.25
    assert float(metrics["ratio_max"]) == pytest.approx(5.0)


def test_k3_is_clamped_to_ten():
    logp = torch.tensor([-30.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, -1.0])
    loss, metrics = ppo_loss(logp, logp.detach(), torch.zeros(2), torch.ones(2, dtype=torch.bool),
                             loss_agg_mode="token-sum", ref_logprobs=ref, kl_coef=1.0,
                             backend=BACKEND)
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(loss.detach()) == pytest.approx(10.0) and grad.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Micro-batches


def _splits(num_tokens, seed, parts):
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, num_tokens + 1, (parts - 1,), generator=gen).tolist())
    return list(zip([0] + cuts, cuts + [num_tokens]))


def _slice(batch, start, end):
    return {k: (v[start:end] if k not in ("cu_seqlens", "rollout_ids") else v)
            for k, v in batch.items()}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("features", ["plain", "all"])
def test_micro_batches_with_sliced_weights_accumulate_to_full_batch(mode, features):
    """Cut anywhere (through sequences, a rollout's sub-traces in different micro-batches):
    per-token gradients are exactly those of the full batch, losses sum to its loss."""
    batch = make_batch(LENGTHS, 9, masked_sequences=(5,), num_rollouts=3)
    num_tokens = batch["action_mask"].numel()
    w = loss_weights(mode, batch["action_mask"], batch["cu_seqlens"], batch["rollout_ids"], NORM)
    full_loss, _, full_dlogp, full_dent = run_ppo(batch, features=features, token_weights=w)
    mode_loss, _, mode_dlogp, _ = run_ppo(batch, mode, features)
    torch.testing.assert_close(full_loss, mode_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(full_dlogp, mode_dlogp, rtol=1e-5, atol=1e-9)
    for seed, parts in ((0, 2), (1, 5), (2, 11)):
        total, dlogps, dents = 0.0, [], []
        for start, end in _splits(num_tokens, seed, parts):
            part = _slice(batch, start, end)
            loss, _, dlogp, dent = run_ppo(part, features=features, token_weights=w[start:end])
            total += float(loss)
            dlogps.append(dlogp)
            dents.append(dent)
        assert torch.equal(torch.cat(dlogps), full_dlogp)
        if full_dent is not None:
            assert torch.equal(torch.cat(dents), full_dent)
        assert total == pytest.approx(float(full_loss), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_counts_at_sequence_boundaries(mode):
    """Cut at sequence boundaries (rollout-mean: at rollout boundaries) and pass the global
    counts: each micro-batch computes the full batch's weights itself."""
    lengths = LENGTHS
    batch = make_batch(lengths, 10, masked_sequences=(2,), num_rollouts=len(lengths))
    # contiguous rollouts of 1-3 sub-traces
    batch["rollout_ids"] = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6])
    mask, cu = batch["action_mask"], batch["cu_seqlens"]
    w = loss_weights(mode, mask, cu, batch["rollout_ids"], NORM)
    full_loss, _, full_dlogp, _ = run_ppo(batch, features="all", token_weights=w)
    if mode == "rollout-mean":
        groups = [(0, 2), (2, 3), (3, 6), (6, 7), (7, 9), (9, 10), (10, 12)]
        counted = [int(mask[cu[a]:cu[b]].any()) for a, b in groups]
    else:
        groups = [(0, 3), (3, 4), (4, 9), (9, 12)]
        counted = [int(mask[cu[b]:cu[b + 1]].any()) for b in range(len(lengths))]
    global_sequences, global_tokens = sum(counted), int(mask.sum())
    parts = [(0, 2), (2, 3), (3, 6), (6, 7)] if mode == "rollout-mean" else [(0, 1), (1, 2), (2, 4)]
    total, dlogps = 0.0, []
    for a, b in parts:
        first, last = groups[a][0], groups[b - 1][1]
        start, end = int(cu[first]), int(cu[last])
        part = _slice(batch, start, end)
        part["cu_seqlens"] = cu[first:last + 1] - cu[first]
        part["rollout_ids"] = batch["rollout_ids"][first:last]
        loss, _, dlogp, _ = run_ppo(part, mode, "all", global_tokens=global_tokens,
                                    global_sequences=global_sequences)
        total += float(loss)
        dlogps.append(dlogp)
    torch.testing.assert_close(torch.cat(dlogps), full_dlogp, rtol=1e-6, atol=1e-9)
    assert total == pytest.approx(float(full_loss), rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Value loss


def run_value(batch, mode=None, clip=None, token_weights=None, backend=BACKEND, **extra):
    values = batch["values"].clone().requires_grad_()
    kw = {} if token_weights is not None else mode_kwargs(mode, batch)
    kw.update(extra)
    loss, metrics = value_loss(values, batch["old_values"], batch["returns"], batch["action_mask"],
                               clip=clip, token_weights=token_weights, backend=backend, **kw)
    (grad,) = torch.autograd.grad(loss, values)
    return loss.detach(), metrics, grad


def check_value_loss(mode, clip, backend=BACKEND):
    """value_loss against the float64 reference: loss, gradient, metrics, zero gradient on
    non-action tokens. Shared with the Triton interpreter tests; returns the metrics."""
    batch = make_batch(LENGTHS, 11, masked_sequences=(0,))
    loss, metrics, grad = run_value(batch, mode, clip, backend=backend)
    weights = reference_weights(mode, batch)
    values = batch["values"].double().requires_grad_()
    ref_loss, ref_metrics = value_loss_reference(values, batch["old_values"], batch["returns"],
                                                 batch["action_mask"], weights=weights, clip=clip)
    (ref_grad,) = torch.autograd.grad(ref_loss, values)
    assert_close("loss", loss, ref_loss.detach(), float(ref_loss.detach().abs()) + 1, torch.float32)
    assert_close("dvalues", grad, ref_grad, float(weights.max()) * 10, torch.float32)
    for name, want in ref_metrics.items():
        assert_close(name, metrics[name], want, abs(float(want)), torch.float32)
    assert (grad[~batch["action_mask"]] == 0).all()
    return metrics


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_reference(mode, clip):
    metrics = check_value_loss(mode, clip)
    if clip is not None:
        assert 0 < float(metrics["vf_clipfrac"]) < 1


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_micro_batches_and_masked_sequences(mode):
    batch = make_batch(LENGTHS, 12, masked_sequences=tuple(range(6)), num_rollouts=2)
    off = ~batch["action_mask"]
    batch["values"] = batch["values"].masked_fill(off, float("nan"))
    w = loss_weights(mode, batch["action_mask"], batch["cu_seqlens"], batch["rollout_ids"], NORM)
    full_loss, _, full_grad = run_value(batch, clip=0.2, token_weights=w)
    assert torch.isfinite(full_loss) and (full_grad[off] == 0).all()
    total, grads = 0.0, []
    for start, end in _splits(batch["action_mask"].numel(), 3, 4):
        loss, _, grad = run_value(_slice(batch, start, end), clip=0.2, token_weights=w[start:end])
        total += float(loss)
        grads.append(grad)
    assert torch.equal(torch.cat(grads), full_grad)
    assert total == pytest.approx(float(full_loss), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# The Triton path against the torch path and float64, on any device: CUDA here (gpu marker, run
# by bench/gpu_suite.sh); the CPU under the interpreter (tests/interpret/test_ppo_loss.py runs
# every case, so these bodies run without a GPU too).

# Together, every flag the kernels specialise on: the forward's HAS_WEIGHTS (weights from the
# mode), HAS_DUAL, KL (none, k1, k2, k3), HAS_ENTROPY, HAS_ROLLOUT, NEED_GRAD_LOGP and
# NEED_GRAD_ENTROPY, the finalize's TOKEN_MEAN with and without a count override.
# name -> (mode, features, extra ppo_loss arguments, gradients: "both", "logprobs" or "none")
TRITON_CASES = {
    "token-mean": ("token-mean", "plain", {}, "both"),
    "token-sum-dual-clip": ("token-sum", "dual_clip", {}, "both"),
    "seq-mean-token-mean-k1": ("seq-mean-token-mean", "kl_k1", {}, "both"),
    "rollout-mean-k2-asymmetric": ("rollout-mean", "kl_k2", {"clip_low": 0.1, "clip_high": 0.28},
                                   "both"),
    "seq-mean-token-sum-all": ("seq-mean-token-sum", "all", {}, "both"),
    "global-tokens-frozen-entropy": ("token-mean", "all", {"global_tokens": 500}, "logprobs"),
    "no-grad": ("seq-mean-token-sum-norm", "all", {}, "none"),
}
# name -> (mode, clip, gradient): HAS_WEIGHTS, HAS_CLIP, NEED_GRAD and TOKEN_MEAN
VALUE_CASES = {
    "token-mean": ("token-mean", None, True),
    "seq-mean-token-mean-clip": ("seq-mean-token-mean", 0.2, True),
    "token-sum-clip-no-grad": ("token-sum", 0.2, False),
}
TRITON_DTYPES = [torch.float32, torch.bfloat16]


def on_device(batch, device, dtype=None):
    """The batch on ``device``; with ``dtype``, its float tensors cast to it."""
    return {k: v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device)
            for k, v in batch.items()}


PPO_INPUTS = ("logprobs", "old_logprobs", "advantages")
VALUE_INPUTS = ("values", "old_values", "returns")


def loss_only(fn, inputs, batch, backend, **kw):
    """``fn``'s ``(loss, metrics)`` with nothing requiring grad (the kernels' NEED_GRAD_* off)."""
    return fn(*(batch[name] for name in inputs), batch["action_mask"], backend=backend, **kw)


def assert_gradient_close(name, got, want, weight_scale, dtype):
    """float32: accumulation error only; bfloat16/float16: the gradient is rounded to the input
    dtype at the end (one rounding, or two ulps apart between two paths)."""
    assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if dtype == torch.float32:
        assert_close(name, got, want, weight_scale * 10, dtype)
        return
    error = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    allowed = 2 * torch.finfo(dtype).eps * want.double().abs().max().item() + 1e-7
    assert error <= allowed, f"{name}: max error {error:.3g} > {allowed:.3g}"


def compare_losses(ours, wants, scale):
    """``ours = (loss, metrics)`` against each of ``wants``: within float32 accumulation error."""
    loss, metrics = ours
    assert loss.dtype == torch.float32 and loss.dim() == 0
    for want_loss, want_metrics in wants:
        assert_close("loss", loss, want_loss, scale, torch.float32)
        for name, got in metrics.items():  # (the torch path's also holds "loss")
            assert got.dim() == 0, name
            want = want_metrics[name]
            assert_close(name, got, want, abs(float(want)) + scale, torch.float32)


def check_triton_ppo_case(case, dtype, device):
    """The Triton path against the torch path on the same inputs and device, and against
    float64 (the torch path on the inputs cast exactly to float64 on the device, which the
    tests above check against reference.py): loss, metrics, gradients in the input dtype,
    exactly zero gradient off actions."""
    mode, features, extra, grads = TRITON_CASES[case]
    batch = on_device(make_batch(LENGTHS, 3, dtype=dtype, masked_sequences=(4,)), device)
    exact = on_device(batch, device, torch.float64)
    mask = batch["action_mask"]
    weights = loss_weights(mode, mask, batch["cu_seqlens"], batch["rollout_ids"], NORM,
                           global_tokens=extra.get("global_tokens"))
    weight_scale = float(weights.abs().max())
    scale = weight_scale * int(mask.sum())
    if grads == "none":
        runs = [loss_only(ppo_loss, PPO_INPUTS, b, backend, **feature_kwargs(features, b),
                          **mode_kwargs(mode, b), **extra)
                for b, backend in ((batch, "triton"), (batch, "torch"), (exact, "torch"))]
        compare_losses(runs[0], runs[1:], scale)
        return
    entropy_grad = grads == "both"
    ours, torch_path, reference = (
        run_ppo(b, mode, features, backend=backend, entropy_grad=entropy_grad, **extra)
        for b, backend in ((batch, "triton"), (batch, "torch"), (exact, "torch")))
    compare_losses((ours[0], ours[1]), [(torch_path[0], torch_path[1]),
                                        (reference[0], reference[1])], scale)
    off = ~mask
    for other in (torch_path, reference):
        assert_gradient_close("dlogprobs", ours[2], other[2], weight_scale, dtype)
        assert (ours[2][off] == 0).all()
        if entropy_grad and "entropy_coef" in FEATURES[features]:
            assert_gradient_close("dentropy", ours[3], other[3], weight_scale, dtype)
            assert (ours[3][off] == 0).all()
        else:
            assert ours[3] is None


def check_triton_value_case(case, dtype, device):
    """value_loss: the Triton path against the torch path and float64, as above."""
    mode, clip, grad = VALUE_CASES[case]
    batch = on_device(make_batch(LENGTHS, 11, dtype=dtype, masked_sequences=(0,)), device)
    exact = on_device(batch, device, torch.float64)
    mask = batch["action_mask"]
    weights = loss_weights(mode, mask, batch["cu_seqlens"], batch["rollout_ids"], NORM)
    scale = float(weights.abs().max()) * int(mask.sum()) * 10  # squared errors of N(0, 1)s
    if not grad:
        runs = [loss_only(value_loss, VALUE_INPUTS, b, backend, clip=clip, **mode_kwargs(mode, b))
                for b, backend in ((batch, "triton"), (batch, "torch"), (exact, "torch"))]
        compare_losses(runs[0], runs[1:], scale)
        return
    ours, torch_path, reference = (run_value(b, mode, clip, backend=backend)
                                   for b, backend in ((batch, "triton"), (batch, "torch"),
                                                      (exact, "torch")))
    compare_losses((ours[0], ours[1]), [(torch_path[0], torch_path[1]),
                                        (reference[0], reference[1])], scale)
    for other in (torch_path, reference):
        assert_gradient_close("dvalues", ours[2], other[2], float(weights.abs().max()), dtype)
    assert (ours[2][~mask] == 0).all()


def check_triton_masked_and_empty(dtype, device):
    """NaN on non-action tokens and fully masked sequences, a fully masked batch and an empty
    one through the Triton path: finite results, exactly zero gradient off actions, the torch
    path's values."""
    batch = on_device(make_batch(LENGTHS, 6, dtype=dtype, masked_sequences=(1, 2, 3)), device)
    off = ~batch["action_mask"]
    for key in ("logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy",
                "rollout_logprobs", "values", "old_values", "returns"):
        batch[key] = batch[key].masked_fill(off, float("nan"))
    loss, metrics, dlogp, dent = run_ppo(batch, "rollout-mean", "all", backend="triton")
    want = run_ppo(batch, "rollout-mean", "all", backend="torch")
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert (dlogp[off] == 0).all() and (dent[off] == 0).all() and torch.isfinite(dlogp).all()
    assert_close("loss", loss, want[0], 1.0, torch.float32)
    value = run_value(batch, "seq-mean-token-mean", 0.2, backend="triton")
    assert torch.isfinite(value[0]) and (value[2][off] == 0).all()
    assert torch.isfinite(value[2]).all()
    batch["action_mask"] = torch.zeros_like(batch["action_mask"])
    empty = on_device(make_batch([0, 0], 8, dtype=dtype), device)
    for b in (batch, empty):
        for mode in LOSS_AGG_MODES:
            loss, metrics, dlogp, dent = run_ppo(b, mode, "all", backend="triton")
            assert float(loss) == 0 and (dlogp == 0).all() and (dent == 0).all()
            assert dlogp.shape == b["logprobs"].shape
            assert all(torch.isfinite(v) for v in metrics.values())
            assert float(metrics["action_tokens"]) == 0
            value = run_value(b, mode, 0.2, backend="triton")
            assert float(value[0]) == 0 and (value[2] == 0).all()
            assert all(torch.isfinite(v) for v in value[1].values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_cuda_triton_ppo_loss_matches_torch_path_and_float64(case, dtype):
    check_triton_ppo_case(case, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_cuda_triton_value_loss_matches_torch_path_and_float64(case, dtype):
    check_triton_value_case(case, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
def test_cuda_triton_masked_and_empty(dtype):
    check_triton_masked_and_empty(dtype, "cuda")


@pytest.mark.gpu
def test_cuda_auto_takes_triton_and_float64_takes_torch():
    """On CUDA, auto runs the Triton kernels for float32 and the torch path, in float64, for
    float64 (the kernels compute in float32); backend="triton" refuses float64."""
    batch = on_device(make_batch(LENGTHS, 16), "cuda")
    for b, backend in ((batch, "triton"), (on_device(batch, "cuda", torch.float64), "torch")):
        auto = run_ppo(b, "seq-mean-token-mean", "all", backend="auto")
        chosen = run_ppo(b, "seq-mean-token-mean", "all", backend=backend)
        assert auto[0].dtype == b["logprobs"].dtype
        for a, c in zip(auto[:1] + auto[2:], chosen[:1] + chosen[2:]):
            assert torch.equal(a, c)
        value_auto = run_value(b, "token-mean", 0.2, backend="auto")
        value_chosen = run_value(b, "token-mean", 0.2, backend=backend)
        assert torch.equal(value_auto[0], value_chosen[0])
        assert torch.equal(value_auto[2], value_chosen[2])
    exact = on_device(batch, "cuda", torch.float64)
    with pytest.raises(ValueError, match="logprobs is float64, but backend 'triton'"):
        run_ppo(exact, "token-mean", "plain", backend="triton")
    with pytest.raises(ValueError, match="values is float64, but backend 'triton'"):
        run_value(exact, "token-mean", backend="triton")


# ---------------------------------------------------------------------------------------------
# Bad arguments (child process)

PRELUDE = textwrap.dedent("""
    import torch
    from agentrl_fast.ops.ppo_loss import loss_weights, ppo_loss, value_loss
    T = 6
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    mask = torch.tensor([False, True, False, True, True, True])
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.3, -2.0, -0.1])
    old = lp - 0.1
    adv = torch.tensor([0.0, 1.0, 0.0, -0.5, 0.2, 1.0])
    ids = torch.tensor([0, 0])
""")

CASES = {
    "valid_baseline": ("NoError", "", "ppo_loss(lp, old, adv, mask); value_loss(lp, old, adv, mask, clip=0.2); "
                       "loss_weights('rollout-mean', mask, cu, ids)"),
    "unknown_mode": ("ValueError", "loss_agg_mode must be one of token-mean, token-sum, seq-mean-token-sum",
                     "ppo_loss(lp, old, adv, mask, loss_agg_mode='seq-mean')"),
    "unknown_mode_weights": ("ValueError", "seq-mean-token-sum-norm, rollout-mean; got 'mean'",
                             "loss_weights('mean', mask, cu)"),
    "norm_without_constant": ("ValueError", "needs norm_constant",
                              "ppo_loss(lp, old, adv, mask, cu_seqlens=cu, loss_agg_mode='seq-mean-token-sum-norm')"),
    "norm_constant_zero": ("ValueError", "norm_constant must be > 0",
                           "loss_weights('seq-mean-token-sum-norm', mask, cu, norm_constant=0)"),
    "rollout_without_ids": ("ValueError", "needs rollout_ids",
                            "ppo_loss(lp, old, adv, mask, cu_seqlens=cu, loss_agg_mode='rollout-mean')"),
    "rollout_without_cu": ("ValueError", "'rollout-mean' needs cu_seqlens",
                           "loss_weights('rollout-mean', mask, rollout_ids=ids)"),
    "seq_mode_without_cu": ("ValueError", "'seq-mean-token-mean' needs cu_seqlens",
                            "value_loss(lp, old, adv, mask, loss_agg_mode='seq-mean-token-mean')"),
    "rollout_ids_float": ("TypeError", "rollout_ids must be an integer tensor",
                          "loss_weights('rollout-mean', mask, cu, ids.float())"),
    "rollout_ids_wrong_length": ("ValueError", "rollout_ids must be [B] with B = cu_seqlens.shape[0] - 1 = 2",
                                 "loss_weights('rollout-mean', mask, cu, torch.tensor([0, 1, 2]))"),
    "cu_int64": ("TypeError", "cu_seqlens must be torch.int32",
                 "loss_weights('seq-mean-token-mean', mask, cu.long())"),
    "cu_bad_last": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = 6, got 5",
                    "ppo_loss(lp, old, adv, mask, cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), "
                    "loss_agg_mode='seq-mean-token-mean')"),
    "mask_not_bool": ("TypeError", "action_mask must be bool", "ppo_loss(lp, old, adv, mask.float())"),
    "mask_wrong_length": ("ValueError", "action_mask must be [T] with T = 6", "ppo_loss(lp, old, adv, mask[:5])"),
    "old_wrong_length": ("ValueError", "old_logprobs must be [T] with T = logprobs.shape[0] = 6",
                         "ppo_loss(lp, old[:4], adv, mask[:6])"),
    "adv_int": ("TypeError", "advantages must be float32, float64, float16 or bfloat16",
                "ppo_loss(lp, old, adv.long(), mask)"),
    "logprobs_2d": ("ValueError", "logprobs must be 1-D [T]", "ppo_loss(lp.view(2, 3), old, adv, mask)"),
    "logprobs_list": ("TypeError", "logprobs must be a torch.Tensor", "ppo_loss(lp.tolist(), old, adv, mask)"),
    "weights_wrong_length": ("ValueError", "token_weights must be [T] with T = logprobs.shape[0] = 6",
                             "ppo_loss(lp, old, adv, mask, token_weights=torch.ones(3))"),
    "clip_low_one": ("ValueError", "clip_low must be in [0, 1)", "ppo_loss(lp, old, adv, mask, clip_low=1.0)"),
    "clip_high_negative": ("ValueError", "clip_high must be >= 0", "ppo_loss(lp, old, adv, mask, clip_high=-0.1)"),
    "dual_clip_one": ("ValueError", "dual_clip must be None or a finite c > 1",
                      "ppo_loss(lp, old, adv, mask, dual_clip=1.0)"),
    "kl_estimator": ("ValueError", "kl_estimator must be one of k1, k2, k3, got 'k4'",
                     "ppo_loss(lp, old, adv, mask, ref_logprobs=old, kl_coef=0.1, kl_estimator='k4')"),
    "kl_without_ref": ("ValueError", "needs ref_logprobs", "ppo_loss(lp, old, adv, mask, kl_coef=0.1)"),
    "rollout_without_cap": ("ValueError", "rollout_logprobs needs tis_cap",
                            "ppo_loss(lp, old, adv, mask, rollout_logprobs=old)"),
    "tis_cap_zero": ("ValueError", "tis_cap must be > 0",
                     "ppo_loss(lp, old, adv, mask, rollout_logprobs=old, tis_cap=0)"),
    "global_tokens_zero": ("ValueError", "global_tokens must be > 0",
                           "ppo_loss(lp, old, adv, mask, global_tokens=0)"),
    "global_sequences_shape": ("ValueError", "global_sequences must be a number or a 0-d tensor",
                               "loss_weights('seq-mean-token-sum', mask, cu, global_sequences=torch.ones(2))"),
    "value_clip_zero": ("ValueError", "clip must be None or a finite value > 0",
                        "value_loss(lp, old, adv, mask, clip=0.0)"),
    "value_returns_short": ("ValueError", "returns must be [T] with T = values.shape[0] = 6",
                            "value_loss(lp, old, adv[:3], mask)"),
    "backend_unknown": ("ValueError", "backend must be one of auto, torch, triton",
                        "ppo_loss(lp, old, adv, mask, backend='cuda')"),
    "backend_triton_on_cpu": ("ValueError", "backend 'triton' needs CUDA tensors",
                              "ppo_loss(lp, old, adv, mask, backend='triton')"),
}


outcomes, test_bad_arguments = bad_input_tests(PRELUDE, CASES)
