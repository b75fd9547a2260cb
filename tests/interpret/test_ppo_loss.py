"""The Triton path of ppo_loss / value_loss (agentrl_fast/kernels/ppo_loss.py) under TRITON_INTERPRET=1:
the same checks as tests/test_ppo_loss.py (float64 references, every mode, gradients, masked
tokens, micro-batches), plus launchers writing every element of NaN-poisoned outputs, several
kernel programs and finalize row chunks, the registered ops' opcheck, float64 inputs going to
the torch path (the kernels compute in float32), and the bodies of test_ppo_loss.py's CUDA
tests on the CPU."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import sys

import agentrl_fast.ops.ppo_loss  # noqa: F401  (the module, not the function of that name)

module = sys.modules["agentrl_fast.ops.ppo_loss"]
from agentrl_fast.ops.ppo_loss import LOSS_AGG_MODES, loss_weights

assert os.environ.get("TRITON_INTERPRET") == "1"

# The helpers of tests/test_ppo_loss.py (same file name: loaded by path under another name).
_spec = importlib.util.spec_from_file_location(
    "ppo_loss_cpu_tests", Path(__file__).resolve().parent.parent / "test_ppo_loss.py")
_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cpu)
FEATURES, LENGTHS, assert_close, make_batch = _cpu.FEATURES, _cpu.LENGTHS, _cpu.assert_close, _cpu.make_batch
reference_ppo, reference_weights, run_ppo, run_value = (_cpu.reference_ppo, _cpu.reference_weights,
                                                        _cpu.run_ppo, _cpu.run_value)
_slice, _splits = _cpu._slice, _cpu._splits
BACKEND = "triton"


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_triton_ppo_loss_matches_reference(mode, features):
    batch = make_batch(LENGTHS, 3, masked_sequences=(4,))
    loss, metrics, dlogp, dent = run_ppo(batch, mode, features, backend=BACKEND)
    weights = reference_weights(mode, batch)
    ref_loss, ref_metrics, ref_dlogp, ref_dent = reference_ppo(batch, weights, features)
    scale = float(weights.abs().max()) * batch["action_mask"].sum().item()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close("loss", loss, ref_loss, scale, torch.float32)
    assert_close("dlogprobs", dlogp, ref_dlogp, float(weights.abs().max()) * 10, torch.float32)
    if dent is not None:
        assert_close("dentropy", dent, ref_dent, float(weights.abs().max()), torch.float32)
    for name, want in ref_metrics.items():
        assert_close(name, metrics[name], want, abs(float(want)) + scale, torch.float32)
    off = ~batch["action_mask"]
    assert (dlogp[off] == 0).all() and (dent is None or (dent[off] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_dtypes_match_torch_path(dtype):
    batch = make_batch(LENGTHS, 4, dtype=dtype)
    ours = run_ppo(batch, "seq-mean-token-mean", "all", backend=BACKEND)
    torch_path = run_ppo(batch, "seq-mean-token-mean", "all", backend="torch")
    assert ours[2].dtype == dtype and ours[3].dtype == dtype
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(ours[0].double(), torch_path[0].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[2].double(), torch_path[2].double(), rtol=tol, atol=1e-7)


def assert_float64_close(name, got, want):
    """Within 1e-12 of the float64 reference, relative to its magnitude (at least 1)."""
    got, want = got.detach().double(), want.detach().double()
    error = float((got - want).abs().max()) if want.numel() else 0.0
    allowed = 1e-12 * max(1.0, float(want.abs().max()) if want.numel() else 0.0)
    assert error <= allowed, f"{name}: max error {error:.3g} > {allowed:.3g}"


def test_float64_runs_in_float64_on_the_torch_path():
    """The kernels compute in float32: float64 logprobs / values take the torch path under
    auto (float64 throughout: ~1e-12 from the float64 reference); backend="triton" refuses
    them, naming the argument."""
    mode = "seq-mean-token-mean"
    batch = make_batch(LENGTHS, 4, dtype=torch.float64)
    auto = run_ppo(batch, mode, "all", backend="auto")
    torch_path = run_ppo(batch, mode, "all", backend="torch")
    weights = reference_weights(mode, batch)
    reference = reference_ppo(batch, weights, "all")
    for i, name in ((0, "loss"), (2, "dlogprobs"), (3, "dentropy")):
        assert auto[i].dtype == torch.float64 and torch.equal(auto[i], torch_path[i]), name
        assert_float64_close(name, auto[i], reference[i])
    for name, want in reference[1].items():
        assert_float64_close(name, auto[1][name], want)
    values = batch["values"].clone().requires_grad_()
    loss, _ = module.value_loss(values, batch["old_values"], batch["returns"],
                                batch["action_mask"], clip=0.2, cu_seqlens=batch["cu_seqlens"],
                                loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, values)
    values64 = batch["values"].clone().requires_grad_()
    ref_loss, _ = _cpu.value_loss_reference(values64, batch["old_values"], batch["returns"],
                                            batch["action_mask"], weights=weights, clip=0.2)
    (ref_grad,) = torch.autograd.grad(ref_loss, values64)
    assert loss.dtype == grad.dtype == torch.float64
    assert_float64_close("value loss", loss, ref_loss)
    assert_float64_close("dvalues", grad, ref_grad)
    with pytest.raises(ValueError, match="logprobs is float64, but backend 'triton' computes"):
        run_ppo(batch, mode, "all", backend=BACKEND)
    with pytest.raises(ValueError, match="values is float64, but backend 'triton' computes"):
        run_value(batch, mode, 0.2, backend=BACKEND)


# The bodies of the CUDA tests of tests/test_ppo_loss.py, on the CPU (each well under 0.1 s).

@pytest.mark.parametrize("dtype", _cpu.TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_cpu.TRITON_CASES))
def test_triton_case_against_torch_path_and_float64(case, dtype):
    _cpu.check_triton_ppo_case(case, dtype, "cpu")


@pytest.mark.parametrize("dtype", _cpu.TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_cpu.VALUE_CASES))
def test_triton_value_case_against_torch_path_and_float64(case, dtype):
    _cpu.check_triton_value_case(case, dtype, "cpu")


def test_triton_masked_nan_fully_masked_and_empty():
    _cpu.check_triton_masked_and_empty(torch.float32, "cpu")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_triton_micro_batches_accumulate_to_full_batch(mode):
    batch = make_batch(LENGTHS, 9, masked_sequences=(5,), num_rollouts=3)
    w = loss_weights(mode, batch["action_mask"], batch["cu_seqlens"], batch["rollout_ids"], 37.0)
    full_loss, _, full_dlogp, full_dent = run_ppo(batch, features="all", token_weights=w,
                                                  backend=BACKEND)
    total, dlogps, dents = 0.0, [], []
    for start, end in _splits(batch["action_mask"].numel(), 1, 5):
        loss, _, dlogp, dent = run_ppo(_slice(batch, start, end), features="all",
                                       token_weights=w[start:end], backend=BACKEND)
        total += float(loss)
        dlogps.append(dlogp)
        dents.append(dent)
    assert torch.equal(torch.cat(dlogps), full_dlogp) and torch.equal(torch.cat(dents), full_dent)
    assert total == pytest.approx(float(full_loss), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "rollout-mean"])
def test_triton_value_loss_matches_reference(mode, clip):
    _cpu.check_value_loss(mode, clip, backend=BACKEND)


def test_launchers_write_every_element_of_poisoned_outputs():
    """T spans several programs and the finalize's row loop runs more than one chunk."""
    from agentrl_fast.kernels import ppo_loss as kernels

    num_tokens = kernels.BLOCK * (kernels.FINALIZE_BLOCK + 2) - 5
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(num_tokens, generator=gen) < 0.7
    logp = -torch.rand(num_tokens, generator=gen)
    old = logp + 0.2 * torch.randn(num_tokens, generator=gen)
    adv = torch.randn(num_tokens, generator=gen)
    blocks = -(-num_tokens // kernels.BLOCK)
    nan = float("nan")
    dlogp = torch.full((num_tokens,), nan)
    partials = torch.full((blocks, kernels.NUM_COLUMNS), nan)
    metrics = torch.full((kernels.NUM_COLUMNS,), nan)
    module.launch_ppo_loss_forward(logp, old, adv, mask, None, None, None, None, 0.2, 0.2, 0.0,
                                   0.0, 0, 0.0, 1.0, True, 0.0, dlogp=dlogp, dentropy=None,
                                   partials=partials, metrics=metrics)
    assert torch.isfinite(dlogp).all() and torch.isfinite(partials).all()
    assert torch.isfinite(metrics).all()
    assert float(metrics[kernels.PPO_COUNT]) == int(mask.sum())
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    want = (pg * mask).double().sum() / mask.sum()
    assert float(metrics[0]) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    assert float(metrics[kernels.PPO_RATIO_MAX]) == pytest.approx(float(ratio[mask].max()), rel=1e-6)
    out = torch.full((num_tokens,), nan, dtype=torch.bfloat16)
    module.launch_scale_gradient(dlogp, torch.ones(1), metrics, out=out)
    assert torch.isfinite(out).all()
    dvalues = torch.full((num_tokens,), nan)
    partials.fill_(nan)
    metrics.fill_(nan)
    module.launch_value_loss_forward(logp, old, adv, mask, None, 0.2, False, 0.0, dvalues=dvalues,
                                     partials=partials, metrics=metrics)
    assert torch.isfinite(dvalues).all() and torch.isfinite(metrics).all()
    assert float(metrics[kernels.SCALE_COLUMN]) == 1.0


def test_registered_ops_pass_opcheck():
    batch = make_batch([30, 0, 17], 13)
    logp = batch["logprobs"].clone().requires_grad_()
    entropy = batch["entropy"].clone().requires_grad_()
    args = (logp, batch["old_logprobs"], batch["advantages"], batch["action_mask"], None,
            batch["ref_logprobs"], entropy, batch["rollout_logprobs"], 0.2, 0.28, 3.0, 0.1, 3,
            0.01, 2.0, True, 0.0, True, True)
    torch.library.opcheck(torch.ops.agentrl_fast.ppo_loss_forward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    values = batch["values"].clone().requires_grad_()
    torch.library.opcheck(torch.ops.agentrl_fast.value_loss_forward.default,
                          (values, batch["old_values"], batch["returns"], batch["action_mask"],
                           None, 0.2, True, 0.0, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compiles_into_one_graph():
    """torch.compile(fullgraph=True) traces the registered ops (aot_eager: no codegen needed)."""
    batch = make_batch([30, 0, 17], 14)

    def step(logp, entropy):
        loss, metrics = module.ppo_loss(logp, batch["old_logprobs"], batch["advantages"],
                                        batch["action_mask"], cu_seqlens=batch["cu_seqlens"],
                                        loss_agg_mode="seq-mean-token-mean", dual_clip=3.0,
                                        ref_logprobs=batch["ref_logprobs"], kl_coef=0.1,
                                        entropy=entropy, entropy_coef=0.01, validate=False)
        vloss, _ = module.value_loss(logp, batch["old_values"], batch["returns"],
                                     batch["action_mask"], clip=0.2)
        return loss + vloss, metrics["pg_clipfrac_upper"]

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (step, compiled):
        logp = batch["logprobs"].clone().requires_grad_()
        entropy = batch["entropy"].clone().requires_grad_()
        loss, _ = fn(logp, entropy)
        grads.append((loss.detach(), *torch.autograd.grad(loss, (logp, entropy))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_triton_global_counts_match_torch_path(mode):
    batch = make_batch(LENGTHS, 15, masked_sequences=(2,))
    counts = {"global_tokens": 500, "global_sequences": 9}
    ours = run_ppo(batch, mode, "all", backend=BACKEND, **counts)
    torch_path = run_ppo(batch, mode, "all", backend="torch", **counts)
    torch.testing.assert_close(ours[0], torch_path[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours[2], torch_path[2], rtol=1e-5, atol=1e-9)
    value = run_value(batch, mode, 0.2, backend=BACKEND, **counts)
    value_torch = run_value(batch, mode, 0.2, backend="torch", **counts)
    torch.testing.assert_close(value[0], value_torch[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(value[2], value_torch[2], rtol=1e-5, atol=1e-9)
