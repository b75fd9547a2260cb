"""Attention over packed trajectories (``agentrl_fast.ops.varlen_attention``) against the float64
per-sequence computation ``agentrl_fast.ops.reference.varlen_attention_reference``.

Tolerances follow flash-attention's rule (STYLE.md, CONTRIBUTING.md): our error against the
float64 reference may be at most 2x (forward) / 3x (backward) the error of the same math done by
PyTorch in the input dtype (``attention_in_dtype``), plus a tiny absolute floor, so they scale with
the dtype instead of being magic numbers.

The CPU backends (``reference``; ``native``: our C++ kernel, the CPU default; ``cpu_flash``:
torch's fused CPU kernel on length-bucketed padded batches) run everywhere; the ``torch``,
``flash_attn`` and ``triton`` (our Triton kernels) backends on CUDA in the tests marked ``gpu``
(the flash_attn ones skip when flash-attn is not installed). On CUDA the float64 reference is
built on the GPU. The Triton backend runs on the CPU under the interpreter in
``tests/interpret/test_varlen_attention_triton*.py``. Bad inputs and ``validate=False`` with
garbage ``cu_seqlens`` are in ``test_varlen_attention_errors.py``.
"""

import math
import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl_fast.ops import varlen_attention
from agentrl_fast.ops.reference import varlen_attention_reference
from agentrl_fast.ops.varlen_attention import (_NATIVE_VECTORISED, BACKENDS, CPU_FLASH_FROM_KEYS,
                                               available_backends, mean_keys, resolve_backend)
from agentrl_fast.ops.varlen_attention_triton import GPU_CHECKED_BACKWARD_HEAD_DIM

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LOW_PRECISION = [torch.bfloat16, torch.float16]
GQA = [(4, 1), (4, 2), (2, 2)]  # (Hq, Hk): 4:1, 2:1, 1:1
MIXED_LENGTHS = [0, 1, 7, 113, 0, 203, 0]  # odd lengths, length 1, empty sequences (first/last too)
LONG_LENGTHS = [600]  # one long sequence
ODD_HEAD_DIM = 59
FLOOR = 1e-5  # the tiny absolute floor of every tolerance (keeps an fp32 tolerance above 0)

@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """These tests run many tiny matmuls, which one thread does fastest; torch's intra-op pool
    spins and, on a loaded 2-core runner, made this module 5-10x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Helpers.

def cu_seqlens_of(lengths, device="cpu") -> torch.Tensor:
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def make_inputs(lengths, num_heads_q, num_heads_k, head_dim, dtype, *, seed, device="cpu",
                requires_grad=True):
    """``(q[T, Hq, D], k[T, Hk, D], v[T, Hk, D], cu_seqlens, max_seqlen)`` with random contents."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    q, k, v = (torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype)
               for heads in (num_heads_q, num_heads_k, num_heads_k))
    if requires_grad:
        for x in (q, k, v):
            x.requires_grad_()
    return q, k, v, cu_seqlens_of(lengths, device), max(lengths, default=0)


def attention_in_dtype(q, k, v, cu_seqlens, causal, scale):
    """The same math done by PyTorch in the inputs' dtype, per sequence (flash-attention's
    ``attention_ref`` without upcasting): the baseline error our tolerance is a multiple of.
    Differentiable, so its gradients are the backward baseline. ``out[T, Hq, D]``, ``lse[Hq, T]``."""
    groups = q.shape[1] // k.shape[1]
    outs = [q.new_zeros(0, q.shape[1], q.shape[2])]
    lses = [q.new_zeros(q.shape[1], 0)]
    cu = cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        if start == end:
            continue
        qs = q[start:end].transpose(0, 1)                                    # [Hq, L, D]
        ks = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale                 # [Hq, L, L]
        if causal:
            future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, -math.inf)
        lses.append(torch.logsumexp(scores, dim=-1))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1)


def max_error(got, want) -> float:
    if got.numel() == 0:
        return 0.0
    return float((got.detach().to("cpu", torch.float64) - want.detach().to("cpu", torch.float64)).abs().max())


def rounding_atol(want, dtype) -> float:
    """flash-attention's ``atol``: twice the rounding error of ``dtype`` at the result's magnitude
    (shifted by 0.3), the least any implementation that returns ``dtype`` can promise; on tiny
    cases the baseline can beat its own rounding by luck."""
    x = want.detach().to(dtype)
    return 2 * max_error((x + 0.3) - 0.3, x)


def assert_within(name, got, want, baseline, factor, context="", magnitude=1.0):
    """``|got - want| <= factor * |baseline - want| + rounding_atol + FLOOR * magnitude`` (max
    norms), no NaN, same shape. ``magnitude`` (at least 1) is the largest value of the case's
    results: fp32's cancellation errors scale with it where the true value is 0 (a one-token
    sequence's dk, which PyTorch's softmax backward gets exactly)."""
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64 = got.detach().to("cpu", torch.float64)
    assert not torch.isnan(got64).any(), f"{name}: NaN in the output {context}"
    baseline_error, atol = max_error(baseline, want), rounding_atol(want, got.dtype)
    floor = FLOOR * max(1.0, magnitude)
    error, allowed = max_error(got, want), factor * baseline_error + atol + floor
    assert error <= allowed, (f"{name}: max error {error:.3g} > {factor} x baseline error "
                              f"{baseline_error:.3g} + rounding {atol:.3g} + floor {floor:.3g} {context}")


