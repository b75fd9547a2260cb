"""The prefix-shared (tree) mode of ``varlen_attention`` (``prefix_of``) against the float64
oracle: the plain reference (``varlen_attention_reference``) on the UNSHARED packing, where each
suffix gets its own copy of its prefix's tokens right before it. Out, LSE and dq, dk, dv (a
prefix's dk, dv summed over its copies) with flash-attention's tolerance
(``test_varlen_attention.assert_within``: 2x forward / 3x backward the error of the same math
done by PyTorch in the input dtype on the unshared packing).

Backends: every one available on the CPU (reference, native, cpu_flash; triton too when this
file runs with TRITON_INTERPRET=1), through whatever ``prefix_kernels`` picks for them (their
native prefix mode once ``Backend.prefix_forward`` is set, else the generic LSE-merge path);
``test_generic_path_*`` keeps the generic path covered on every backend. The ``gpu`` tests run
the CUDA backends (torch, flash_attn, triton, reference). Bad ``prefix_of`` and
``validate=False`` garbage run in child processes (``error_cases``) so a crash fails a case.
"""

import math
import os
import random
import textwrap
import zlib

import pytest
import torch
from error_cases import bad_input_tests, no_error_tests
from test_varlen_attention import (DTYPES, assert_within, attention_in_dtype, cu_seqlens_of,
                                   cuda_backend, max_error)

from agentrl_fast.ops import varlen_attention
from agentrl_fast.ops._varlen_attention_prefix import (cached_prefix_layout, generic_kernels,
                                                       prefix_kernels, prefix_layout)
from agentrl_fast.ops.reference import varlen_attention_reference
from agentrl_fast.ops.varlen_attention import BACKENDS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKENDS = ["reference", "native", "cpu_flash"] + (["triton"] if INTERPRET else [])
GQA = [(4, 2), (4, 1), (2, 2)]  # (Hq, Hk): GQA, MQA, MHA
HEAD_DIM = 32  # flash-attention's smallest D: below it the 3x rule stops being meaningful


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Many tiny matmuls: one thread is fastest on a loaded 2-core runner. Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Layouts: (segment lengths, prefix_of).

LAYOUTS = {
    "one-prefix-one-suffix": ([13, 9], [-1, 0]),
    "one-prefix-several-suffixes": ([20, 5, 1, 11, 7], [-1, 0, 0, 0, 0]),
    "groups-and-plain": ([6, 12, 3, 0, 9, 15, 4, 6, 1, 5], [-1, -1, 1, 1, -1, -1, 5, 5, 5, -1]),
    "empty-prefix": ([0, 5, 8, 3], [-1, 0, 0, -1]),
    "empty-suffixes": ([9, 0, 6, 0], [-1, 0, 0, 0]),
    "length-1": ([1, 1, 1, 3, 1], [-1, 0, 0, -1, 3]),
    "odd-lengths": ([33, 17, 21, 5], [-1, 0, 0, 0]),
    "non-adjacent": ([10, 6, 8, 5, 7, 3, 2], [-1, -1, 0, 1, 0, 1, -1]),
    "far-suffix": ([7, 4, 9, 11], [-1, -1, -1, 0]),
    "no-sharing": ([5, 0, 9], [-1, -1, -1]),
    "only-empty": ([0, 0], [-1, 0]),
    "no-segment": ([], []),
}


def random_layout(seed: int):
    """Up to 7 segments of lengths 0, 1, short and long; each may be a suffix of an earlier
    segment that is no suffix itself."""
    draw = random.Random(seed)
    lengths = [draw.choice([0, 1, draw.randint(2, 12), draw.randint(13, 40)])
               for _ in range(draw.randint(1, 7))]
    prefix_of = []
    for b in range(len(lengths)):
        prefixes = [p for p in range(b) if prefix_of[p] == -1]
        prefix_of.append(draw.choice(prefixes) if prefixes and draw.random() < 0.6 else -1)
    return lengths, prefix_of


LAYOUTS.update({f"random-{seed}": random_layout(seed) for seed in range(4)})
MIXED = "groups-and-plain"


