"""The native (C++ CPU) kernel's prefix-shared mode, called directly
(``torch.ops.agentrl_fast.varlen_attention_cpu_prefix_out`` / ``_prefix_backward_out``), against
the float64 oracle: the plain reference ``varlen_attention_reference`` on the UNSHARED packing,
where each suffix gets its own copy of its prefix laid right before it (a prefix's dk, dv: the
sum over its copies plus its own causal part, which autograd through the copies' gather gives).

Tolerances are the plain op's (``test_varlen_attention``): at most 2x (forward) / 3x (backward)
the error of the same math done by PyTorch in the input dtype, on the same unshared packing.
The generic prefix path and the other backends are in ``test_varlen_attention_prefix.py``.
"""

import math
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from agentrl_fast.ops.reference import varlen_attention_reference
from test_varlen_attention import DTYPES, ODD_HEAD_DIM, assert_within, attention_in_dtype, max_error

OPS = torch.ops.agentrl_fast


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Many tiny matmuls: one thread is fastest on a loaded 2-core runner (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Layouts, the kernels, the oracle.

# A layout: (length, prefix_of) per segment, in packed order.
LAYOUTS = {
    "one-suffix": [(37, -1), (21, 0)],
    "several-suffixes-one-empty": [(50, -1), (13, 0), (1, 0), (29, 0), (0, 0)],
    "empty-prefix": [(0, -1), (9, 0), (17, 0), (5, -1)],
    "non-adjacent": [(40, -1), (11, -1), (23, 0), (7, 1), (3, -1), (19, 0), (1, 1)],
    "groups-and-plain": [(5, -1), (64, -1), (17, 1), (1, -1), (33, -1), (8, 4), (2, 4), (0, -1),
                         (113, 1)],
    "length-1-prefix": [(1, -1), (1, 0), (6, 0)],
}


def cu_seqlens_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


def unshared_packing(layout):
    """``(index[U], own[T], cu[B + 1])``: the unshared packing's tokens as indices into the shared
    one (each suffix after a copy of its prefix), each shared token's own row in it, its bounds."""
    starts = [0]
    for length, _ in layout:
        starts.append(starts[-1] + length)
    index, own, cu = [], [0] * starts[-1], [0]
    for b, (length, prefix) in enumerate(layout):
        if prefix >= 0:
            index += range(starts[prefix], starts[prefix + 1])
        for j in range(length):
            own[starts[b] + j] = len(index)
            index.append(starts[b] + j)
        cu.append(len(index))
    return torch.tensor(index, dtype=torch.long), torch.tensor(own, dtype=torch.long), \
        torch.tensor(cu, dtype=torch.int32)


def make_inputs(layout, num_heads_q, num_heads_k, head_dim, dtype, seed):
    """``(q[T, Hq, D], k, v[T, Hk, D], dout[T, Hq, D], cu_seqlens, prefix_of)``."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(length for length, _ in layout)
    q, k, v, dout = (torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
                     for heads in (num_heads_q, num_heads_k, num_heads_k, num_heads_q))
    prefix_of = torch.tensor([p for _, p in layout], dtype=torch.int32)
    return q, k, v, dout, cu_seqlens_of([length for length, _ in layout]), prefix_of


def native_prefix(q, k, v, dout, cu_seqlens, prefix_of, scale):
    """The C++ prefix kernels on NaN-poisoned outputs: ``(out, lse, dq, dk, dv)``."""
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan)
    OPS.varlen_attention_cpu_prefix_out(q, k, v, cu_seqlens, prefix_of, scale, out, lse)
    grads = [torch.full_like(x, math.nan) for x in (q, k, v)]
    OPS.varlen_attention_cpu_prefix_backward_out(dout, q, k, v, out, lse, cu_seqlens, prefix_of,
                                                 scale, *grads)
    return out, lse, *grads


def native_plain(q, k, v, dout, cu_seqlens, scale):
    """The plain C++ kernels (causal): ``(out, lse, dq, dk, dv)``."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
    OPS.varlen_attention_cpu_out(q, k, v, cu_seqlens, True, scale, out, lse)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    OPS.varlen_attention_cpu_backward_out(dout, q, k, v, out, lse, cu_seqlens, True, scale, *grads)
    return out, lse, *grads


def on_unshared(attention, layout, q, k, v, dout, dtype):
    """``(out, lse, dq, dk, dv)`` of the shared packing's tokens, from ``attention(q, k, v, cu)``
    (differentiable) run on the unshared packing in ``dtype``; autograd sums the copies."""
    index, own, cu = unshared_packing(layout)
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = attention(*(x[index] for x in leaves), cu)
    out, lse = out[own], lse[:, own]
    grads = (torch.autograd.grad(out, leaves, dout.to(dtype), allow_unused=True)
             if out.requires_grad else (None,) * 3)
    return (out, lse, *(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)))


