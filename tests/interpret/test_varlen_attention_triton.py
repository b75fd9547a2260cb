"""The Triton backend of ``varlen_attention`` under the interpreter (TRITON_INTERPRET=1): its
kernels write every element of poisoned (NaN) outputs, the deterministic backward is bitwise
reproducible, the tile table covers exactly the real tiles longest first, "auto" picks it,
garbage unvalidated ``cu_seqlens`` never crash it, and the usual layout edge cases. The
accuracy grid is in ``test_varlen_attention_triton_grid*.py``; the deterministic backward's in
``test_varlen_attention_triton_deterministic.py``."""


import pytest
import torch

from agentrl_fast.ops import varlen_attention
from agentrl_fast.ops.varlen_attention import BACKENDS, available_backends, resolve_backend
from agentrl_fast.ops.varlen_attention_triton import tile_slots, tile_table
from test_varlen_attention import (DTYPES, check_kernels_overwrite_poisoned_outputs, cu_seqlens_of,
                                   make_inputs, run_and_compare)


def test_backend_is_available_and_auto_picks_it_on_cpu_under_the_interpreter():
    assert BACKENDS["triton"].kind == "op"
    assert "triton" in available_backends("cpu")
    assert resolve_backend("auto", torch.device("cpu")) == "triton"
    q, k, v, cu, max_seqlen = make_inputs([4, 0, 9], 2, 1, 16, torch.float32, seed=1,
                                          requires_grad=False)
    assert torch.equal(varlen_attention(q, k, v, cu, max_seqlen),
                       varlen_attention(q, k, v, cu, max_seqlen, backend="triton"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_kernels_overwrite_poisoned_outputs(dtype, causal):
    """forward/backward called directly on NaN-filled out, lse, dq, dk, dv: every element is
    written, and the values match the float64 reference."""
    check_kernels_overwrite_poisoned_outputs("triton", dtype, causal)


def test_deterministic_backward_is_bitwise_reproducible():
    """With ``deterministic=True`` two runs give the same bits (GQA 4:1: dk, dv summed over 4
    query heads; dq by its own kernel). The default backward adds dq by float32 atomics, whose
    order varies on a GPU (the interpreter runs programs in order, so it is not tested here)."""
    deterministic = True
    q, k, v, cu, max_seqlen = make_inputs([3, 0, 70, 1, 20], 4, 1, 64, torch.bfloat16, seed=30)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)

    def run():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = varlen_attention(*leaves, cu, max_seqlen, return_lse=True, backend="triton",
                                    deterministic=deterministic)
        return (out, lse, *torch.autograd.grad(out, leaves, dout))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block", [16, 64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_tile_table_covers_the_real_tiles_longest_first(block, causal):
    lengths = [0, 1, 7, 113, 0, 203, 0, 600, 64]
    cu = cu_seqlens_of(lengths)
    num_tokens = sum(lengths)
    bounds, tile_sequence, tile_block, slots = tile_table(cu, num_tokens, block, causal)
    assert slots == tile_slots(num_tokens, len(lengths) + 2, block) == tile_sequence.numel()
    assert bounds.tolist() == [0] + cu.tolist() + [num_tokens]
    real = tile_sequence >= 0
    count = int(real.sum())
    assert real[:count].all() and not real[count:].any()  # the unused slots last
    framed = [0] + lengths + [0]
    pairs = sorted(zip(tile_sequence[:count].tolist(), tile_block[:count].tolist()))
    assert pairs == [(s, b) for s, n in enumerate(framed) for b in range(-(-n // block))]
    work = [min((b + 1) * block, framed[s]) if causal else framed[s]
            for s, b in zip(tile_sequence[:count].tolist(), tile_block[:count].tolist())]
    assert work == sorted(work, reverse=True)
    assert num_tokens // block + len(framed) >= count


def test_tile_table_of_garbage_cu_seqlens_stays_in_range():
    cu = torch.tensor([5, -3, 2**31 - 1, 4, 9], dtype=torch.int32)
    bounds, tile_sequence, tile_block, slots = tile_table(cu, 20, 8, True)
    assert bounds.tolist() == [0, 5, 5, 20, 20, 20, 20]
    real = tile_sequence[tile_sequence >= 0]
    assert sorted(set(real.tolist())) == [0, 2]  # the gap [0, 5) and the clamped [5, 20)


@pytest.mark.parametrize("cu_values", [[0, 5, 2, 6], [0, 10**9], [-7, -1, 3, -(2**31)],
                                       [2**31 - 1, -(2**31), 2**31 - 1, 0], [3, 4, 6], [0, 2, 3],
                                       [0, 2, 60], [0, 0, 0, 0]])
def test_unvalidated_garbage_never_crashes_and_writes_every_token(cu_values):
    q, k, v, _, _ = make_inputs([6], 2, 1, 16, torch.float32, seed=32)
    cu = torch.tensor(cu_values, dtype=torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32)
    out, lse = varlen_attention(q, k, v, cu, 3, return_lse=True, backend="triton", validate=False)
    out.sum().backward()
    for x in (out, lse, q.grad, k.grad, v.grad):
        assert torch.isfinite(x).all()


@pytest.mark.parametrize("lengths", [[], [0, 0]])
def test_empty_batch(lengths):
    q, k, v, cu, max_seqlen = make_inputs(lengths, 4, 2, 64, torch.bfloat16, seed=0)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen, return_lse=True, backend="triton")
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    (out.float().sum() * 2).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape


def test_non_contiguous_inputs():
    """q transposed from [Hq, T, D], k sliced from a wider last dim (token/head strides taken as
    they are), v with a non-unit head-dim stride (copied), dout transposed."""
    lengths, hq, hk, head_dim, dtype = [3, 0, 50, 1, 20], 4, 2, 32, torch.bfloat16
    num_tokens, cu = sum(lengths), cu_seqlens_of(lengths)
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(hq, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    k = torch.randn(num_tokens, hk, 2 * head_dim, generator=gen).to(dtype)[..., head_dim:]
    v = torch.randn(num_tokens, hk, 2 * head_dim, generator=gen).to(dtype)[..., ::2]
    dout = torch.randn(hq, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)

    def run(q, k, v, dout):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = varlen_attention(*leaves, cu, max(lengths), return_lse=True, backend="triton")
        return (out, lse, *torch.autograd.grad(out, leaves, dout))

    for a, b in zip(run(q, k, v, dout), run(q.contiguous(), k.contiguous(), v.contiguous(),
                                             dout.contiguous())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_no_leak_across_sequences(causal):
    q, k, v, cu, max_seqlen = make_inputs([5, 0, 17, 1, 33, 8], 2, 1, 16, torch.float32, seed=7)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))

    def run(k_in, v_in):
        leaves = [q.detach().requires_grad_(), k_in.detach().requires_grad_(), v_in.detach().requires_grad_()]
        out = varlen_attention(*leaves, cu, max_seqlen, causal=causal, backend="triton")
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

    base = run(k, v)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[22:23] += 10  # the one-token sequence 3
    v2[22:23] -= 5
    k2[23:56] = k2[23:56] * 3 + 1  # sequence 4
    changed = run(k2, v2)
    outside = torch.ones(q.shape[0], dtype=torch.bool)
    outside[22:56] = False
    for a, b in zip(base, changed):
        assert torch.equal(a[outside], b[outside])
    assert not torch.equal(base[0][23:56], changed[0][23:56])


@pytest.mark.parametrize("softmax_scale", [0.3, 0.0])
def test_softmax_scale(softmax_scale):
    q, k, v, cu, max_seqlen = make_inputs([9, 0, 30], 4, 2, 16, torch.float32, seed=6)
    run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend="triton",
                    softmax_scale=softmax_scale)


@pytest.mark.parametrize("op, config", [
    ("varlen_attention_forward", dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)),
    ("varlen_attention_forward", dict(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=1)),
    ("varlen_attention_backward", dict(BLOCK=16, STEP=64, num_warps=4, num_stages=1)),
    ("varlen_attention_backward_dq", dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1))])
def test_any_block_shape_computes_the_same_function(op, config):
    """A tuned configuration (agentrl_fast/kernels/tuned.py) may pair any block sizes: query tiles smaller
    or larger than key blocks give the float64 reference's results, in both backwards."""
    from agentrl_fast.kernels import tuned

    for deterministic in (False, True):
        q, k, v, cu, max_seqlen = make_inputs([0, 1, 7, 45, 0, 70], 4, 2, 32, torch.float32,
                                              seed=50 + deterministic)
        with tuned.forced(op, "fp32_d32", config):
            run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend="triton",
                            deterministic=deterministic)