def reference_float64(q, k, v, cu_seqlens, causal, scale, *, batched=None):
    """``(leaves, out, lse)``: float64 leaves (copies of q, k, v on their device) and the
    float64 reference computed from them: ``varlen_attention_reference`` on the CPU; elsewhere
    (``batched``, default: off the CPU) the same math batched over heads on the device
    (``attention_in_dtype`` in float64, checked against the reference by
    ``test_batched_float64_reference_matches_the_reference``), so GPU tests build no CPU copy."""
    leaves = [x.detach().to(torch.float64).requires_grad_() for x in (q, k, v)]
    if batched is None:
        batched = q.device.type != "cpu"
    if batched:
        return (leaves, *attention_in_dtype(*leaves, cu_seqlens, causal, scale))
    return (leaves, *varlen_attention_reference(*leaves, cu_seqlens, causal=causal,
                                                softmax_scale=scale))


def check_poisoned_kernels(backend, q, k, v, cu_seqlens, max_seqlen, causal, scale, dout,
                           results, deterministic=False):
    """The backend's kernels called directly on NaN-filled out, lse, dq, dk, dv write every
    element, with the bits of ``results`` = (out, lse, dq, dk, dv) of the public function
    (which runs these very kernels on the same inputs), except the atomic dq of the Triton
    backward on a GPU (not ``deterministic``): its float32 additions come in a different order
    each run, so it is compared within float32 rounding of the sum and one rounding of its
    dtype."""
    kernels = BACKENDS[backend]
    atomic_dq = backend == "triton" and q.is_cuda and not deterministic
    q, k, v = (x.detach() for x in (q, k, v))
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, device=q.device)
    kernels.forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, False, out, lse)
    grads = [torch.full_like(x, math.nan) for x in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale,
                     deterministic, *grads)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), results):
        assert torch.isfinite(got).all(), f"{name}: elements left unwritten (NaN) or non-finite"
        if name == "dq" and atomic_dq:
            torch.testing.assert_close(got, want, rtol=2 * torch.finfo(got.dtype).eps,
                                       atol=1e-5 * float(want.abs().max()))
            continue
        assert torch.equal(got, want), f"{name}: differs from the public function's result"


def run_and_compare(q, k, v, cu_seqlens, max_seqlen, *, causal, backend, softmax_scale=None,
                    seed=0, poison=False, **kwargs):
    """Run ``varlen_attention`` forward and backward and compare out, LSE and the gradients of q,
    k, v against the float64 reference, with tolerances scaled by ``attention_in_dtype``'s error;
    with ``poison``, also ``check_poisoned_kernels``."""
    scale = q.shape[2] ** -0.5 if softmax_scale is None else softmax_scale
    context = (f"(backend={backend}, dtype={q.dtype}, causal={causal}, Hq={q.shape[1]}, "
               f"Hk={k.shape[1]}, D={q.shape[2]}, cu_seqlens={cu_seqlens.tolist()[:10]})")
    out, lse = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal,
                                softmax_scale=softmax_scale, return_lse=True, backend=backend,
                                **kwargs)
    assert out.dtype == q.dtype and out.device == q.device
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[1], q.shape[0])
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    leaves64, out64, lse64 = reference_float64(q, k, v, cu_seqlens, causal, scale)
    grads64 = (torch.autograd.grad(out64, leaves64, dout.to(torch.float64), allow_unused=True)
               if out64.requires_grad else (None,) * 3)  # (no sequence: the reference returns zeros)
    grads64 = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves64, grads64)]

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out_pt, lse_pt = attention_in_dtype(*leaves, cu_seqlens, causal, scale)
    grads_pt = (torch.autograd.grad(out_pt, leaves, dout, allow_unused=True)
                if out_pt.requires_grad else (None,) * 3)
    grads_pt = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads_pt)]

    magnitude = max(max_error(x, torch.zeros_like(x)) for x in (out64, *grads64))
    assert_within("out", out, out64, out_pt, 2, context, magnitude)
    assert_within("lse", lse, lse64, lse_pt, 2, context)
    for name, got, want, baseline in zip(("dq", "dk", "dv"), (dq, dk, dv), grads64, grads_pt):
        assert got.dtype == q.dtype
        assert_within(name, got, want, baseline, 3, context, magnitude)
    if poison:
        check_poisoned_kernels(backend, q, k, v, cu_seqlens, max_seqlen, causal, scale, dout,
                               (out, lse, dq, dk, dv), kwargs.get("deterministic", False))
    return out, lse, (dq, dk, dv)


def cuda_backend(name):
    """Skip unless backend ``name`` can run on CUDA here (the gpu marker already skips without
    CUDA; flash_attn also needs the package)."""
    if name == "flash_attn":
        pytest.importorskip("flash_attn")
    reason = BACKENDS[name].unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"backend {name!r} unavailable: {reason}")
    return name


GPU_BACKENDS = [pytest.param("reference", marks=pytest.mark.gpu, id="reference-cuda"),
                pytest.param("torch", marks=pytest.mark.gpu, id="torch-cuda"),
                pytest.param("flash_attn", marks=pytest.mark.gpu, id="flash_attn-cuda"),
                pytest.param("triton", marks=pytest.mark.gpu, id="triton-cuda")]
CPU_BACKENDS = ["reference", "native", "cpu_flash"]
ALL_BACKENDS = [pytest.param("reference", id="reference-cpu"),
                pytest.param("native", id="native-cpu"),
                pytest.param("cpu_flash", id="cpu_flash-cpu"), *GPU_BACKENDS]


def setup_backend(backend, request) -> str:
    """The device of an ALL_BACKENDS parameter: the CPU for the plain one, CUDA for the gpu-marked
    ones (skipped when that backend cannot run there)."""
    if request.node.get_closest_marker("gpu") is None:
        return "cpu"
    cuda_backend(backend)
    return "cuda"


# ---------------------------------------------------------------------------------------------
# Against the float64 reference: the grid of the issue.

