"""GAE over packed trajectories (``agentrl_fast.ops.gae``), ``gae_padded`` and ``whiten``,
against the float64 references in ``agentrl_fast.ops.reference``.

Fixtures (``packed_batch``, ``assert_gae_close``) live in ``conftest.py``; bad-input tests are
in ``test_gae_errors.py``.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_fast import _native
from agentrl_fast.ops import gae, gae_padded, whiten
from agentrl_fast.ops.reference import gae_padded_reference, gae_reference, whiten_reference

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CPU_CHUNK = 1 << 15  # kCpuChunk in csrc/gae.cpp
CUDA_TILE = 256 * 8  # kTile in csrc/gae.cu

# gamma and lam, with the endpoints 0 and 1 drawn often.
unit_interval = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))


def expected_dtype(rewards_dtype, values_dtype):
    return torch.float64 if torch.float64 in (rewards_dtype, values_dtype) else torch.float32


def run_gae(batch, gamma, lam, **kwargs):
    return gae(batch.rewards, batch.values, batch.cu_seqlens, **batch.kwargs(), gamma=gamma,
               lam=lam, **kwargs)


def run_reference(batch, gamma, lam):
    return gae_reference(batch.rewards, batch.values, batch.cu_seqlens, batch.action_mask,
                         batch.bootstrap_values, gamma, lam)


def run_gae_out(batch, gamma, lam, out_dtype, fill=math.nan, validate=True):
    device = batch.rewards.device
    advantages = torch.full((batch.num_tokens,), fill, dtype=out_dtype, device=device)
    returns = torch.full((batch.num_tokens,), fill, dtype=out_dtype, device=device)
    torch.ops.agentrl_fast.gae_out(batch.rewards, batch.values, batch.cu_seqlens,
                                   batch.action_mask, batch.bootstrap_values, gamma, lam,
                                   validate, advantages, returns)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# Values


def test_hand_computed_example():
    """A worked example, independent of both the kernel and the reference: an observation span
    is bridged by one gamma step, the bootstrap feeds the last action token, non-action tokens
    get 0."""
    gamma, lam = 0.5, 0.75
    # sequence 0: prompt, action, observation, action (bootstrap 4)
    # sequence 1: action, action (terminal: bootstrap 0); sequence 2: empty
    mask = torch.tensor([False, True, False, True, True, True])
    rewards = torch.tensor([0.0, 0.25, 0.0, 1.0, 2.0, -1.0])
    values = torch.tensor([9.0, 0.5, 7.0, 2.0, 1.0, 3.0])
    cu_seqlens = torch.tensor([0, 4, 6, 6], dtype=torch.int32)
    bootstrap = torch.tensor([4.0, 0.0, 5.0])
    a3 = 1.0 + 0.5 * 4.0 - 2.0  # 1.0
    a1 = 0.25 + 0.5 * 2.0 - 0.5 + 0.375 * a3  # 1.125
    a5 = -1.0 + 0.0 - 3.0  # -4.0
    a4 = 2.0 + 0.5 * 3.0 - 1.0 + 0.375 * a5  # 1.0
    want_adv = torch.tensor([0.0, a1, 0.0, a3, a4, a5])
    want_ret = torch.tensor([0.0, a1 + 0.5, 0.0, a3 + 2.0, a4 + 1.0, a5 + 3.0])
    adv, ret = gae(rewards, values, cu_seqlens, action_mask=mask, bootstrap_values=bootstrap,
                   gamma=gamma, lam=lam)
    # every number above is a short dyadic fraction: exact in float32
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret), (adv, ret)
    ref_adv, ref_ret = gae_reference(rewards, values, cu_seqlens, mask, bootstrap, gamma, lam)
    assert torch.equal(ref_adv.float(), want_adv) and torch.equal(ref_ret.float(), want_ret)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), gamma=unit_interval, lam=unit_interval,
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_matches_reference(packed_batch, assert_gae_close, data, gamma, lam, dtype):
    batch = packed_batch(data.draw).cast(dtype, dtype)
    advantages, returns = run_gae(batch, gamma, lam)
    assert advantages.dtype == returns.dtype == dtype
    assert advantages.shape == returns.shape == (batch.num_tokens,)
    assert_gae_close(advantages, returns, run_reference(batch, gamma, lam), batch)


# mixed lengths: empty, length 1, odd, a chunk's worth of short ones
MIXED_LENGTHS = [0, 1, 7, 113, 0, 1, 203, 1023, 2, 1]


@pytest.mark.parametrize("values_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("rewards_dtype", FLOAT_DTYPES, ids=str)
def test_dtypes(packed_batch, assert_gae_close, rewards_dtype, values_dtype):
    """Every pair of input dtypes: the output dtype rule, and values against the reference on the
    rounded inputs (so the tolerance covers accumulation only)."""
    out_dtype = expected_dtype(rewards_dtype, values_dtype)
    for seed, (gamma, lam), boot_dtype in ((0, (0.99, 0.95), torch.float64),
                                           (1, (1.0, 1.0), torch.bfloat16),
                                           (2, (0.9, 0.0), values_dtype)):
        batch = packed_batch(seed, MIXED_LENGTHS, mask_styles="agentic",
                             reward_style="dense").cast(rewards_dtype, values_dtype, boot_dtype)
        advantages, returns = run_gae(batch, gamma, lam)
        assert advantages.dtype == returns.dtype == out_dtype
        assert_gae_close(advantages, returns, run_reference(batch, gamma, lam), batch)
        # the registered op directly: same kernel, same dtype, same bits
        direct = torch.ops.agentrl_fast.gae(batch.rewards, batch.values, batch.cu_seqlens,
                                            batch.action_mask, batch.bootstrap_values, gamma, lam)
        assert torch.equal(direct[0], advantages) and torch.equal(direct[1], returns)


def test_fake_implementation_dtype_rule():
    """The fake (meta) implementation that torch.compile traces agrees with the kernel's dtype
    rule for every pair of input dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for rewards_dtype in FLOAT_DTYPES:
        for values_dtype in FLOAT_DTYPES:
            real = torch.ops.agentrl_fast.gae(torch.zeros(3, dtype=rewards_dtype),
                                              torch.zeros(3, dtype=values_dtype),
                                              torch.tensor([0, 3], dtype=torch.int32))
            with FakeTensorMode():
                fake = torch.ops.agentrl_fast.gae(torch.zeros(3, dtype=rewards_dtype),
                                                  torch.zeros(3, dtype=values_dtype),
                                                  torch.tensor([0, 3], dtype=torch.int32))
            want = expected_dtype(rewards_dtype, values_dtype)
            assert real[0].dtype == real[1].dtype == want
            assert fake[0].dtype == fake[1].dtype == want
            assert fake[0].shape == fake[1].shape == (3,)