def unshared_packing(lengths, prefix_of):
    """``(gather[Tu], own[T], cu_seqlens[U+1])``: the unshared packing as rows of the shared
    tokens (each suffix after its own copy of its prefix), and each shared token's own row."""
    bounds = cu_seqlens_of(lengths).tolist()
    gather, own, cu = [], [], [0]
    for b, p in enumerate(prefix_of):
        if p >= 0:
            gather += range(bounds[p], bounds[p + 1])
        own += range(len(gather), len(gather) + lengths[b])
        gather += range(bounds[b], bounds[b + 1])
        cu.append(len(gather))
    return (torch.tensor(gather, dtype=torch.int64), torch.tensor(own, dtype=torch.int64),
            torch.tensor(cu, dtype=torch.int32))


def make_case(layout, num_heads_q, num_heads_k, dtype, *, seed, device="cpu",
              head_dim=HEAD_DIM):
    """Leaves ``q, k, v`` (requires grad), ``cu_seqlens``, ``prefix_of``, ``max_seqlen`` and
    ``dout`` for a layout."""
    lengths, parents = layout
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    q, k, v, dout = (torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype)
                     for heads in (num_heads_q, num_heads_k, num_heads_k, num_heads_q))
    for x in (q, k, v):
        x.requires_grad_()
    prefix_of = torch.tensor(parents, dtype=torch.int32, device=device)
    return q, k, v, cu_seqlens_of(lengths, device), prefix_of, max(lengths, default=0), dout


def _grads(out, leaves, dout):
    """Gradients of ``(out * dout).sum()`` (zeros where the output does not depend on a leaf)."""
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def oracle(q, k, v, layout, scale, dout):
    """``(want, baseline)``: (out, lse, dq, dk, dv) of the float64 reference on the unshared
    packing (on the CPU), and of the same math in the inputs' dtype (on their device)."""
    gather, own, cu = unshared_packing(*layout)
    leaves64 = [x.detach().to("cpu", torch.float64).requires_grad_() for x in (q, k, v)]
    out, lse = varlen_attention_reference(*(x[gather] for x in leaves64), cu, causal=True,
                                          softmax_scale=scale)
    out, lse = out[own], lse[:, own]
    want = (out, lse, *_grads(out, leaves64, dout.to("cpu", torch.float64)))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    gather, own = gather.to(q.device), own.to(q.device)
    out, lse = attention_in_dtype(*(x[gather] for x in leaves), cu.to(q.device), True, scale)
    out, lse = out[own], lse[:, own]
    return want, (out, lse, *_grads(out, leaves, dout))


def assert_matches_oracle(results, q, k, v, layout, scale, dout, context):
    """``results`` = (out, lse, dq, dk, dv) within flash-attention's tolerance of the oracle;
    returns the max error of each."""
    want, baseline = oracle(q, k, v, layout, scale, dout)
    magnitude = max(max_error(x, torch.zeros_like(x)) for x in (want[0], *want[2:]))
    errors = {}
    for name, got, expected, base in zip(("out", "lse", "dq", "dk", "dv"), results, want,
                                         baseline):
        factor = 2 if name in ("out", "lse") else 3
        assert_within(name, got, expected, base, factor, context,
                      magnitude if name != "lse" else 1.0)
        errors[name] = max_error(got, expected)
    return errors


def run_public(q, k, v, cu, prefix_of, max_seqlen, dout, backend, **kwargs):
    """(out, lse, dq, dk, dv) of the public function."""
    out, lse = varlen_attention(q, k, v, cu, max_seqlen, prefix_of=prefix_of, return_lse=True,
                                backend=backend, **kwargs)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    return (out, lse, *_grads(out, (q, k, v), dout))


def run_kernels(kernels, q, k, v, cu, prefix_of, max_seqlen, scale, dout):
    """``kernels`` = (prefix_forward, prefix_backward) called directly on NaN-filled outputs:
    every element written and finite; returns (out, lse, dq, dk, dv)."""
    forward, backward = kernels
    q, k, v = (x.detach() for x in (q, k, v))
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, device=q.device)
    forward(q, k, v, cu, prefix_of, max_seqlen, scale, False, out, lse)
    grads = [torch.full_like(x, math.nan) for x in (q, k, v)]
    backward(dout, q, k, v, out, lse, cu, prefix_of, max_seqlen, scale, False, *grads)
    results = (out, lse, *grads)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), results):
        assert torch.isfinite(x).all(), f"{name}: elements left unwritten (NaN) or non-finite"
    return results