REFERENCE_GRID = (
    # every dtype x causal x GQA ratio, at D = 64, mixed lengths
    [(MIXED_LENGTHS, dtype, causal, gqa, 64)
     for dtype in DTYPES for causal in (True, False) for gqa in GQA]
    # D = 128 and an odd D
    + [(MIXED_LENGTHS, dtype, causal, (4, 2), head_dim)
       for head_dim in (128, ODD_HEAD_DIM) for dtype in DTYPES for causal in (True, False)]
    # one long sequence
    + [(LONG_LENGTHS, dtype, causal, (2, 1), 64) for dtype in DTYPES for causal in (True, False)]
)


def _grid_id(case):
    lengths, dtype, causal, (hq, hk), head_dim = case
    kind = "long" if lengths is LONG_LENGTHS else "mixed"
    return f"{kind}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-gqa{hq}:{hk}-D{head_dim}"


def check_grid_case(case, backend):
    """One grid case on the CPU (seeded from its id) against the float64 reference; shared with
    the Triton interpreter tests."""
    lengths, dtype, causal, (hq, hk), head_dim = case
    seed = zlib.crc32(_grid_id(case).encode())
    q, k, v, cu, max_seqlen = make_inputs(lengths, hq, hk, head_dim, dtype, seed=seed)
    run_and_compare(q, k, v, cu, max_seqlen, causal=causal, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", REFERENCE_GRID, ids=_grid_id)
def test_cpu_backend_matches_float64(backend, case):
    check_grid_case(case, backend)


GPU_GRID = (
    [(MIXED_LENGTHS, dtype, causal, gqa, head_dim)
     for dtype in LOW_PRECISION for causal in (True, False) for gqa in GQA for head_dim in (64, 128)]
    + [(LONG_LENGTHS, dtype, causal, (2, 1), 64) for dtype in LOW_PRECISION for causal in (True, False)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "flash_attn"])
@pytest.mark.parametrize("case", GPU_GRID, ids=_grid_id)
def test_cuda_backend_matches_float64(backend, case):
    """torch's varlen attention and flash-attn (bf16/fp16; their kernels take no fp32 and no odd
    D), forward, LSE and gradients, against the float64 reference."""
    cuda_backend(backend)
    lengths, dtype, causal, (hq, hk), head_dim = case
    q, k, v, cu, max_seqlen = make_inputs(lengths, hq, hk, head_dim, dtype, seed=3, device="cuda")
    run_and_compare(q, k, v, cu, max_seqlen, causal=causal, backend=backend)


# The Triton backend on CUDA. Each (dtype, padded D, even D) and each integer argument equal to
# 1 or divisible by 16 (causal, Hk, the GQA group, strides, T) is a JIT compile of its own (~1-2
# s each), so the grid shares the configurations the other CUDA tests here compile anyway (the
# ALL_BACKENDS tests and test_auto_on_cuda_...): bf16 at D = 64 takes every GQA ratio x causal;
# fp16 and fp32 causal and not at 4:2; D = 128 and the odd D causal at 4:2; the long sequence
# at 2:1 (compiled as 4:1). About 24 forward/backward compiles for the whole file.
TRITON_GPU_GRID = (
    [(MIXED_LENGTHS, torch.bfloat16, causal, gqa, 64) for causal in (True, False) for gqa in GQA]
    + [(MIXED_LENGTHS, dtype, causal, (4, 2), 64)
       for dtype in (torch.float16, torch.float32) for causal in (True, False)]
    + [(MIXED_LENGTHS, torch.bfloat16, True, (4, 2), head_dim) for head_dim in (128, ODD_HEAD_DIM)]
    + [(LONG_LENGTHS, torch.bfloat16, causal, (2, 1), 64) for causal in (True, False)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TRITON_GPU_GRID, ids=_grid_id)
def test_cuda_triton_matches_float64(case):
    """Our Triton kernels on CUDA (odd lengths, length 1, empty sequences): forward, LSE and
    gradients against the float64 reference (flash-attention's tolerance), and the kernels
    called directly on NaN-poisoned outputs write every element, with the public function's
    bits."""
    cuda_backend("triton")
    lengths, dtype, causal, (hq, hk), head_dim = case
    seed = zlib.crc32(_grid_id(case).encode())
    q, k, v, cu, max_seqlen = make_inputs(lengths, hq, hk, head_dim, dtype, seed=seed,
                                          device="cuda")
    if head_dim > GPU_CHECKED_BACKWARD_HEAD_DIM:  # the backward is refused there (for now)
        with pytest.raises(ValueError, match=f"its backward at head_dim {head_dim}"):
            varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend="triton")
        with torch.no_grad():  # the forward alone still runs, and is right
            out = varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend="triton")
        _, out64, _ = reference_float64(q, k, v, cu, causal, head_dim ** -0.5)
        _, out_pt, _ = attention_in_dtype(q.detach(), k.detach(), v.detach(), cu, causal,
                                          head_dim ** -0.5)
        assert_within("out", out, out64, out_pt, 2, f"(D={head_dim})")
        return
    run_and_compare(q, k, v, cu, max_seqlen, causal=causal, backend="triton", poison=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_poisoned_kernel_check_on_the_cpu(backend):
    """``run_and_compare(poison=True)`` (what the Triton grid on CUDA runs) on the CPU kernels."""
    q, k, v, cu, max_seqlen = make_inputs([0, 1, 7, 40, 0], 4, 2, 16, torch.bfloat16, seed=25)
    run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend=backend, poison=True)