def check_layout(layout, num_heads_q, num_heads_k, head_dim, dtype, *, seed, scale=None):
    """The native prefix kernels against the float64 oracle; returns the max error per result."""
    q, k, v, dout, cu, prefix_of = make_inputs(layout, num_heads_q, num_heads_k, head_dim, dtype,
                                               seed)
    scale = head_dim ** -0.5 if scale is None else scale
    got = native_prefix(q, k, v, dout, cu, prefix_of, scale)
    want = on_unshared(lambda q, k, v, cu: varlen_attention_reference(q, k, v, cu, causal=True,
                                                                      softmax_scale=scale),
                       layout, q, k, v, dout, torch.float64)
    baseline = on_unshared(lambda q, k, v, cu: attention_in_dtype(q, k, v, cu, True, scale),
                           layout, q, k, v, dout, dtype)
    context = f"(layout={layout}, dtype={dtype}, Hq={num_heads_q}, Hk={num_heads_k}, D={head_dim})"
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not torch.isnan(x).any(), f"{name}: elements left unwritten (NaN) {context}"
        assert x.dtype == (torch.float32 if name == "lse" else dtype), name
    magnitude = max(max_error(x, torch.zeros_like(x)) for x in (want[0], *want[2:]))
    for name, g, w, b, factor in zip(("out", "lse", "dq", "dk", "dv"), got, want, baseline,
                                     (2, 2, 3, 3, 3)):
        assert_within(name, g, w, b, factor, context, 1.0 if name == "lse" else magnitude)
    return {name: max_error(g, w)
            for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}


# ---------------------------------------------------------------------------------------------
# Against the float64 oracle.

GQA = [(4, 2), (4, 1), (2, 2)]  # GQA, MQA, MHA
GRID = [(name, dtype, GQA[i % len(GQA)], 64)
        for i, (name, dtype) in enumerate((n, d) for n in LAYOUTS for d in DTYPES)]
GRID += [("groups-and-plain", dtype, (4, 2), head_dim)
         for dtype, head_dim in ((torch.float32, ODD_HEAD_DIM), (torch.bfloat16, 128),
                                 (torch.float16, 256), (torch.float32, 1), (torch.float32, 8))]


def _grid_id(case):
    name, dtype, (hq, hk), head_dim = case
    return f"{name}-{str(dtype)[6:]}-gqa{hq}:{hk}-D{head_dim}"


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_layouts_match_float64(case):
    name, dtype, (hq, hk), head_dim = case
    check_layout(LAYOUTS[name], hq, hk, head_dim, dtype, seed=zlib.crc32(_grid_id(case).encode()))