def check_case(layout_name, backend, dtype=torch.bfloat16, gqa=(4, 2), *, device="cpu"):
    """One layout on one backend against the oracle; returns the max errors."""
    layout = LAYOUTS[layout_name]
    seed = zlib.crc32(f"{layout_name}-{dtype}-{gqa}".encode())
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, *gqa, dtype, seed=seed,
                                                         device=device)
    results = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, backend)
    context = f"(backend={backend}, layout={layout_name}, dtype={dtype}, gqa={gqa})"
    return assert_matches_oracle(results, q, k, v, layout, HEAD_DIM ** -0.5, dout, context)


# ---------------------------------------------------------------------------------------------
# Against the float64 oracle.

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_layout_matches_unshared_float64(layout_name, backend):
    """Every layout (one or several suffixes, groups mixed with plain sequences, empty prefix
    and suffixes, length 1, odd lengths, non-adjacent suffixes, random ones), bf16, GQA 4:2."""
    if backend == "triton" and layout_name.startswith("random-"):
        pytest.skip("the interpreter is slow: the fixed layouts cover the triton backend")
    check_case(layout_name, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"{g[0]}:{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_and_gqa_match_unshared_float64(dtype, gqa, backend):
    check_case(MIXED, backend, dtype, gqa)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_generic_path_matches_unshared_float64(dtype, backend):
    """The generic LSE-merge path forced on each backend (whatever its native prefix mode),
    its kernels called directly on poisoned outputs."""
    for layout_name in (MIXED, "non-adjacent", "empty-prefix"):
        layout = LAYOUTS[layout_name]
        q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, dtype, seed=41)
        scale = HEAD_DIM ** -0.5
        results = run_kernels(generic_kernels(BACKENDS[backend]), q, k, v, cu, prefix_of,
                              max_seqlen, scale, dout)
        assert_matches_oracle(results, q, k, v, layout, scale, dout,
                              f"(generic path on {backend}, {layout_name}, {dtype})")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("softmax_scale", [0.0, 0.3, 1.0])
def test_softmax_scale(softmax_scale, backend):
    """Any scale, 0 included (uniform attention over prefix and own keys)."""
    layout = LAYOUTS["one-prefix-several-suffixes"]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.float32, seed=42)
    results = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, backend,
                         softmax_scale=softmax_scale)
    assert_matches_oracle(results, q, k, v, layout, softmax_scale, dout, f"(scale {softmax_scale})")


def test_gradcheck_reference():
    """``torch.autograd.gradcheck`` of the reference backend's prefix mode (float64 leaves
    around the op, which takes float32 at most and computes in float32: hence the loose eps
    and tolerances), on a small layout with GQA, an empty suffix and two groups."""
    layout = ([3, 2, 0, 2, 2, 1], [-1, 0, 0, -1, 3, 3])
    q, k, v, cu, prefix_of, max_seqlen, _ = make_case(layout, 2, 1, torch.float32, seed=43,
                                                      head_dim=4)

    def attention(q64, k64, v64):
        out = varlen_attention(q64.float(), k64.float(), v64.float(), cu, max_seqlen,
                               prefix_of=prefix_of, backend="reference")
        return out.double()

    leaves = [x.detach().double().mul(0.5).requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(attention, leaves, eps=1e-3, atol=2e-3, rtol=2e-3)


def test_reference_is_float32_exact():
    """The reference backend's prefix mode in float32 is within a few float32 roundings of
    the float64 oracle (not merely within the in-dtype baseline)."""
    layout = LAYOUTS[MIXED]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.float32, seed=44)
    results = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, "reference")
    want, _ = oracle(q, k, v, layout, HEAD_DIM ** -0.5, dout)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv"), results, want):
        scale = max(1.0, max_error(expected, torch.zeros_like(expected)))
        assert max_error(got, expected) <= 1e-5 * scale, name