@pytest.mark.parametrize("causal", [True, False])
def test_batched_float64_reference_matches_the_reference(causal):
    """The float64 reference the CUDA tests build on the GPU (``attention_in_dtype`` in float64)
    is ``varlen_attention_reference``: out, LSE and gradients to float64 rounding."""
    q, k, v, cu, _ = make_inputs([0, 1, 7, 30, 0, 12], 4, 2, 16, torch.float32, seed=26)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(27), dtype=torch.float64)
    results = []
    for batched in (False, True):
        leaves, out, lse = reference_float64(q, k, v, cu, causal, 0.3, batched=batched)
        results.append((out, lse, *torch.autograd.grad(out, leaves, dout)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert a.dtype == b.dtype == torch.float64, name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, ODD_HEAD_DIM])
def test_reference_backend_on_cuda(dtype, head_dim):
    q, k, v, cu, max_seqlen = make_inputs(MIXED_LENGTHS, 4, 2, head_dim, dtype, seed=4, device="cuda")
    run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,lengths", [
    (torch.float32, 64, MIXED_LENGTHS),
    (torch.bfloat16, ODD_HEAD_DIM, MIXED_LENGTHS),
    (torch.float16, 256, [5, 0, 40]),
    pytest.param(torch.bfloat16, 64, []),
    (torch.bfloat16, 64, [0, 0]),
], ids=["fp32", "odd-D", "D256", "empty-batch", "empty-sequences-only"])
def test_auto_on_cuda_accepts_every_documented_input(dtype, head_dim, lengths):
    """backend="auto" on CUDA must handle whatever the docstring accepts (fp32, any D <= 256,
    empty batches), whichever backend it picks."""
    q, k, v, cu, max_seqlen = make_inputs(lengths, 4, 2, head_dim, dtype, seed=5, device="cuda")
    run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend="auto")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_packings_match_float64(data):
    """Hypothesis draws the packing: empty sequences, length 1, a long one among short ones.

    Tiny head dims run in fp32 only: in fp16/bf16 the backward's rowsum(dout * out) term reads
    the output rounded to the dtype (as flash-attention's does), an error that does not shrink
    with D while the baseline's does, so the 3x rule stops being meaningful below flash-attention's
    own smallest D (32)."""
    length = st.one_of(st.just(0), st.just(1), st.integers(0, 12), st.integers(0, 150))
    lengths = data.draw(st.lists(length, min_size=1, max_size=8), label="lengths")
    hq, hk = data.draw(st.sampled_from(GQA + [(3, 1), (1, 1)]), label="gqa")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    head_dims = [1, 2, 8, 17, 64] if dtype == torch.float32 else [32, ODD_HEAD_DIM, 64]
    head_dim = data.draw(st.sampled_from(head_dims), label="head_dim")
    causal = data.draw(st.booleans(), label="causal")
    scale = data.draw(st.sampled_from([None, 0.05, 1.0]), label="softmax_scale")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    backend = data.draw(st.sampled_from(CPU_BACKENDS), label="backend")
    q, k, v, cu, max_seqlen = make_inputs(lengths, hq, hk, head_dim, dtype, seed=seed)
    run_and_compare(q, k, v, cu, max_seqlen, causal=causal, backend=backend,
                    softmax_scale=scale, seed=seed)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("softmax_scale", [0.3, 1, 0.0])
def test_softmax_scale(softmax_scale, backend):
    q, k, v, cu, max_seqlen = make_inputs([9, 0, 30], 4, 2, 16, torch.float32, seed=6)
    run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend=backend,
                    softmax_scale=softmax_scale)


# ---------------------------------------------------------------------------------------------
# No leak across sequence boundaries (nor, with causal, from later tokens).

# T = 65 (and 33 below): a token count divisible by 16 would be one more JIT compile of the
# Triton kernels on CUDA (a specialisation of their stride arguments) than the grid's.
LEAK_LENGTHS = [5, 0, 17, 1, 33, 9]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_no_leak_across_sequences(backend, causal, request):
    """Replacing one sequence's k and v changes no other sequence's output or gradient, while it
    does change that sequence's own."""
    device = setup_backend(backend, request)
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    q, k, v, cu, max_seqlen = make_inputs(LEAK_LENGTHS, 4, 2, 64, dtype, seed=7, device=device)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(device, dtype)

    def run(k_in, v_in):
        leaves = [q.detach().requires_grad_(), k_in.detach().requires_grad_(), v_in.detach().requires_grad_()]
        out = varlen_attention(*leaves, cu, max_seqlen, causal=causal, backend=backend,
                               deterministic=True)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

    base = run(k, v)
    bounds = list(zip(cu.tolist()[:-1], cu.tolist()[1:]))
    gen = torch.Generator().manual_seed(9)
    for index, (start, end) in enumerate(bounds):
        if start == end:
            continue
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[start:end] = (torch.randn(k2[start:end].shape, generator=gen) * 10).to(device, dtype)
        v2[start:end] = (torch.randn(v2[start:end].shape, generator=gen) * 10 + 5).to(device, dtype)
        perturbed = run(k2, v2)
        inside = torch.zeros(q.shape[0], dtype=torch.bool, device=device)
        inside[start:end] = True
        for name, a, b in zip(("out", "dq", "dk", "dv"), base, perturbed):
            # Bitwise on the CPU; on CUDA allow a few ulps of nondeterministic accumulation.
            atol = 0.0 if device == "cpu" else 4 * torch.finfo(dtype).eps * float(a.abs().max())
            assert torch.allclose(a[~inside], b[~inside], rtol=0, atol=atol), (
                f"{name}: perturbing sequence {index} ({start}:{end}) changed other sequences")
            # (a one-token sequence's dq, dk are 0 and its dv is dout, whatever its k and v)
            assert not torch.equal(a[inside], b[inside]) or name != "out" and end - start == 1, (
                f"{name}: perturbing sequence {index} changed nothing in it")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_causal_no_leak_from_later_tokens(backend, request):
    """With causal, changing token i's q, k, v changes no output before i in its sequence."""
    device = setup_backend(backend, request)
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    q, k, v, cu, max_seqlen = make_inputs([6, 40, 3], 4, 1, 64, dtype, seed=10, device=device,
                                          requires_grad=False)
    base = varlen_attention(q, k, v, cu, max_seqlen, causal=True, backend=backend)
    position = 6 + 25
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[position] = 7.0
    changed = varlen_attention(q2, k2, v2, cu, max_seqlen, causal=True, backend=backend)
    assert torch.equal(base[:position], changed[:position])
    assert torch.equal(base[46:], changed[46:])
    assert not torch.equal(base[position:46], changed[position:46])