def random_layout(gen: torch.Generator):
    """1-8 segments of lengths 0, 1, small or up to 150; each a suffix of an earlier non-suffix
    segment half of the time."""
    def draw(n):
        return int(torch.randint(n, (1,), generator=gen))
    layout = []
    for b in range(1 + draw(8)):
        length = [0, 1, draw(13), draw(151)][draw(4)]
        prefixes = [p for p in range(b) if layout[p][1] == -1]
        prefix = prefixes[draw(len(prefixes))] if prefixes and draw(3) else -1
        layout.append((length, prefix))
    return layout


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_match_float64(seed):
    """Random layouts, dtypes, GQA ratios, head dims and scales (tiny head dims in fp32 only, as
    for the plain op)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[seed % 3]
    head_dims = [1, 2, 17, 64] if dtype == torch.float32 else [32, ODD_HEAD_DIM, 64]
    hq, hk = [(4, 2), (4, 1), (2, 2), (3, 1), (1, 1)][seed % 5]
    check_layout(random_layout(gen), hq, hk, head_dims[seed % len(head_dims)], dtype, seed=seed,
                 scale=[None, 0.05, 1.0][seed % 3])


# ---------------------------------------------------------------------------------------------
# The plain kernel's bits: the prefix mode reuses its row loops.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["several-suffixes-one-empty", "groups-and-plain"])
def test_rows_are_the_plain_kernels_bits_on_the_unshared_packing(name, dtype):
    """out, lse and dq of every token, and dk, dv of every token that is no prefix, equal the
    plain kernel's on the unshared packing bit for bit (same keys, same order); a prefix's dk,
    dv are its copies' summed."""
    layout = LAYOUTS[name]
    q, k, v, dout, cu, prefix_of = make_inputs(layout, 4, 2, 64, dtype, seed=3)
    got = native_prefix(q, k, v, dout, cu, prefix_of, 0.125)
    index, own, ucu = unshared_packing(layout)
    dout_unshared = dout.new_zeros(index.shape[0], *dout.shape[1:])  # the copies' queries: none
    dout_unshared[own] = dout
    plain = native_plain(q[index], k[index], v[index], dout_unshared, ucu, 0.125)
    for name_, g, p in zip(("out", "dq"), (got[0], got[2]), (plain[0], plain[2])):
        assert torch.equal(g, p[own]), name_
    assert torch.equal(got[1], plain[1][:, own])
    shared = torch.zeros(q.shape[0], dtype=torch.bool)
    starts = cu.tolist()
    for _, prefix in layout:
        if prefix >= 0:
            shared[starts[prefix]:starts[prefix + 1]] = True
    for name_, g, p in zip(("dk", "dv"), got[3:], plain[3:]):
        assert torch.equal(g[~shared], p[own][~shared]), name_
        summed = torch.zeros_like(g, dtype=torch.float64).index_add_(0, index, p.double())
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 sums in another order
        torch.testing.assert_close(g.double()[shared], summed[shared], rtol=tolerance,
                                   atol=tolerance)


def test_no_suffix_is_the_plain_op():
    """prefix_of all -1: the plain causal op's bits, forward and backward."""
    layout = [(length, -1) for length in (0, 1, 7, 113, 0, 40)]
    q, k, v, dout, cu, prefix_of = make_inputs(layout, 4, 2, 32, torch.float16, seed=4)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"),
                          native_prefix(q, k, v, dout, cu, prefix_of, 0.2),
                          native_plain(q, k, v, dout, cu, 0.2)):
        assert torch.equal(a, b), name


def test_deterministic_across_runs_and_threads():
    """Bit-identical twice and with 1 or 2 threads: a prefix's dk, dv are summed by one thread
    per KV head, in a fixed order."""
    layout = [(90, -1), *[(n, 0) for n in (31, 1, 64, 17, 0, 45)], (70, -1), (12, 7), (33, -1)]
    q, k, v, dout, cu, prefix_of = make_inputs(layout, 4, 2, 64, torch.float32, seed=5)
    results = []
    for threads in (1, 2, 2, 1):
        torch.set_num_threads(threads)
        results.append(native_prefix(q, k, v, dout, cu, prefix_of, 0.125))
    torch.set_num_threads(1)
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other):
            assert torch.equal(a, b), name


def test_tokens_outside_every_segment_are_written():
    """Unvalidated cu_seqlens covering part of the tokens: the rest get out = 0, lse = -inf and
    zero gradients (never the buffer's NaN)."""
    q, k, v, dout, _, _ = make_inputs([(16, -1)], 2, 1, 8, torch.float32, seed=6)
    prefix_of = torch.tensor([-1, 0], dtype=torch.int32)
    out, lse, dq, dk, dv = native_prefix(q, k, v, dout, cu_seqlens_of([6, 4]), prefix_of, 0.3)
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all() and (x[10:] == 0).all()
    assert (lse[:, 10:] == -math.inf).all() and torch.isfinite(lse[:, :10]).all()


def test_public_function_runs_the_native_prefix_mode():
    """varlen_attention(..., prefix_of=..., backend="native") runs these kernels (not the
    generic LSE-merge path): the same bits, forward and backward through autograd."""
    from agentrl_fast.ops import varlen_attention
    from agentrl_fast.ops.varlen_attention import BACKENDS
    assert BACKENDS["native"].prefix_forward is not None
    layout = LAYOUTS["groups-and-plain"]
    q, k, v, dout, cu, prefix_of = make_inputs(layout, 4, 2, 64, torch.bfloat16, seed=8)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_attention(*leaves, cu, max(length for length, _ in layout),
                                prefix_of=prefix_of, return_lse=True, backend="native")
    public = (out, lse, *torch.autograd.grad(out, leaves, dout))
    direct = native_prefix(q, k, v, dout, cu, prefix_of, 64 ** -0.5)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), public, direct):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# Bad input: metadata raises, garbage values never crash.