# ---------------------------------------------------------------------------------------------
# Kernels, determinism, dispatch.

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_poisoned_outputs(backend):
    """The kernels the registered ops run (``prefix_kernels``), called directly on NaN-filled
    out, lse, dq, dk, dv, write every element, with the public function's bits."""
    layout = LAYOUTS["non-adjacent"]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.bfloat16, seed=45)
    public = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, backend)
    direct = run_kernels(prefix_kernels(BACKENDS[backend]), q, k, v, cu, prefix_of, max_seqlen,
                         HEAD_DIM ** -0.5, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), direct, public):
        assert torch.equal(a, b), f"{name}: differs from the public function's result"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_deterministic_is_bitwise_reproducible(backend):
    """deterministic=True twice: the same bits (GQA 4:1, a prefix with several suffixes)."""
    layout = LAYOUTS[MIXED]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 1, torch.bfloat16, seed=46)
    first, second = (run_public(q, k, v, cu, prefix_of, max_seqlen, dout, backend,
                                deterministic=True) for _ in range(2))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_sharing_is_the_plain_op(backend):
    """prefix_of all -1: the plain op's results (bitwise on the generic path, which is then its
    self pass alone)."""
    layout = LAYOUTS["no-sharing"]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.bfloat16, seed=47)
    shared = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, backend)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen, return_lse=True, backend=backend)
    plain = (out, lse, *_grads(out, (q, k, v), dout))
    exact = BACKENDS[backend].prefix_forward is None
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), shared, plain):
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")


def test_layout_of_the_cross_pass():
    """The groups of the cross pass: one per prefix with suffix tokens, its suffixes' tokens in
    packed order; empty prefixes, empty suffixes and garbage entries have none."""
    lengths, parents = [4, 2, 3, 0, 5, 2, 1], [-1, 0, -1, 0, 2, 0, 9]
    layout = prefix_layout(cu_seqlens_of(lengths), torch.tensor(parents, dtype=torch.int32), 17)
    assert layout.query_index.tolist() == [4, 5, 14, 15, 9, 10, 11, 12, 13]
    assert layout.key_index.tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert layout.cu_q.tolist() == [0, 4, 9] and layout.cu_k.tolist() == [0, 4, 7]
    assert layout.groups == ((0, 4, 0, 4), (4, 9, 4, 7)) and (layout.max_q, layout.max_k) == (5, 4)
    nested = prefix_layout(cu_seqlens_of([2, 2, 2]), torch.tensor([-1, 0, 1], dtype=torch.int32), 6)
    assert nested.query_index.tolist() == [2, 3]  # segment 2's prefix is a suffix: read as -1


def test_the_layout_is_built_once_per_pair_of_tensors():
    """The generic path's layout (a host sync on a GPU) is kept per (cu_seqlens, prefix_of)
    tensors, the layers of a step sharing it, and rebuilt when either changes in place."""
    cu, prefix_of = cu_seqlens_of([4, 2, 3]), torch.tensor([-1, 0, 0], dtype=torch.int32)
    first = cached_prefix_layout(cu, prefix_of, 9)
    assert cached_prefix_layout(cu, prefix_of, 9) is first
    assert cached_prefix_layout(cu.clone(), prefix_of, 9) is not first  # another tensor
    prefix_of[2] = -1  # in place: the layout has one suffix fewer
    assert cached_prefix_layout(cu, prefix_of, 9).query_index.tolist() == [4, 5]


def test_torch_compile_fullgraph():
    """One graph through dynamo (the prefix ops, their fakes and autograd registration,
    validate_prefix_of; AOT autograd without inductor, which the plain op's test already
    covers); forward and backward equal eager's."""
    torch._dynamo.reset()
    layout = LAYOUTS["one-prefix-several-suffixes"]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.float32, seed=48)

    def step(q, k, v, cu, prefix_of):
        out = varlen_attention(q * 1.5, k, v, cu, max_seqlen, prefix_of=prefix_of)
        return (out * dout).sum()

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, cu, prefix_of)
    got_grads = torch.autograd.grad(got, (q, k, v))
    want = step(q, k, v, cu, prefix_of)
    want_grads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["reference", "cpu_flash"])
