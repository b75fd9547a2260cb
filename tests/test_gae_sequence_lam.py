"""GAE with one lambda per sequence (``gae(..., lam=tensor[B])``) and the length-adaptive lambda
(``adaptive_lam``), against a hand computation, the float64 reference, and the scalar op called
once per sequence; the CUDA kernel against the CPU one (``-m gpu``)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_fast import _native
from agentrl_fast.ops import adaptive_lam, gae
from agentrl_fast.ops.reference import gae_reference

CPU_CHUNK = 1 << 15  # kCpuChunk in csrc/gae.cpp


def _lams(num_sequences: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Random lambdas with the endpoints 0 and 1 among them."""
    gen = torch.Generator().manual_seed(seed)
    lam = torch.rand(num_sequences, generator=gen, dtype=torch.float64)
    lam[::4] = 1.0
    lam[1::5] = 0.0
    return lam.to(dtype)


def _count(batch) -> int:
    return batch.cu_seqlens.numel() - 1


def _run(batch, gamma, lam, **kwargs):
    return gae(batch.rewards, batch.values, batch.cu_seqlens, **batch.kwargs(), gamma=gamma,
               lam=lam, **kwargs)


def _reference(batch, gamma, lam):
    return gae_reference(batch.rewards, batch.values, batch.cu_seqlens, batch.action_mask,
                         batch.bootstrap_values, gamma, lam)


def test_hand_computed_sub_traces():
    """Two rollouts packed as three sub-traces: rollout A compacted once (sub-trace 0 bootstraps
    from V at sub-trace 1's first action token, as the trainer chains them), rollout B whole.
    Each rollout's lambda is its length-adaptive one; every number is a short dyadic fraction,
    exact in float32."""
    gamma = 1.0
    # sub-trace 0 (A): prompt, action, action, observation, action
    # sub-trace 1 (A): prompt, action, action (terminal)
    # sub-trace 2 (B): prompt, action, observation, action (terminal)
    mask = torch.tensor([False, True, True, False, True, False, True, True,
                         False, True, False, True])
    rewards = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1.0, 0, 0, 0, 0.5])
    values = torch.tensor([9, 0.5, 0.25, 7, 0.75, 9, 0.5, 0.25, 9, 0.125, 3, 0.375])
    cu_seqlens = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    bootstrap = torch.tensor([0.5, 0.0, 0.0])  # V at sub-trace 1's first action token
    # A has 5 action tokens, B 2: alpha = 0.4 gives lambda 1 - 1/2 = 0.5 and 1 - 1/0.8 < 0 -> 0.
    lam = adaptive_lam(torch.tensor([5, 5, 2]), alpha=0.4)
    assert lam.tolist() == [0.5, 0.5, 0.0]
    # sub-trace 1: a7 = 1 - 0.25 = 0.75; a6 = 0 + 0.25 - 0.5 + 0.5 * 0.75 = 0.125
    a7, a6 = 0.75, 0.125
    # sub-trace 0: a4 = 0 + 0.5 - 0.75 = -0.25; a2 = 0.75 - 0.25 + 0.5 * a4; a1 likewise
    a4 = -0.25
    a2 = 0.75 - 0.25 + 0.5 * a4
    a1 = 0.25 - 0.5 + 0.5 * a2
    # sub-trace 2 (lambda 0: one-step TD): a11 = 0.5 - 0.375; a9 = 0.375 - 0.125
    a11, a9 = 0.125, 0.25
    want = torch.tensor([0, a1, a2, 0, a4, 0, a6, a7, 0, a9, 0, a11])
    adv, ret = gae(rewards, values, cu_seqlens, action_mask=mask, bootstrap_values=bootstrap,
                   gamma=gamma, lam=lam)
    assert torch.equal(adv, want), adv
    assert torch.equal(ret, torch.where(mask, want + values, torch.zeros(()))), ret
    ref_adv, _ = gae_reference(rewards, values, cu_seqlens, mask, bootstrap, gamma, lam)
    assert torch.equal(ref_adv.float(), want)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), gamma=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**31 - 1))
def test_matches_reference(packed_batch, assert_gae_close, data, gamma, dtype, seed):
    batch = packed_batch(data.draw).cast(dtype, dtype)
    lam = _lams(_count(batch), seed, dtype)
    advantages, returns = _run(batch, gamma, lam)
    assert advantages.dtype == returns.dtype == dtype
    assert_gae_close(advantages, returns, _reference(batch, gamma, lam), batch)