@pytest.mark.parametrize("rewards_dtype,values_dtype", [
    (torch.float32, torch.float32), (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)], ids=str)
def test_opcheck(packed_batch, rewards_dtype, values_dtype):
    """torch.library.opcheck: schema (mutation/aliasing), fake tensor and AOT dispatch."""
    batch = packed_batch(3, [1, 6, 0, 9], mask_styles="agentic").cast(rewards_dtype, values_dtype)
    args = (batch.rewards, batch.values, batch.cu_seqlens, batch.action_mask,
            batch.bootstrap_values, 0.9, 0.95, True)
    torch.library.opcheck(torch.ops.agentrl_fast.gae.default, args)
    out_dtype = expected_dtype(rewards_dtype, values_dtype)
    outs = (torch.empty(batch.num_tokens, dtype=out_dtype), torch.empty(batch.num_tokens, dtype=out_dtype))
    torch.library.opcheck(torch.ops.agentrl_fast.gae_out.default, args + outs)


LONG = 100_003


LONG_CASES = [  # (mask_style, gamma, lam, dtype)
    *[(mask_style, gamma, lam, dtype)
      for mask_style in ("none", "random", "agentic")
      for gamma, lam in ((0.99, 0.95), (1.0, 1.0))
      for dtype in (torch.float32, torch.float64)],
    ("agentic", 0.0, 1.0, torch.float32), ("agentic", 1.0, 0.0, torch.float32),
    ("none", 0.0, 0.0, torch.float64),
]