def test_opcheck(backend):
    """torch.library.opcheck on the prefix ops and validate_prefix_of."""
    layout = ([3, 0, 5, 2, 1], [-1, 0, 0, -1, 3])
    q, k, v, cu, prefix_of, max_seqlen, _ = make_case(layout, 4, 2, torch.float32, seed=49)
    ops = torch.ops.agentrl_fast
    torch.library.opcheck(ops.varlen_attention_prefix_forward.default,
                          (q, k, v, cu, prefix_of, max_seqlen, 0.3, False, backend))
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = ops.varlen_attention_prefix_forward(q, k, v, cu, prefix_of, max_seqlen, 0.3, False,
                                                   backend)
    torch.library.opcheck(ops.varlen_attention_prefix_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu, prefix_of, max_seqlen,
                           0.3, False, backend))
    torch.library.opcheck(ops.validate_prefix_of.default, (prefix_of,))


# ---------------------------------------------------------------------------------------------
# On CUDA.

GPU_CASES = [(MIXED, torch.bfloat16, (4, 2)), ("non-adjacent", torch.float16, (4, 1)),
             ("odd-lengths", torch.bfloat16, (2, 2)), ("empty-prefix", torch.bfloat16, (4, 2))]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "flash_attn", "triton", "reference"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def test_cuda_backend_matches_unshared_float64(case, backend):
    """The CUDA backends' prefix mode (torch, flash_attn: the generic path over their raw
    varlen kernels; triton: its own or the generic path) against the oracle, and the
    kernels on poisoned outputs."""
    cuda_backend(backend)
    layout_name, dtype, gqa = case
    check_case(layout_name, backend, dtype, gqa, device="cuda")
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(LAYOUTS[layout_name], *gqa, dtype,
                                                         seed=50, device="cuda")
    results = run_kernels(prefix_kernels(BACKENDS[backend]), q, k, v, cu, prefix_of, max_seqlen,
                          HEAD_DIM ** -0.5, dout)
    assert_matches_oracle(results, q, k, v, LAYOUTS[layout_name], HEAD_DIM ** -0.5, dout,
                          f"(kernels of {backend} on cuda)")


# One prefix of several key tiles and suffixes of several query blocks (and none), a plain
# sequence after them: on a GPU the prefix's dk/dv tiles are split over several programs.
SPLIT_LAYOUT = ([300, 70, 1, 129, 0, 64, 33, 50], [-1, 0, 0, 0, 0, 0, 0, -1])


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_triton_prefix_kernels_split_a_prefix_across_programs(head_dim, deterministic):
    """Triton's own prefix kernels on CUDA at the hot head dims, with each prefix tile's dk/dv
    split over several programs (the float32 sums added in a fixed order), against the oracle;
    where a GPU has not shown the backward right, its refusal."""
    from agentrl_fast.kernels import varlen_attention as kernels
    from agentrl_fast.ops import varlen_attention_triton as launcher

    cuda_backend("triton")
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(SPLIT_LAYOUT, 4, 2, torch.bfloat16,
                                                         seed=52, device="cuda",
                                                         head_dim=head_dim)
    if head_dim > launcher.GPU_CHECKED_BACKWARD_HEAD_DIM:
        with pytest.raises(ValueError, match=f"its backward at head_dim {head_dim}"):
            varlen_attention(q, k, v, cu, max_seqlen, prefix_of=prefix_of, backend="triton")
        return
    config = kernels.backward_config("bf16", head_dim)
    facts = launcher.prefix_dkdv_table(cu, prefix_of, q.shape[0], config["BLOCK"],
                                       config["STEP"])[-1]
    assert launcher.prefix_dkdv_splits(facts, 2, 2, q.device) > 1
    results = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, "triton",
                         deterministic=deterministic)
    assert_matches_oracle(results, q, k, v, SPLIT_LAYOUT, head_dim ** -0.5, dout,
                          f"(triton on cuda, D {head_dim}, deterministic={deterministic})")