# ---------------------------------------------------------------------------------------------
# The CPU backends' kernels write every element of preallocated (poisoned) outputs.

def check_kernels_overwrite_poisoned_outputs(backend_name, dtype, causal):
    """A backend's forward/backward called directly on NaN-filled out, lse, dq, dk, dv: every
    element is written and matches the float64 reference (flash-attention's tolerance).
    Shared with the Triton interpreter tests; returns the inputs and outputs."""
    backend = BACKENDS[backend_name]
    lengths = [0, 1, 7, 113, 0, 30]
    q, k, v, cu, max_seqlen = make_inputs(lengths, 4, 2, 32, dtype, seed=11, requires_grad=False)
    scale = 32 ** -0.5
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan)
    backend.forward(q, k, v, cu, max_seqlen, causal, scale, False, out, lse)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(dtype)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    backend.backward(dout, q, k, v, out, lse, cu, max_seqlen, causal, scale, False, dq, dk, dv)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"{name}: elements left unwritten (NaN) or non-finite"

    leaves64 = [x.to(torch.float64).requires_grad_() for x in (q, k, v)]
    out64, lse64 = varlen_attention_reference(*leaves64, cu, causal=causal)
    grads64 = torch.autograd.grad(out64, leaves64, dout.double())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out_pt, lse_pt = attention_in_dtype(*leaves, cu, causal, scale)
    grads_pt = torch.autograd.grad(out_pt, leaves, dout)
    assert_within("out", out, out64, out_pt, 2)
    assert_within("lse", lse, lse64, lse_pt, 2)
    for name, got, want, baseline in zip(("dq", "dk", "dv"), (dq, dk, dv), grads64, grads_pt):
        assert_within(name, got, want, baseline, 3)
    return q, k, v, cu, max_seqlen, dout, out, lse, dq, dk, dv


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_kernels_overwrite_poisoned_outputs(dtype, causal, backend):
    q, k, v, cu, max_seqlen, dout, out, lse, dq, dk, dv = check_kernels_overwrite_poisoned_outputs(
        backend, dtype, causal)
    # the public function runs these very kernels: same bits
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    public_out, public_lse = varlen_attention(*leaves, cu, max_seqlen, causal=causal, return_lse=True,
                                              backend=backend)
    assert torch.equal(public_out, out) and torch.equal(public_lse, lse)
    for got, want in zip(torch.autograd.grad(public_out, leaves, dout), (dq, dk, dv)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_cpu_kernels_zero_tokens_outside_every_sequence(name):
    """With unvalidated cu_seqlens that cover only part of the tokens, the rest are written too
    (zeros), never left as whatever the buffer held."""
    backend = BACKENDS[name]
    q, k, v, _, _ = make_inputs([10], 2, 1, 8, torch.float32, seed=13, requires_grad=False)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    out, lse = torch.full_like(q, math.nan), torch.full((2, 10), math.nan)
    backend.forward(q, k, v, cu, 3, True, 8 ** -0.5, False, out, lse)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    backend.backward(torch.ones_like(q), q, k, v, out, lse, cu, 3, True, 8 ** -0.5, False, dq, dk, dv)
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all() and (x[6:] == 0).all()
    assert not torch.isnan(lse).any()


# ---------------------------------------------------------------------------------------------
# The LSE.

@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_lse_values(backend, causal, request):
    """return_lse=True gives lse[Hq, T], float32, equal to the reference's; the output is the same
    as without it."""
    device = setup_backend(backend, request)
    dtype = torch.float32 if backend == "reference" else torch.float16
    q, k, v, cu, max_seqlen = make_inputs([0, 1, 7, 113, 0, 40], 4, 2, 64, dtype, seed=14,
                                          device=device, requires_grad=False)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen, causal=causal, return_lse=True, backend=backend)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (4, q.shape[0]) and lse.device == q.device
    _, lse64 = varlen_attention_reference(q, k, v, cu, causal=causal)
    _, lse_pt = attention_in_dtype(q, k, v, cu, causal, 64 ** -0.5)
    assert_within("lse", lse, lse64, lse_pt, 2)
    plain = varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend=backend)
    assert torch.equal(plain, out)


@pytest.mark.parametrize("backend", [
    pytest.param("reference", id="reference-cpu"),
    pytest.param("native", id="native-cpu"),
    pytest.param("cpu_flash", id="cpu_flash-cpu"),
    GPU_BACKENDS[0],
    pytest.param("torch", marks=[pytest.mark.gpu], id="torch-cuda"),
    GPU_BACKENDS[2],
    GPU_BACKENDS[3],
])
def test_lse_is_not_differentiable(backend, request):
    """The LSE does not require grad (so a loss through it fails loudly instead of getting a silently
    wrong gradient), and backward through the output alone gives the same gradients as without
    return_lse."""
    device = setup_backend(backend, request)
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    q, k, v, cu, max_seqlen = make_inputs([3, 0, 20, 10], 4, 2, 64, dtype, seed=15, device=device)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen, return_lse=True, backend=backend,
                                deterministic=True)
    assert out.requires_grad
    assert not lse.requires_grad and lse.grad_fn is None
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(16)).to(device, dtype)
    with_lse = torch.autograd.grad(out, (q, k, v), dout)
    plain = varlen_attention(q, k, v, cu, max_seqlen, backend=backend, deterministic=True)
    without = torch.autograd.grad(plain, (q, k, v), dout)
    for a, b in zip(with_lse, without):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(lse.sum(), q)