@pytest.mark.parametrize("lengths", [[3, LONG, 1, 5], [CPU_CHUNK, CPU_CHUNK + 1, 2 * CPU_CHUNK, 2]],
                         ids=["100003", "chunk-boundaries"])
@pytest.mark.parametrize("mask_style,gamma,lam,dtype", LONG_CASES, ids=str)
def test_long_sequences_chunked_scan(packed_batch, assert_gae_close, lengths, gamma, lam,
                                     mask_style, dtype):
    """Sequences longer than the CPU kernel's chunk (1 << 15 tokens) take its parallel-scan
    path; exact multiples and one-past-a-multiple of the chunk size are included."""
    batch = packed_batch(10, lengths, mask_styles="all" if mask_style == "none" else mask_style,
                         with_mask=mask_style != "none", reward_style="dense")
    batch = batch.cast(dtype, dtype)
    assert batch.max_seqlen > CPU_CHUNK
    advantages, returns = run_gae(batch, gamma, lam)
    assert_gae_close(advantages, returns, run_reference(batch, gamma, lam), batch)


def _with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0)])
def test_thread_count_does_not_change_results(packed_batch, gamma, lam):
    lengths = [3, LONG, 1, 5] + [17] * 300 + [CPU_CHUNK + 9]
    batch = packed_batch(11, lengths, mask_styles="random", reward_style="dense").cast(torch.float32)
    one = _with_threads(1, lambda: run_gae(batch, gamma, lam))
    two = _with_threads(2, lambda: run_gae(batch, gamma, lam))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_deterministic(packed_batch):
    lengths = [3, LONG, 1, 5] + [17] * 300
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        batch = packed_batch(12, lengths, mask_styles="agentic").cast(dtype, dtype)
        first = run_gae(batch, 0.99, 0.95)
        for _ in range(3):
            again = run_gae(batch, 0.99, 0.95)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), gamma=unit_interval, lam=unit_interval,
       dtype=st.sampled_from(FLOAT_DTYPES))
def test_gae_out_overwrites_poisoned_outputs(packed_batch, assert_gae_close, data, gamma, lam, dtype):
    """gae_out writes every element: NaN-prefilled outputs come back finite and correct, with
    zeros on non-action tokens."""
    batch = packed_batch(data.draw).cast(dtype, dtype)
    out_dtype = expected_dtype(dtype, dtype)
    advantages, returns = run_gae_out(batch, gamma, lam, out_dtype)
    assert_gae_close(advantages, returns, run_reference(batch, gamma, lam), batch)
    fresh = run_gae(batch, gamma, lam)
    assert torch.equal(advantages, fresh[0]) and torch.equal(returns, fresh[1])


@pytest.mark.parametrize("validate", [True, False])
def test_gae_out_poisoned_long(packed_batch, assert_gae_close, validate):
    batch = packed_batch(13, [0, 3, LONG, 0, 1, 40], mask_styles="agentic")
    for out_dtype, dtype in ((torch.float32, torch.float32), (torch.float64, torch.float64)):
        cast = batch.cast(dtype, dtype)
        reference = run_reference(cast, 0.99, 0.95)
        for fill in (math.nan, math.inf, -7.0):
            advantages, returns = run_gae_out(cast, 0.99, 0.95, out_dtype, fill, validate)
            assert_gae_close(advantages, returns, reference, cast)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("num_sequences", [0, 1, 2])
def test_no_tokens(num_sequences, validate):
    cu_seqlens = torch.zeros(num_sequences + 1, dtype=torch.int32)
    for dtype in FLOAT_DTYPES:
        empty = torch.zeros(0, dtype=dtype)
        for mask, boot in ((None, None), (torch.zeros(0, dtype=torch.bool),
                                          torch.ones(num_sequences, dtype=dtype))):
            advantages, returns = gae(empty, empty, cu_seqlens, action_mask=mask,
                                      bootstrap_values=boot, gamma=0.9, lam=0.9, validate=validate)
            assert advantages.shape == returns.shape == (0,)
            assert advantages.dtype == returns.dtype == expected_dtype(dtype, dtype)
            out = torch.zeros(0, dtype=expected_dtype(dtype, dtype))
            out2 = torch.zeros(0, dtype=expected_dtype(dtype, dtype))
            torch.ops.agentrl_fast.gae_out(empty, empty, cu_seqlens, mask, boot, 0.9, 0.9,
                                           validate, out, out2)