@pytest.mark.gpu
def test_cuda_garbage_prefix_of_does_not_crash():
    """validate=False with garbage prefix_of on CUDA: no crash, no device fault."""
    layout = LAYOUTS[MIXED]
    for backend in ("reference", "torch", "flash_attn", "triton"):
        if BACKENDS[backend].unavailable(torch.device("cuda")) is not None:
            continue
        q, k, v, cu, _, max_seqlen, dout = make_case(layout, 4, 2, torch.bfloat16, seed=51,
                                                     device="cuda")
        for bad in ([5, -7, 2**31 - 1, 0, 1, 9, -2**31, 3, 3, 3], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]):
            prefix_of = torch.tensor(bad, dtype=torch.int32, device="cuda")
            out = varlen_attention(q, k, v, cu, max_seqlen, prefix_of=prefix_of, backend=backend,
                                   validate=False)
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Bad input (in child processes).

PRELUDE = textwrap.dedent("""
    import math
    import torch
    from agentrl_fast.ops import varlen_attention
    from agentrl_fast.ops.varlen_attention import BACKENDS
    from agentrl_fast.ops._varlen_attention_prefix import generic_kernels, prefix_kernels

    torch.set_num_threads(1)  # (this child's own: tiny ops on a loaded 2-core runner)
    T, Hq, Hk, D = 9, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    q = torch.randn(T, Hq, D, generator=g)
    k = torch.randn(T, Hk, D, generator=g)
    v = torch.randn(T, Hk, D, generator=g)
    CPU = ["reference", "native", "cpu_flash"]

    def of(*values):
        return torch.tensor(values, dtype=torch.int32)

    def attn(prefix_of=of(-1, 0, 0), cu_seqlens=cu, **kwargs):
        return varlen_attention(q, k, v, cu_seqlens, 4, prefix_of=prefix_of, **kwargs)

    def garbage(prefix_of, cu_seqlens=cu, num_tokens=T):
        '''Unvalidated forward (with the LSE) and backward on every CPU backend, then its
        prefix kernels and the generic path's called directly.'''
        for name in CPU:
            leaves = [torch.randn(num_tokens, n, D, generator=g).requires_grad_()
                      for n in (Hq, Hk, Hk)]
            out, lse = varlen_attention(*leaves, cu_seqlens, 4, prefix_of=prefix_of,
                                        return_lse=True, validate=False, backend=name)
            out.sum().backward()
            x = [l.detach() for l in leaves]
            for forward, backward in (prefix_kernels(BACKENDS[name]),
                                      generic_kernels(BACKENDS[name])):
                out, lse = torch.empty_like(x[0]), torch.empty(Hq, num_tokens)
                forward(*x, cu_seqlens, prefix_of, 4, 0.5, False, out, lse)
                grads = [torch.empty_like(t) for t in x]
                backward(torch.ones_like(out), *x, out, lse, cu_seqlens, prefix_of, 4, 0.5,
                         False, *grads)
""")