def test_native_row_pairs_give_the_bits_of_one_row_at_a_time():
    """Native takes query rows two at a time above head dim 16, each row's arithmetic in its own
    order (dk, dv adding the first row's term before the second's): out, lse and every gradient
    equal, bit for bit, one row at a time (AGENTRL_FAST_NATIVE_ROWS_ALONE=1 in a fresh
    process), plain and prefix-shared, causal and not, odd lengths, GQA, fp32 and bf16."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import sys, torch
        from agentrl_fast.ops import varlen_attention
        import test_varlen_attention as t
        torch.set_num_threads(1)
        results = []
        for lengths, prefix_of, head_dim, causal, dtype in [
                ([37, 1, 64, 0, 129], None, 40, True, torch.float32),
                ([37, 1, 64, 0, 129], None, 64, False, torch.bfloat16),
                ([90, 13, 1, 40], [-1, 0, 0, -1], 128, True, torch.float32),
                ([51, 20, 7], [-1, 0, 0], 32, True, torch.bfloat16)]:
            q, k, v, cu, max_seqlen = t.make_inputs(lengths, 4, 2, head_dim, dtype, seed=33)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(34)).to(dtype)
            prefix = None if prefix_of is None else torch.tensor(prefix_of, dtype=torch.int32)
            out, lse = varlen_attention(q, k, v, cu, max_seqlen, causal=causal, prefix_of=prefix,
                                        backend="native", return_lse=True)
            results.append([out, lse, *torch.autograd.grad(out, (q, k, v), dout)])
        torch.save([[x.detach() for x in r] for r in results], sys.argv[1])
    """)
    saved = {}
    for alone in ("0", "1"):
        env = {**os.environ, "AGENTRL_FAST_NATIVE_ROWS_ALONE": alone}
        env.pop("TRITON_INTERPRET", None)
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"native_rows_{os.getpid()}_{alone}.pt")
        result = subprocess.run([sys.executable, "-c", script, path], cwd=os.path.dirname(__file__),
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        saved[alone] = torch.load(path)
        os.remove(path)
    for case, (paired, alone) in enumerate(zip(saved["0"], saved["1"])):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), paired, alone):
            assert torch.equal(a, b), (case, name)


# ---------------------------------------------------------------------------------------------
# Backends and dispatch.