def test_sequences_without_action_tokens_ignore_their_bootstrap():
    """A sequence with no action token (e.g. a skipped sub-trace) yields zeros whatever its
    bootstrap; its neighbours are unaffected."""
    cu_seqlens = torch.tensor([0, 2, 5, 7], dtype=torch.int32)
    mask = torch.tensor([False, True, False, False, False, True, True])
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    values = torch.arange(7, dtype=torch.float32)
    advantages, returns = gae(rewards, values, cu_seqlens, action_mask=mask,
                              bootstrap_values=torch.tensor([0.0, 1e6, 0.0]))
    assert torch.equal(advantages[2:5], torch.zeros(3)) and torch.equal(returns[2:5], torch.zeros(3))
    assert advantages[1] == 1.0 - 1.0 and advantages[6] == 1.0 - 6.0


def test_torch_compile_fullgraph(packed_batch):
    """One graph through dynamo (the op and its fake implementation), inductor compiling the
    arithmetic around it; same numbers as eager."""
    torch._dynamo.reset()

    def step(rewards, values, cu_seqlens, action_mask, bootstrap_values):
        advantages, returns = gae(rewards, values, cu_seqlens, action_mask=action_mask,
                                  bootstrap_values=bootstrap_values, gamma=0.99, lam=0.95)
        return advantages * 2.0 + 1.0, returns - values

    batch = packed_batch(14, [1, 5, 0, 9], mask_styles="agentic").cast(torch.float32, torch.float32)
    args = (batch.rewards, batch.values, batch.cu_seqlens, batch.action_mask, batch.bootstrap_values)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(*args)
    want = step(*args)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch._dynamo.reset()


def test_inputs_requiring_grad(packed_batch):
    batch = packed_batch(15, [4, 0, 30, 1], mask_styles="agentic")
    rewards = batch.rewards.float().requires_grad_()
    values = batch.values.float().requires_grad_()
    boot = batch.bootstrap_values.float().requires_grad_()
    advantages, returns = gae(rewards, values, batch.cu_seqlens, action_mask=batch.action_mask,
                              bootstrap_values=boot, gamma=0.9, lam=0.8)
    assert not advantages.requires_grad and not returns.requires_grad
    assert advantages.grad_fn is None and returns.grad_fn is None
    plain = gae(rewards.detach(), values.detach(), batch.cu_seqlens, action_mask=batch.action_mask,
                bootstrap_values=boot.detach(), gamma=0.9, lam=0.8)
    assert torch.equal(advantages, plain[0]) and torch.equal(returns, plain[1])
    padded = gae_padded(rewards.view(5, 7), values.view(5, 7), batch.action_mask.view(5, 7),
                        gamma=0.9, lam=0.8)
    assert not padded[0].requires_grad and not padded[1].requires_grad


def test_non_contiguous_inputs(packed_batch):
    batch = packed_batch(16, [0, 11, 1, 300, 2], mask_styles="agentic", reward_style="dense")
    num_tokens = batch.num_tokens

    def strided(x):
        wide = torch.zeros(num_tokens, 2, dtype=x.dtype)
        wide[:, 1] = x
        return wide[:, 1]

    for dtype in (torch.float32, torch.bfloat16):
        cast = batch.cast(dtype, dtype)
        want = run_gae(cast, 0.97, 0.9)
        got = gae(strided(cast.rewards), strided(cast.values), cast.cu_seqlens,
                  action_mask=strided(cast.action_mask),
                  bootstrap_values=torch.stack([cast.bootstrap_values] * 2, 1)[:, 0],
                  gamma=0.97, lam=0.9)
        assert not strided(cast.rewards).is_contiguous()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@settings(max_examples=30, deadline=None)