ONE_ENTRY = "prefix_of must be 1-D with one entry per segment"


@pytest.mark.parametrize("prefix_of,error,match", [
    (torch.tensor([-1.0, 0.0]), TypeError, "prefix_of must be int32 or int64"),
    (torch.tensor([-1, 0, 0], dtype=torch.int32), ValueError, ONE_ENTRY),
    (torch.tensor([[-1, 0]], dtype=torch.int32), ValueError, ONE_ENTRY),
])
def test_bad_prefix_of_metadata_raises(prefix_of, error, match):
    q, k, v, dout, cu, _ = make_inputs([(3, -1), (2, 0)], 2, 1, 8, torch.float32, seed=7)
    with pytest.raises(error, match=match):
        native_prefix(q, k, v, dout, cu, prefix_of, 0.3)


GARBAGE_SCRIPT = """
import math, random, torch
from agentrl_fast import _native
from test_varlen_attention_prefix_native import make_inputs, native_prefix

rng = random.Random(0)
values = [-2**31, -1000, -2, -1, 0, 1, 2, 5, 1000, 2**31 - 1]
for trial in range(300):
    num_tokens, segments = rng.randint(0, 40), rng.randint(0, 7)
    (hq, hk), head_dim = rng.choice([(2, 1), (2, 2)]), rng.choice([1, 8, 33])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    q, k, v, dout, _, _ = make_inputs([(num_tokens, -1)], hq, hk, head_dim, dtype, trial)
    index_dtype = rng.choice([torch.int32, torch.int64])
    big = [2**40, -2**40] if index_dtype == torch.int64 else []
    cu = torch.tensor([rng.choice([rng.randint(-50, num_tokens + 50), *big])
                       for _ in range(segments + 1)], dtype=index_dtype)
    prefix_of = torch.tensor([rng.choice(values + big + list(range(-1, segments + 1)))
                              for _ in range(segments)], dtype=index_dtype)
    out, lse, dq, dk, dv = native_prefix(q, k, v, dout, cu, prefix_of, 0.5)
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all(), (trial, cu, prefix_of)
    assert not torch.isnan(lse).any(), (trial, cu, prefix_of)

# An entry that is no earlier non-suffix segment reads as -1: the same bits as -1 there.
layout = [(9, -1), (5, 0), (4, 1), (6, -1), (3, 3), (2, 0)]
q, k, v, dout, cu, _ = make_inputs(layout, 4, 2, 16, torch.float32, 1)
clean = native_prefix(q, k, v, dout, cu, torch.tensor([-1, 0, -1, -1, 3, 0]), 0.3)
for garbage in ([-1, 0, 1, 7, 3, 0], [-5, 0, 2, 3, 3, 0], [2**31 - 1, 0, -2**31, 99, 3, 0]):
    got = native_prefix(q, k, v, dout, cu, torch.tensor(garbage, dtype=torch.int32), 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, clean)), garbage
print("garbage ok")
"""


def test_garbage_prefix_of_and_cu_seqlens_never_crash():
    """Random garbage cu_seqlens (out of range, decreasing, int64 beyond int32) and prefix_of
    (self, forward, chained, out of range), in a subprocess (a bad read would kill it): finite
    results, no crash; an invalid entry computes as -1."""
    result = subprocess.run([sys.executable, "-c", GARBAGE_SCRIPT], cwd=os.path.dirname(__file__),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "garbage ok" in result.stdout, result.stderr[-3000:]


def test_baseline_build_matches_float64():
    """The baseline build (CPUs without AVX2 + FMA; AGENTRL_FAST_CPU_BASELINE=1 in a fresh
    process) on a few layouts, each dtype, and the plain baseline kernel's bits."""
    script = textwrap.dedent("""
        import torch
        from agentrl_fast import _native
        import test_varlen_attention_prefix_native as t
        assert not _native._C.varlen_attention_cpu_uses_avx2()
        torch.set_num_threads(1)
        for case in [t.GRID[i] for i in (3, 7, 14, 17, -4)]:
            t.test_layouts_match_float64(case)
        t.test_rows_are_the_plain_kernels_bits_on_the_unshared_packing("groups-and-plain",
                                                                       torch.bfloat16)
        print("baseline ok")
    """)
    env = {**os.environ, "AGENTRL_FAST_CPU_BASELINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(__file__), env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "baseline ok" in result.stdout, result.stderr[-3000:]