def test_auto_resolves_to_native_on_cpu(monkeypatch):
    """auto on the CPU is our kernel where its AVX2 + FMA build runs (cpu_flash otherwise:
    test_native_baseline_build_matches_float64)."""
    if not _NATIVE_VECTORISED:
        pytest.skip("this CPU runs the native kernel's baseline build (no AVX2 + FMA)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert {"reference", "native", "cpu_flash"} <= set(available_backends("cpu"))
    assert {"reference", "native", "cpu_flash"} <= set(available_backends(torch.device("cpu")))
    assert "torch" not in available_backends("cpu") and "flash_attn" not in available_backends("cpu")
    assert resolve_backend("auto", torch.device("cpu")) == "native"
    q, k, v, cu, max_seqlen = make_inputs([4, 9], 2, 1, 16, torch.float32, seed=17, requires_grad=False)
    assert torch.equal(varlen_attention(q, k, v, cu, max_seqlen),
                       varlen_attention(q, k, v, cu, max_seqlen, backend="native"))


def _mean_keys_by_rows(lengths: list[int], prefix_of: list[int] | None, causal: bool) -> float:
    """``mean_keys`` counted row by row."""
    pairs = squares = 0
    for index, length in enumerate(lengths):
        parent = prefix_of[index] if prefix_of else -1
        before = lengths[parent] if parent >= 0 else 0
        for row in range(1, length + 1):
            keys = before + row if causal else length
            pairs, squares = pairs + keys, squares + keys * keys
    return squares / max(pairs, 1)


@pytest.mark.parametrize("lengths,prefix_of,causal", [
    ([512, 512], None, True), ([7, 0, 1, 300], None, False), ([9, 0, 1, 300, 2], None, True),
    ([40, 3, 0, 17, 5, 11], [-1, 0, 0, -1, 3, 0], True), ([], None, True)])
def test_mean_keys_counts_the_keys_each_query_sees(lengths, prefix_of, causal):
    cu = cu_seqlens_of(lengths) if lengths else torch.zeros(1, dtype=torch.int32)
    parents = None if prefix_of is None else torch.tensor(prefix_of, dtype=torch.int32)
    assert mean_keys(cu, sum(lengths), parents, causal) == pytest.approx(
        _mean_keys_by_rows(lengths, prefix_of, causal), rel=1e-12)


def test_auto_takes_cpu_flash_where_queries_see_many_keys(monkeypatch):
    """On the CPU ``auto`` runs cpu_flash where a query sees ``CPU_FLASH_FROM_KEYS`` keys or
    more on average (two causal sequences of 1024: 683), from head dim 32 (from 448 keys at
    head dim 128): the same bits as asking for it; native on shorter sequences, at head dim
    16, and for unvalidated garbage without an error."""
    if not _NATIVE_VECTORISED:
        pytest.skip("this CPU runs the native kernel's baseline build (auto: cpu_flash anyway)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    q, k, v, cu, max_seqlen = make_inputs([1024, 1024], 2, 1, 32, torch.float32, seed=5,
                                          requires_grad=False)
    assert 2 * 1024 / 3 >= CPU_FLASH_FROM_KEYS
    assert resolve_backend("auto", cpu, q, k, cu) == "cpu_flash"
    assert resolve_backend("auto", cpu, q, k, cu, causal=False) == "cpu_flash"
    assert resolve_backend("auto", cpu, q[..., :16], k[..., :16], cu) == "native"
    assert resolve_backend("auto", cpu, q, k) == "native"  # no layout: the default order
    short = cu_seqlens_of([512] * 4)
    assert resolve_backend("auto", cpu, q, k, short) == "native"
    mid, wide = cu_seqlens_of([768] * 4), torch.empty(3072, 2, 128)  # 512 keys on average
    assert resolve_backend("auto", cpu, wide, wide[:, :1], mid) == "cpu_flash"  # sooner at 128
    assert resolve_backend("auto", cpu, wide[..., :64], wide[:, :1, :64], mid) == "native"
    assert torch.equal(varlen_attention(q, k, v, cu, max_seqlen),
                       varlen_attention(q, k, v, cu, max_seqlen, backend="cpu_flash"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_backend("auto", cpu, q, k, cu) == "native"  # a trace reads no layout
    monkeypatch.undo()
    garbage = torch.tensor([5, -3, 99999, 2], dtype=torch.int32)
    assert resolve_backend("auto", cpu, q, k, garbage, torch.tensor([7, -9, 1])) in BACKENDS


def test_native_baseline_build_matches_float64():
    """The native kernel's baseline build (what CPUs without AVX2 + FMA run), forced by
    AGENTRL_FAST_CPU_BASELINE=1 in a fresh process, against the float64 reference on a few grid
    cases; "auto" then prefers cpu_flash (faster than the baseline build)."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import torch
        from agentrl_fast import _native
        from agentrl_fast.ops.varlen_attention import resolve_backend
        import test_varlen_attention as t
        assert not _native._C.varlen_attention_cpu_uses_avx2()
        assert resolve_backend("auto", torch.device("cpu")) == "cpu_flash"
        for case in [t.REFERENCE_GRID[i] for i in (0, 7, 13, 20, 26, -1)]:
            t.check_grid_case(case, "native")
        print("baseline ok")
    """)
    env = {**os.environ, "AGENTRL_FAST_CPU_BASELINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(__file__), env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "baseline ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
def test_cpu_flash_rejected_on_cuda():
    q, k, v, cu, max_seqlen = make_inputs([4, 9], 2, 1, 16, torch.bfloat16, seed=18, device="cuda",
                                          requires_grad=False)
    with pytest.raises(ValueError, match="backend 'cpu_flash' is not available on cuda"):
        varlen_attention(q, k, v, cu, max_seqlen, backend="cpu_flash")


@pytest.mark.parametrize("lengths", [[0, 1, 7, 113, 0, 203, 0], [600, 1, 1, 1, 599, 2, 300, 0],
                                     [5] * 40, [1], [0, 0], []])
def test_cpu_flash_buckets_cover_every_token_once(lengths):
    """Every token of every sequence sits in exactly one padded position; a bucket's padding
    stays within CPU_FLASH_PADDING of its real tokens; empty sequences are left out."""
    from agentrl_fast.ops._varlen_attention_cpu import CPU_FLASH_PADDING, _cpu_flash_buckets
    num_tokens, cu = sum(lengths), cu_seqlens_of(lengths)
    seen = []
    for index, valid in _cpu_flash_buckets(cu, num_tokens, torch.device("cpu")):
        assert index.shape == valid.shape and valid[:, 0].all()  # no empty row
        assert (index[~valid] == num_tokens).all()
        assert index.numel() <= CPU_FLASH_PADDING * valid.sum() or index.shape[0] == 1
        rows = index.masked_fill(~valid, -1).tolist()
        for row in rows:  # each row is one sequence, in order
            row = [t for t in row if t >= 0]
            assert row == list(range(row[0], row[0] + len(row)))
            assert any(a == row[0] and b == row[0] + len(row)
                       for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()))
        seen += index[valid].tolist()
    assert sorted(seen) == list(range(num_tokens))


@pytest.mark.parametrize("name,reason", [("torch", "CUDA"), ("flash_attn", "")])
def test_cuda_backends_rejected_on_cpu(name, reason):
    q, k, v, cu, max_seqlen = make_inputs([4, 9], 2, 1, 16, torch.bfloat16, seed=18, requires_grad=False)
    expected_reason = BACKENDS[name].unavailable(torch.device("cpu"))
    assert expected_reason is not None and reason in expected_reason
    with pytest.raises(ValueError, match=f"backend '{name}' is not available on cpu") as info:
        varlen_attention(q, k, v, cu, max_seqlen, backend=name)
    assert expected_reason in str(info.value)


@pytest.mark.gpu
def test_auto_on_cuda_is_available():
    name = resolve_backend("auto", torch.device("cuda"))
    assert name in available_backends("cuda")
    assert {"reference", "torch"} <= set(available_backends("cuda"))


# ---------------------------------------------------------------------------------------------
# Edge cases of the layout.

@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("lengths,validate", [
    pytest.param([], True, id="cu=[0]"),
    pytest.param([], False, id="cu=[0]-unvalidated"),
    pytest.param([0, 0], True, id="cu=[0,0,0]"),
])
def test_empty_batch(backend, lengths, validate, request):
    """T = 0 (no sequence at all, or only empty ones): empty outputs, forward and backward."""
    device = setup_backend(backend, request)
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    q, k, v, cu, max_seqlen = make_inputs(lengths, 4, 2, 64, dtype, seed=0, device=device)
    assert q.shape[0] == 0 and max_seqlen == 0
    out, lse = varlen_attention(q, k, v, cu, max_seqlen, return_lse=True, backend=backend,
                                validate=validate)
    assert out.shape == (0, 4, 64) and out.dtype == dtype and lse.shape == (4, 0)
    assert lse.dtype == torch.float32
    (out.float().sum() * 2).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == dtype


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(backend, dtype, request):
    """q transposed from [Hq, T, D], k sliced from a wider last dim, v a slice of a stacked kv
    tensor, dout transposed: the same result and gradients as contiguous copies."""
    device = setup_backend(backend, request)
    if device == "cuda" and backend in ("torch", "flash_attn") and dtype == torch.float32:
        pytest.skip("torch's and flash-attn's kernels take no fp32")
    lengths, hq, hk, head_dim = [3, 0, 50, 1, 20], 4, 2, 64
    num_tokens, cu = sum(lengths), cu_seqlens_of(lengths, device)
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(hq, num_tokens, head_dim, generator=gen).to(device, dtype).transpose(0, 1)
    k = torch.randn(num_tokens, hk, 2 * head_dim, generator=gen).to(device, dtype)[..., head_dim:]
    v = torch.randn(num_tokens, 2, hk, head_dim, generator=gen).to(device, dtype)[:, 1]
    dout = torch.randn(hq, num_tokens, head_dim, generator=gen).to(device, dtype).transpose(0, 1)
    assert not any(x.is_contiguous() for x in (q, k, v, dout))

    def run(q, k, v, dout):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = varlen_attention(*leaves, cu, max(lengths), causal=True, return_lse=True,
                                    backend=backend, deterministic=True)
        return (out, lse, *torch.autograd.grad(out, leaves, dout))

    strided = run(q, k, v, dout)
    contiguous = run(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous())
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), strided, contiguous):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_max_seqlen_larger_than_needed():
    q, k, v, cu, max_seqlen = make_inputs([3, 11, 0], 2, 2, 16, torch.float32, seed=20, requires_grad=False)
    exact = varlen_attention(q, k, v, cu, max_seqlen)
    assert torch.equal(varlen_attention(q, k, v, cu, max_seqlen + 100), exact)
    assert torch.equal(varlen_attention(q, k, v, cu, max_seqlen, validate=False), exact)