@pytest.mark.parametrize("lam_dtype", [torch.float32, torch.float64, torch.float16,
                                       torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_one_call_equals_a_call_per_sequence(packed_batch, dtype, lam_dtype):
    """Per-sequence lambdas in one call give exactly what the scalar op gives sequence by
    sequence (the lambda rounded to its dtype first); empty and length-1 sequences included."""
    batch = packed_batch(3, [0, 1, 7, 113, 0, 1, 203, 2], mask_styles="agentic",
                         reward_style="dense").cast(dtype, dtype)
    lam = _lams(_count(batch), 4, lam_dtype)
    advantages, returns = _run(batch, 0.97, lam)
    cu = batch.cu_seqlens.tolist()
    for b in range(_count(batch)):
        part = slice(cu[b], cu[b + 1])
        one = gae(batch.rewards[part], batch.values[part],
                  torch.tensor([0, cu[b + 1] - cu[b]], dtype=torch.int32),
                  action_mask=None if batch.action_mask is None else batch.action_mask[part],
                  bootstrap_values=(None if batch.bootstrap_values is None
                                    else batch.bootstrap_values[b:b + 1]), gamma=0.97,
                  lam=float(lam[b]))
        assert torch.equal(advantages[part], one[0]) and torch.equal(returns[part], one[1]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_long_sequences_chunked_scan(packed_batch, assert_gae_close, dtype):
    """Sequences longer than the CPU kernel's chunk take its parallel scan, each chunk with its
    sequence's lambda."""
    batch = packed_batch(11, [3, CPU_CHUNK + 1, 1, 2 * CPU_CHUNK + 5, 4], mask_styles="agentic",
                         reward_style="dense").cast(dtype, dtype)
    lam = torch.tensor([0.5, 0.9, 1.0, 0.3, 0.0], dtype=torch.float64)
    advantages, returns = _run(batch, 0.99, lam)
    assert_gae_close(advantages, returns, _reference(batch, 0.99, lam), batch)


def test_gae_out_overwrites_poisoned_outputs(packed_batch, assert_gae_close):
    batch = packed_batch(5, [4, 0, 1, 37, 9], mask_styles="agentic", reward_style="dense")
    lam = _lams(_count(batch), 6)
    advantages = torch.full((batch.num_tokens,), math.nan, dtype=torch.float64)
    returns = torch.full_like(advantages, math.nan)
    torch.ops.agentrl_fast.gae_out(batch.rewards, batch.values, batch.cu_seqlens,
                                   batch.action_mask, batch.bootstrap_values, 0.95, 1.0, True,
                                   advantages, returns, lam)
    assert_gae_close(advantages, returns, _reference(batch, 0.95, lam), batch)


def test_torch_compile_and_opcheck(packed_batch):
    batch = packed_batch(7, [5, 1, 9], mask_styles="agentic", reward_style="dense")
    lam = _lams(_count(batch), 8)
    torch.library.opcheck(torch.ops.agentrl_fast.gae.default,
                          (batch.rewards, batch.values, batch.cu_seqlens, batch.action_mask,
                           batch.bootstrap_values, 0.9, 1.0, True, lam))
    compiled = torch.compile(lambda r, v, lam: gae(r, v, batch.cu_seqlens, **batch.kwargs(),
                                                   gamma=0.9, lam=lam), fullgraph=True)
    got = compiled(batch.rewards, batch.values, lam)
    want = _run(batch, 0.9, lam)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("lam,error,match", [
    (torch.tensor([0.5, 0.5]), ValueError, r"lam must be 1-D \[B\] with B = .* = 3, got shape \[2\]"),
    (torch.full((3, 1), 0.5), ValueError, r"lam must be 1-D \[B\]"),
    (torch.tensor([1, 0, 1]), TypeError, r"lam must be float32, float64, float16 or bfloat16, got torch.int64"),
    (torch.tensor([0.5, 1.5, 0.5]), ValueError, r"lam must be in \[0, 1\] for every sequence, got 1.5 at sequence 1"),
    (torch.tensor([0.5, 0.5, math.nan]), ValueError, r"got nan at sequence 2"),
    (torch.tensor([-0.25, 0.5, 0.5]), ValueError, r"got -0.25 at sequence 0"),
])
def test_bad_lam_tensors(lam, error, match):
    r, v = torch.zeros(6), torch.zeros(6)
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    with pytest.raises(error, match=match):
        gae(r, v, cu, lam=lam)


def test_unvalidated_out_of_range_lam_runs():
    """``validate=False`` skips the value checks (no host sync); nothing is read out of bounds."""
    r, v = torch.zeros(6), torch.ones(6)
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    advantages, _ = gae(r, v, cu, lam=torch.tensor([2.0, 0.5, 0.5]), validate=False)
    assert advantages.shape == (6,)


def test_adaptive_lam():
    lengths = torch.tensor([0, 1, 10, 20, 100, 1000])
    assert adaptive_lam(lengths, 0.05).tolist() == pytest.approx(
        [0.0, 0.0, 0.0, 0.0, 0.8, 0.98])
    assert adaptive_lam(lengths, 1.5).tolist() == pytest.approx(
        [0.0, 1 - 1 / 1.5, 1 - 1 / 15, 1 - 1 / 30, 1 - 1 / 150, 1 - 1 / 1500])
    assert adaptive_lam(lengths.float(), 1.5).dtype == torch.float64
    with pytest.raises(ValueError, match="alpha must be > 0, got 0"):
        adaptive_lam(lengths, 0.0)
    with pytest.raises(ValueError, match=r"lengths must be 1-D \[B\]"):
        adaptive_lam(lengths[None], 1.0)


@pytest.mark.gpu
def test_cuda_matches_cpu(packed_batch, assert_gae_close):
    assert _native.cuda_built, "a CUDA device is visible but agentrl_fast was built without CUDA"
    # Short sequences many per tile, and one long one that chains tiles through the look-back.
    for lengths in ([0, 1, 7, 113, 0, 1, 203, 1023, 2, 1] * 30, [5, 1, 300_017, 0, 2, 7]):
        base = packed_batch(21, lengths, mask_styles="agentic", reward_style="dense")
        lam = _lams(_count(base), 22)
        chain_steps = math.ceil(base.max_seqlen / (256 * 8)) + 2
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            cpu = base.cast(dtype, dtype)
            reference = _run(cpu.cast(torch.float64, torch.float64, torch.float64), 0.99, lam)
            dev = cpu.cast(device="cuda")
            for validate in (True, False):
                got = _run(dev, 0.99, lam.cuda(), validate=validate)
                assert_gae_close(got[0].cpu(), got[1].cpu(), reference, cpu,
                                 chain_steps=chain_steps)