@given(data=st.data(), gamma=unit_interval, lam=unit_interval)
def test_validate_false_same_result_on_valid_input(packed_batch, data, gamma, lam):
    batch = packed_batch(data.draw).cast(torch.float32, torch.float32)
    checked = run_gae(batch, gamma, lam)
    unchecked = run_gae(batch, gamma, lam, validate=False)
    assert torch.equal(checked[0], unchecked[0]) and torch.equal(checked[1], unchecked[1])


# ---------------------------------------------------------------------------------------------
# gae_padded (verl's layout)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 6), length=st.integers(0, 80), seed=st.integers(0, 2**32 - 1),
       gamma=unit_interval, lam=unit_interval,
       mask_dtype=st.sampled_from([torch.bool, torch.int64, torch.int32, torch.float32]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_gae_padded_matches_verl(packed_batch, rows, length, seed, gamma, lam, mask_dtype, dtype):
    batch = packed_batch(seed, [length] * rows, mask_styles="trailing" if seed % 3 else "agentic",
                         reward_style="sparse")
    shape = (rows, length)
    rewards = batch.rewards.to(dtype).view(shape)
    values = batch.values.to(dtype).view(shape)
    mask = batch.action_mask.view(shape)
    advantages, returns = gae_padded(rewards, values, mask.to(mask_dtype), gamma=gamma, lam=lam)
    assert advantages.shape == returns.shape == shape
    assert advantages.dtype == returns.dtype == expected_dtype(dtype, dtype)
    ref_adv, ref_ret = gae_padded_reference(rewards, values, mask, gamma, lam)
    scale = max([1.0] + [float(x.abs().max()) for x in (ref_adv, ref_ret) if x.numel()])
    atol = 64 * torch.finfo(advantages.dtype).eps * scale
    torch.testing.assert_close(advantages[mask].double(), ref_adv[mask], rtol=0, atol=atol)
    torch.testing.assert_close(returns[mask].double(), ref_ret[mask], rtol=0, atol=atol)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


# ---------------------------------------------------------------------------------------------
# whiten


def _assert_whiten_close(got, want, dtype):
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=0, atol=8 * eps * scale)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("shape", [(0,), (1,), (257,), (4, 33), (3, 0)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_whiten_matches_reference(shape, shift_mean, dtype):
    gen = torch.Generator().manual_seed(hash((shape, shift_mean)) % 2**31)
    for mask_kind in ("random", "all", "none", "single"):
        advantages = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1.5).to(dtype)
        if mask_kind == "random":
            mask = torch.rand(shape, generator=gen) < 0.6
        elif mask_kind == "all":
            mask = torch.ones(shape, dtype=torch.bool)
        else:
            mask = torch.zeros(shape, dtype=torch.bool)
            if mask_kind == "single" and mask.numel():
                mask.view(-1)[mask.numel() // 2] = True
        got = whiten(advantages, mask, shift_mean=shift_mean)
        want = whiten_reference(advantages, mask, shift_mean=shift_mean)
        assert got.shape == advantages.shape
        assert torch.isfinite(got).all()
        assert (got[~mask] == 0).all(), "whiten must give 0 on non-action tokens"
        if mask_kind == "none" or (mask_kind == "single" and shift_mean):
            assert (got == 0).all()
        _assert_whiten_close(got, want, dtype)
        if mask_kind == "random" and int(mask.sum()) > 1 and shift_mean:
            selected = got[mask].double()
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
            assert abs(float(selected.mean())) < tol
            assert abs(float(selected.std()) - 1) < tol


def test_whiten_ignores_non_finite_values_on_non_action_tokens():
    advantages = torch.tensor([math.nan, 1.0, 2.0, math.inf, 4.0])
    mask = torch.tensor([False, True, True, False, True])
    got = whiten(advantages, mask)
    _assert_whiten_close(got, whiten_reference(advantages, mask), torch.float32)


def test_unvalidated_garbage_cu_seqlens_still_writes_every_output():
    # validate=False with cu_seqlens that leave tokens outside every sequence: wrong numbers are
    # allowed, unwritten (poisoned) outputs are not; tokens outside every sequence get zeros.
    rewards, values = torch.randn(6), torch.randn(6)
    for cu in ([3, -1, 2], [2, 4], [0, 10**9], [5, 1, 0]):
        adv = torch.full((6,), math.nan)
        ret = torch.full((6,), math.nan)
        torch.ops.agentrl_fast.gae_out(rewards, values, torch.tensor(cu, dtype=torch.int32), None,
                                       None, 0.9, 0.9, False, adv, ret)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), cu
    adv = torch.full((6,), math.nan)
    ret = torch.full((6,), math.nan)
    torch.ops.agentrl_fast.gae_out(rewards, values, torch.tensor([2, 4], dtype=torch.int32), None,
                                   None, 0.9, 0.9, False, adv, ret)
    assert adv[:2].eq(0).all() and adv[4:].eq(0).all() and ret[4:].eq(0).all()


# ---------------------------------------------------------------------------------------------
# CUDA against the CPU (run on the GPU machine)

GPU_MIXES = {
    # many short sequences (~1M tokens)
    "many-short": lambda gen: torch.randint(0, 257, (8192,), generator=gen).tolist(),
    # a long tail: mostly short, some up to 200k tokens (~1.5M tokens)
    "long-tail": lambda gen: (torch.randint(0, 600, (1500,), generator=gen).tolist()
                              + [200_000, 2 * CUDA_TILE, 150_001, 1, 0, 99_999, 100_000,
                                 CUDA_TILE + 1, CUDA_TILE, 300_017]),
    # one sequence of ~3 million tokens between short ones: thousands of tiles chain via look-back
    "one-long": lambda gen: [5, 1, 3_000_017, 0, 2, 7],
}
GPU_DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64),
              (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
              (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)]