def test_single_token_sequences_return_v():
    """A sequence of one token attends only to itself: out = v (per query head's KV head)."""
    q, k, v, cu, _ = make_inputs([1, 1, 1], 4, 2, 8, torch.float32, seed=21, requires_grad=False)
    for causal in (True, False):
        out = varlen_attention(q, k, v, cu, 1, causal=causal)
        torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# torch.compile and the registered op.

def test_torch_compile_fullgraph_forward_and_backward():
    """One graph through dynamo (the custom ops and their fakes), inductor compiling the arithmetic
    around them; forward and backward equal eager's."""
    torch._dynamo.reset()

    def step(q, k, v, cu_seqlens):
        out, lse = varlen_attention(q * 1.5, k, v, cu_seqlens, 9, causal=True, return_lse=True)
        return (out.float() * 2.0).sum() + lse.sum() * 0.0, out

    q, k, v, cu, _ = make_inputs([4, 0, 9, 1], 4, 2, 16, torch.float32, seed=22)
    compiled = torch.compile(step, fullgraph=True)
    got_loss, got_out = compiled(q, k, v, cu)
    got_grads = torch.autograd.grad(got_loss, (q, k, v))
    want_loss, want_out = step(q, k, v, cu)
    want_grads = torch.autograd.grad(want_loss, (q, k, v))
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck_forward(backend):
    """torch.library.opcheck on the forward op: schema, autograd registration, fake tensor, AOT
    dispatch (static and dynamic shapes), which traces the backward op too."""
    q, k, v, cu, max_seqlen = make_inputs([3, 0, 5, 1], 4, 2, 8, torch.float32, seed=23)
    args = (q, k, v, cu, max_seqlen, True, 8 ** -0.5, False, backend)
    torch.library.opcheck(torch.ops.agentrl_fast.varlen_attention_forward.default, args)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck_backward_and_validate(backend):
    q, k, v, cu, max_seqlen = make_inputs([3, 0, 5, 1], 4, 2, 8, torch.float32, seed=24,
                                          requires_grad=False)
    out, lse = torch.ops.agentrl_fast.varlen_attention_forward(q, k, v, cu, max_seqlen, False,
                                                               0.3, False, backend)
    args = (torch.randn_like(out), q, k, v, out, lse, cu, max_seqlen, False, 0.3, False, backend)
    torch.library.opcheck(torch.ops.agentrl_fast.varlen_attention_backward.default, args)
    torch.library.opcheck(torch.ops.agentrl_fast.validate_cu_seqlens.default, (cu, 9, max_seqlen))


def test_tile_tables_are_built_once_per_cu_seqlens_tensor():
    """The layers of one forward share the tile table of their cu_seqlens; a new tensor or an
    in-place change gets a fresh one."""
    from agentrl_fast.ops.varlen_attention_triton import cached_tile_table, tile_table
    cu = torch.tensor([0, 5, 5, 37, 40], dtype=torch.int32)
    first = cached_tile_table(cu, 40, 16, True)
    assert cached_tile_table(cu, 40, 16, True) is first
    assert cached_tile_table(cu, 40, 16, True, by_length=True) is not first
    for got, want in zip(first[:3], tile_table(cu, 40, 16, True)[:3]):
        assert torch.equal(got, want)
    cu[2] = 9  # in place: the cached table no longer describes it
    fresh = cached_tile_table(cu, 40, 16, True)
    assert fresh is not first and torch.equal(fresh[0], tile_table(cu, 40, 16, True)[0])
    assert cached_tile_table(cu.clone(), 40, 16, True) is not fresh