CASES = {
    "valid_baseline": ("NoError", "", (
        "[attn(backend=name, return_lse=True) for name in CPU]; "
        "attn(of(-1, -1, 1)); attn(of(-1, -1, -1), softmax_scale=0.5); "
        "varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, 4, prefix_of=of(-1, 0, 0))")),
    # metadata
    "prefix_of_list": ("TypeError", "prefix_of must be a torch.Tensor, got list",
                       "attn(prefix_of=[-1, 0, 0])"),
    "prefix_of_int64": ("TypeError", ("prefix_of must be torch.int32, got torch.int64; pass "
                        "prefix_of.to(torch.int32)"), "attn(of(-1, 0, 0).long())"),
    "prefix_of_float": ("TypeError", "prefix_of must be torch.int32, got torch.float32",
                        "attn(of(-1, 0, 0).float())"),
    "prefix_of_2d": ("ValueError", ("prefix_of must be 1-D [B] with B = cu_seqlens.numel() - 1 = 3 "
                     "segments, got shape (1, 3)"), "attn(of(-1, 0, 0)[None])"),
    "prefix_of_short": ("ValueError", ("prefix_of must be 1-D [B] with B = cu_seqlens.numel() - 1 = "
                        "3 segments, got shape (2,)"), "attn(of(-1, 0))"),
    "prefix_of_long": ("ValueError", "got shape (4,)", "attn(of(-1, 0, 0, 0))"),
    "prefix_of_long_unvalidated": ("ValueError", "got shape (4,)",
                                   "attn(of(-1, 0, 0, 0), validate=False)"),
    "prefix_of_other_device": ("ValueError", "prefix_of must be on cpu like q, got meta",
                               "attn(of(-1, 0, 0).to('meta'))"),
    "prefix_of_non_causal": ("ValueError", ("prefix_of needs causal=True (a suffix attends causally "
                             "to its own tokens), got causal=False with prefix_of"),
                             "attn(causal=False)"),
    "prefix_of_non_causal_unvalidated": ("ValueError", "causal=False with prefix_of",
                                         "attn(causal=False, validate=False)"),
    # values
    "prefix_of_first_not_minus_one": ("ValueError", ("prefix_of[0] = 0 is out of range: it must "
                                      "be -1 (segment 0 has no earlier segment)"),
                                      "attn(of(0, -1, -1))"),
    "prefix_of_itself": ("ValueError", ("prefix_of[1] = 1 is out of range: it must be -1 (no "
                         "prefix) or an earlier segment's index in 0..0"), "attn(of(-1, 1, 0))"),
    "prefix_of_later": ("ValueError", "prefix_of[1] = 2 is out of range", "attn(of(-1, 2, -1))"),
    "prefix_of_below_minus_one": ("ValueError", "prefix_of[2] = -2 is out of range",
                                  "attn(of(-1, 0, -2))"),
    "prefix_of_huge": ("ValueError", "prefix_of[2] = 2147483647 is out of range",
                       "attn(of(-1, -1, 2**31 - 1))"),
    "prefix_of_nested": ("ValueError", ("prefix_of[2] = 1 names segment 1, which is itself a "
                         "suffix (prefix_of[1] = 0); a prefix must have prefix_of = -1"),
                         "attn(of(-1, 0, 1))"),
    "prefix_of_bad_cu_first": ("ValueError", "cu_seqlens[0] must be 0",
                               "attn(cu_seqlens=of(1, 3, 5, 9))"),
    # validate=False: garbage never crashes (results unspecified)
    "unvalidated_prefix_of_out_of_range": ("NoError", "", (
        "garbage(of(5, -7, 2**31 - 1)); garbage(of(-2**31, 2**31 - 1, -1)); "
        "garbage(of(0, 1, 2)); garbage(of(2, 2, 2))")),
    "unvalidated_prefix_of_nested": ("NoError", "", "garbage(of(-1, 0, 1))"),
    "unvalidated_prefix_of_and_cu": ("NoError", "", (
        "garbage(of(-1, 0, 0), cu_seqlens=of(0, 7, 2, 9)); "
        "garbage(of(-1, 0, 1), cu_seqlens=of(-3, 10**9, -5, 4)); "
        "garbage(of(-1, 0, 0), cu_seqlens=of(4, 3, 2, 1))")),
    "unvalidated_prefix_of_random_long": ("NoError", "", (
        "n = 120; "
        "bad = torch.randint(-(2**31), 2**31 - 1, (25,), generator=g, dtype=torch.int64).to(torch.int32); "
        "bad[::3] = torch.randint(-1, 12, (9,), generator=g).to(torch.int32); "
        "cuts = torch.randint(0, n + 1, (24,), generator=g).sort().values.to(torch.int32); "
        "garbage(bad[1:], cu_seqlens=torch.cat([of(0), cuts[:-1], of(n)]), num_tokens=n)")),
}

outcomes, test_bad_input_raises = bad_input_tests(
    PRELUDE, CASES, [n for n, c in CASES.items() if c[0] != "NoError"])

test_call_returns, test_unvalidated_garbage_child_exits_cleanly = no_error_tests(PRELUDE, CASES)