def check_device_against_cpu(device, mix, packed_batch, assert_gae_close):
    """Every dtype pair, with/without action mask and bootstraps, two (gamma, lam), through
    ``gae``, ``gae(validate=False)`` and a NaN-poisoned ``gae_out``, against the CPU kernel on
    the same rounded inputs computed in float64."""
    gen = torch.Generator().manual_seed(20)
    lengths = GPU_MIXES[mix](gen)
    mask_styles = "random" if mix == "one-long" else "agentic"
    for with_mask in (True, False):
        for with_bootstrap in (True, False):
            base = packed_batch(21, lengths, mask_styles=mask_styles, reward_style="dense",
                                with_mask=with_mask, with_bootstrap=with_bootstrap)
            chain_steps = math.ceil(base.max_seqlen / CUDA_TILE) + 2
            for rewards_dtype, values_dtype in GPU_DTYPES:
                out_dtype = expected_dtype(rewards_dtype, values_dtype)
                cpu = base.cast(rewards_dtype, values_dtype, out_dtype)
                dev = cpu.cast(device=device)
                as64 = cpu.cast(torch.float64, torch.float64, torch.float64)
                for gamma, lam in ((0.99, 0.95), (1.0, 1.0)):
                    reference = run_gae(as64, gamma, lam)  # the CPU kernel, float64 throughout
                    for how in ("gae", "validate=False", "gae_out"):
                        if how == "gae_out":
                            got = run_gae_out(dev, gamma, lam, out_dtype)
                        else:
                            got = run_gae(dev, gamma, lam, validate=how == "gae")
                        assert got[0].device.type == got[1].device.type == device
                        assert got[0].dtype == got[1].dtype == out_dtype
                        assert_gae_close(got[0].cpu(), got[1].cpu(), reference, cpu,
                                         chain_steps=chain_steps)


@pytest.mark.gpu
@pytest.mark.parametrize("mix", list(GPU_MIXES))
def test_cuda_matches_cpu(packed_batch, assert_gae_close, mix):
    assert _native.cuda_built, "a CUDA device is visible but agentrl_fast was built without CUDA"
    check_device_against_cpu("cuda", mix, packed_batch, assert_gae_close)
    # no tokens, and empty sequences only
    for num_sequences in (0, 3):
        empty = torch.zeros(0, device="cuda")
        cu_seqlens = torch.zeros(num_sequences + 1, dtype=torch.int32, device="cuda")
        advantages, returns = gae(empty, empty, cu_seqlens)
        assert advantages.shape == returns.shape == (0,)
    torch.cuda.synchronize()
