"""``token_logprobs`` and ``linear_token_logprobs`` (``agentrl_fast.ops.token_logprobs``) on the
CPU path (``backend="torch"``) against the float64 references, plus bad-input cases (run in a
child process). The Triton path runs the same checks under the interpreter in
``tests/interpret/test_token_logprobs.py``, which imports the helpers below.
"""

import math
import textwrap

import pytest
import torch
from error_cases import bad_input_tests

from agentrl_fast.ops.reference import (linear_token_logprobs_reference,
                                                        token_logprobs_reference)
from agentrl_fast.ops.token_logprobs import (ROW_BACKWARD, ROW_FORWARD, linear_token_logprobs,
                                             token_logprobs)

IGNORE = -100
EPS32 = torch.finfo(torch.float32).eps


# ---------------------------------------------------------------------------------------------
# Helpers shared with the interpreter tests (parametrized by backend)


def make_case(num_rows, vocab, dtype, *, seed, scale=3.0, ignore_every=5, label_dtype=torch.int64,
              device="cpu"):
    """``(logits[T, V] in dtype, labels[T])``: random logits, a few ignored rows; drawn on
    ``device`` (a GPU draws a large vocabulary at once; the CPU's draws are the same as ever)."""
    gen = torch.Generator(device).manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=gen, device=device) * scale).to(dtype)
    labels = torch.randint(0, vocab, (num_rows,), generator=gen, device=device)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    return logits, labels.to(label_dtype)


def upstream(num_rows, seed, device="cpu"):
    """Upstream gradients ``(g_logp[T], g_entropy[T])`` float32 (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(num_rows, generator=gen).to(device),
            torch.randn(num_rows, generator=gen).to(device))


def tolerance(want: torch.Tensor, dtype: torch.dtype, depth: float) -> float:
    """Accumulation error in float32 of values of magnitude ``want`` over ``depth`` terms,
    plus one rounding of the output dtype (gradients come back in the logits' dtype)."""
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    return 8 * EPS32 * scale * depth + torch.finfo(dtype).eps * scale


def assert_close(name, got, want, atol):
    got64 = got.detach().to(torch.float64)
    assert got64.shape == want.shape, f"{name}: shape {tuple(got64.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got64).all(), f"{name}: non-finite values"
    error = (got64 - want.detach()).abs()
    if error.numel():
        worst = int(error.argmax())
        assert float(error.flatten()[worst]) <= atol, (
            f"{name}: error {float(error.flatten()[worst]):.3g} > {atol:.3g} at flat index {worst}")


def check_token_logprobs(logits, labels, *, backend, temperature=1.0, entropy=True,
                         inplace_backward=False, ignore_index=IGNORE, seed=0):
    """Values and gradients of ``token_logprobs`` against the float64 reference on the same
    (already rounded) logits."""
    vocab = logits.shape[-1]
    depth = 4 + math.log2(vocab)
    x = logits.clone().requires_grad_()
    y = x * 1 if inplace_backward else x  # in place: the buffer the op overwrites is not the leaf
    out = token_logprobs(y, labels, temperature=temperature, return_entropy=entropy,
                         ignore_index=ignore_index, inplace_backward=inplace_backward,
                         backend=backend)
    x64 = logits.detach().double().requires_grad_()
    ref = token_logprobs_reference(x64, labels, temperature=temperature, return_entropy=entropy,
                                   ignore_index=ignore_index)
    outs, refs = (out, ref) if entropy else ((out,), (ref,))
    for name, got, want in zip(("logp", "entropy"), outs, refs):
        assert got.dtype == torch.float32
        z_scale = float(logits.float().abs().max()) / temperature if logits.numel() else 1.0
        assert_close(name, got, want, tolerance(want, torch.float32, depth) * max(1.0, z_scale))
    assert (outs[0] <= 0).all(), "log-probs must be <= 0"
    ignored = labels == ignore_index
    assert (outs[0][ignored] == 0).all() and (not entropy or (outs[1][ignored] == 0).all())
    grads = upstream(labels.numel(), seed, logits.device)
    loss = sum((o * g.view_as(o)).sum() for o, g in zip(outs, grads))
    loss_ref = sum((r * g.view_as(r).double()).sum() for r, g in zip(refs, grads))
    loss.backward()
    loss_ref.backward()
    assert x.grad.dtype == logits.dtype
    assert_close("d logits", x.grad, x64.grad, tolerance(x64.grad, logits.dtype, depth))
    assert (x.grad[ignored] == 0).all(), "ignored rows must get exactly zero gradient"


def check_linear(hidden, weight, labels, *, backend, chunk_size=None, temperature=1.0,
                 entropy=True, need_weight=True, seed=0):
    """Values and gradients of ``linear_token_logprobs`` against the float64 reference."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(need_weight)
    out = linear_token_logprobs(h, w, labels, temperature=temperature, return_entropy=entropy,
                                chunk_size=chunk_size, backend=backend)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_(need_weight)
    ref = linear_token_logprobs_reference(h64, w64, labels, temperature=temperature,
                                          return_entropy=entropy)
    outs, refs = (out, ref) if entropy else ((out,), (ref,))
    low = hidden.dtype != torch.float32
    # Low-precision logits are rounded once (like the model's own LM head): the error scales
    # with that dtype's epsilon times the logits' magnitude.
    logit_scale = float((h64 @ w64.T).detach().abs().max()) / temperature
    eps = torch.finfo(hidden.dtype).eps if low else 8 * EPS32
    depth = 4 + math.log2(weight.shape[0] * weight.shape[1])
    for name, got, want in zip(("logp", "entropy"), outs, refs):
        assert_close(name, got, want, eps * depth * max(1.0, logit_scale))
    assert (outs[0] <= 0).all()
    grads = upstream(labels.numel(), seed, hidden.device)
    sum((o * g.view_as(o)).sum() for o, g in zip(outs, grads)).backward()
    sum((r * g.view_as(r).double()).sum() for r, g in zip(refs, grads)).backward()
    chunks = 1 if chunk_size is None else math.ceil(labels.numel() / chunk_size)
    for name, got, want in (("grad hidden", h.grad, h64.grad),
                            ("grad weight", w.grad if need_weight else None, w64.grad)):
        if got is None:
            assert not need_weight and w.grad is None
            continue
        scale = max(1.0, float(want.abs().max()))
        assert_close(name, got, want, eps * (depth + chunks) * scale * max(1.0, logit_scale))


def check_bf16_against_fp32(backend, seed=0, num_rows=37, vocab=1000, temperature=1.0):
    """flash-attention's rule: from bf16 logits, our error against the reference on the fp32
    logits is at most 2x (values) / 3x (gradients) that of PyTorch's eager math in bf16."""
    logits32, labels = make_case(num_rows, vocab, torch.float32, seed=seed)
    x64 = logits32.double().requires_grad_()
    ref_lp, ref_h = token_logprobs_reference(x64, labels, temperature=temperature,
                                             return_entropy=True)
    g_lp, g_h = upstream(num_rows, seed)
    ((ref_lp * g_lp).sum() + (ref_h * g_h).sum()).backward()

    xb = logits32.bfloat16().requires_grad_()
    lp, h = token_logprobs(xb, labels, temperature=temperature, return_entropy=True,
                           backend=backend)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()

    xe = logits32.bfloat16().requires_grad_()  # the eager path, all in bf16
    log_probs = torch.log_softmax(xe / temperature, dim=-1)
    keep = labels != IGNORE
    e_lp = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    e_h = -(log_probs.exp() * log_probs).sum(-1) * keep
    ((e_lp.float() * g_lp).sum() + (e_h.float() * g_h).sum()).backward()

    def err(a, b):
        return float((a.detach().double() - b.detach()).abs().max())

    for name, ours, eager, want, factor in (("logp", lp, e_lp, ref_lp, 2), ("entropy", h, e_h, ref_h, 2),
                                            ("d logits", xb.grad, xe.grad, x64.grad, 3)):
        assert err(ours, want) <= factor * err(eager, want) + 1e-6, (
            f"{name}: ours {err(ours, want):.3g} vs eager bf16 {err(eager, want):.3g}")


ADVERSARIAL = ("huge", "very_negative", "ties", "dominant", "dominant_other_label", "neg_inf",
               "max_finite", "tiny_temperature")


def adversarial_case(kind, dtype, num_rows=16, vocab=777):
    """Logits built to push a fused kernel into positive "log-probs" or NaN."""
    gen = torch.Generator().manual_seed(7)
    labels = torch.randint(0, vocab, (num_rows,), generator=gen)
    temperature = 1.0
    base = torch.randn(num_rows, vocab, generator=gen)
    big = torch.finfo(dtype).max
    if kind == "huge":
        logits = (base * 1e4 + 3e4).clamp(-big / 2, big / 2)  # finite in every dtype
    elif kind == "very_negative":
        logits = base - 1e30 if dtype == torch.float32 else base * 10 - 6e4
    elif kind == "ties":
        logits = torch.full((num_rows, vocab), 5.0)
    elif kind in ("dominant", "dominant_other_label"):
        logits = base.clone()
        logits[torch.arange(num_rows), labels] = 1e4 if dtype != torch.float16 else 6e4
        if kind == "dominant_other_label":
            labels = (labels + 1) % vocab
    elif kind == "neg_inf":
        logits = base.clone()
        logits[:, ::3] = -math.inf  # a masked vocabulary
        labels = labels - labels % 3 + 1
        labels = labels.clamp(max=vocab - 1)
        labels = torch.where(labels % 3 == 0, labels - 2, labels)
    elif kind == "max_finite":
        logits = torch.where(base > 0, big, -big)
    elif kind == "tiny_temperature":
        logits = base
        temperature = 1e-3
    else:
        raise ValueError(kind)
    return logits.to(dtype), labels, temperature


def check_adversarial(kind, dtype, backend):
    logits, labels, temperature = adversarial_case(kind, dtype)
    logp, entropy = token_logprobs(logits, labels, temperature=temperature, return_entropy=True,
                                   backend=backend)
    assert not torch.isnan(logp).any() and not torch.isnan(entropy).any()
    assert (logp <= 0).all(), f"positive log-probs: max {float(logp.max())!r}"
    assert (entropy >= 0).all()
    ref_lp, ref_h = token_logprobs_reference(logits, labels, temperature=temperature,
                                             return_entropy=True)
    finite = torch.isfinite(ref_lp.float())  # -inf where the true value overflows float32
    assert torch.equal(torch.isfinite(logp), finite)
    # Relative to the tempered logits' magnitude (spacing of float32 there).
    z = logits.double().abs()
    z_scale = float(z[torch.isfinite(z)].max()) / temperature
    atol = 64 * EPS32 * max(1.0, z_scale)
    assert_close("logp", logp[finite], ref_lp[finite], atol)
    if torch.isfinite(ref_h).all():
        assert_close("entropy", entropy, ref_h, atol)
    if kind == "dominant":
        assert (logp == 0).all()


def check_poisoned_outputs(backend, num_rows=37, vocab=777, block_v=None):
    """The launchers write every element of their preallocated (NaN-poisoned) outputs."""
    logits, labels = make_case(num_rows, vocab, torch.float32, seed=3)
    kwargs = {} if block_v is None else {"block_v": block_v}
    logp, entropy, lse = (torch.full((num_rows,), math.nan) for _ in range(3))
    ROW_FORWARD[backend](logits, labels, 1 / 0.8, IGNORE, True, logp, entropy, lse, **kwargs)
    for name, t in (("logp", logp), ("entropy", entropy), ("lse", lse)):
        assert torch.isfinite(t).all(), f"{name} not fully written"
    ref_lp, ref_h = token_logprobs_reference(logits, labels, temperature=0.8, return_entropy=True)
    assert_close("logp", logp, ref_lp, 1e-4)
    assert_close("entropy", entropy, ref_h, 1e-4)
    assert_close("lse", lse, torch.logsumexp(logits.double() / 0.8, -1), 1e-4)
    grad = torch.full_like(logits, math.nan)
    g_lp, g_h = upstream(num_rows, 3)
    ROW_BACKWARD[backend](logits, labels, lse, entropy, g_lp, g_h, 1 / 0.8, IGNORE, grad, **kwargs)
    assert torch.isfinite(grad).all(), "grad_logits not fully written"
    x64 = logits.double().requires_grad_()
    r_lp, r_h = token_logprobs_reference(x64, labels, temperature=0.8, return_entropy=True)
    ((r_lp * g_lp).sum() + (r_h * g_h).sum()).backward()
    assert_close("grad", grad, x64.grad, 1e-5)
    # Strided rows (a slice of a wider buffer), only the logp part of the gradient.
    wide = torch.full((num_rows, vocab + 13), math.nan)
    wide[:, :vocab] = logits
    view = wide[:, :vocab]
    logp2, lse2 = torch.full((num_rows,), math.nan), torch.full((num_rows,), math.nan)
    ROW_FORWARD[backend](view, labels, 1 / 0.8, IGNORE, False, logp2, lse2, lse2, **kwargs)
    assert torch.equal(logp2, logp) and torch.equal(lse2, lse)
    ROW_BACKWARD[backend](view, labels, lse, entropy, g_lp, None, 1 / 0.8, IGNORE, view, **kwargs)
    assert torch.isnan(wide[:, vocab:]).all(), "wrote outside the row"
    assert torch.isfinite(view).all()


# ---------------------------------------------------------------------------------------------
# The CPU path

BACKEND = "torch"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 2, 777, 1000, 4099])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients(dtype, vocab, temperature):
    logits, labels = make_case(37, vocab, dtype, seed=vocab)
    check_token_logprobs(logits, labels, backend=BACKEND, temperature=temperature)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32], ids=str)
def test_logp_only_and_int32_labels(entropy, label_dtype):
    logits, labels = make_case(23, 513, torch.float32, seed=1, label_dtype=label_dtype)
    check_token_logprobs(logits, labels, backend=BACKEND, entropy=entropy, temperature=1.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward_matches(dtype):
    logits, labels = make_case(37, 1000, dtype, seed=2)
    check_token_logprobs(logits, labels, backend=BACKEND, inplace_backward=True)


def test_inplace_backward_overwrites_logits():
    logits, labels = make_case(9, 300, torch.float32, seed=4)
    x = logits.clone().requires_grad_()
    y = x * 2
    logp = token_logprobs(y, labels, inplace_backward=True, backend=BACKEND)
    logp.sum().backward()
    x2 = logits.clone().requires_grad_()
    token_logprobs(x2 * 2, labels, backend=BACKEND).sum().backward()
    assert torch.allclose(x.grad, x2.grad)
    z = y.detach()
    assert not torch.allclose(z, logits * 2), "the buffer holds the gradient now"


def test_batched_shape_and_custom_ignore_index():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 11, 257, generator=gen)
    labels = torch.randint(0, 257, (3, 11), generator=gen)
    labels[1, :4] = -1
    check_token_logprobs(logits, labels, backend=BACKEND, ignore_index=-1)
    logp, entropy = token_logprobs(logits, labels, ignore_index=-1, return_entropy=True,
                                   backend=BACKEND)
    assert logp.shape == entropy.shape == (3, 11)


def test_strided_rows():
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(2, 9, 300, generator=gen)
    logits = wide[:, :-1]  # the usual "drop the last position" slice: not contiguous
    labels = torch.randint(0, 300, (2, 8), generator=gen)
    check_token_logprobs(logits, labels, backend=BACKEND)


def test_empty_batch():
    logits = torch.zeros(0, 50, requires_grad=True)
    logp, entropy = token_logprobs(logits, torch.zeros(0, dtype=torch.long), return_entropy=True,
                                   backend=BACKEND)
    assert logp.shape == entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad.shape == (0, 50)


def test_bf16_against_fp32_reference():
    check_bf16_against_fp32(BACKEND)
    check_bf16_against_fp32(BACKEND, seed=1, temperature=0.6, vocab=3001)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_adversarial_logits_give_nonpositive_logprobs(kind, dtype):
    check_adversarial(kind, dtype, BACKEND)


@pytest.mark.parametrize("seed", range(20))
def test_random_logits_give_nonpositive_logprobs(seed):
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** float(torch.empty(()).uniform_(-3, 4, generator=gen))
    vocab = int(torch.randint(1, 3000, (), generator=gen))
    logits = torch.randn(16, vocab, generator=gen) * scale
    labels = torch.randint(0, vocab, (16,), generator=gen)
    logp = token_logprobs(logits, labels, temperature=float(torch.rand((), generator=gen)) + 0.05,
                          backend=BACKEND)
    assert (logp <= 0).all()


def test_poisoned_outputs_are_written():
    check_poisoned_outputs(BACKEND)


def test_unused_entropy_gradient():
    """Only logp feeds the loss: entropy's missing gradient is treated as zero."""
    logits, labels = make_case(17, 300, torch.float32, seed=8)
    x = logits.clone().requires_grad_()
    logp, _ = token_logprobs(x, labels, return_entropy=True, backend=BACKEND)
    logp.sum().backward()
    x2 = logits.clone().requires_grad_()
    token_logprobs(x2, labels, backend=BACKEND).sum().backward()
    assert torch.allclose(x.grad, x2.grad)


def test_opcheck():
    logits, labels = make_case(7, 64, torch.float32, seed=9)
    args = (logits.requires_grad_(), labels, 0.9, IGNORE, True, BACKEND)
    torch.library.opcheck(torch.ops.agentrl_fast.token_logprobs_forward.default, args)
    hidden, weight = torch.randn(7, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.agentrl_fast.linear_token_logprobs_forward.default,
                          (hidden, weight, labels, 0.9, IGNORE, True, 3, BACKEND))


@pytest.mark.slow
def test_torch_compile_fullgraph():
    """Both ops (with the label validation inside) trace into one graph, values and gradients
    as in eager mode."""

    def loss(x, y, h, w):
        logp, entropy = token_logprobs(x, y, return_entropy=True, temperature=0.8, backend=BACKEND)
        return (logp + 0.1 * entropy + linear_token_logprobs(h, w, y, chunk_size=4,
                                                             backend=BACKEND)).sum()

    gen = torch.Generator().manual_seed(14)
    x, h, w = (torch.randn(*shape, generator=gen).requires_grad_() for shape in ((9, 50), (9, 8), (50, 8)))
    y = torch.randint(0, 50, (9,), generator=gen)
    torch.compile(loss, fullgraph=True)(x, y, h, w).backward()
    compiled = [t.grad.clone() for t in (x, h, w)]
    for t in (x, h, w):
        t.grad = None
    loss(x, y, h, w).backward()
    for got, t in zip(compiled, (x, h, w)):
        assert torch.allclose(got, t.grad, atol=1e-5)


# --- linear_token_logprobs


def make_linear(num_rows, hidden_size, vocab, dtype, seed, device="cpu"):
    """``(hidden[T, H], weight[V, H], labels[T])``, drawn on ``device``; every 6th row ignored."""
    gen = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(num_rows, hidden_size, generator=gen, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=device)
              / hidden_size ** 0.5 * 2).to(dtype)
    labels = torch.randint(0, vocab, (num_rows,), generator=gen, device=device)
    labels[::6] = IGNORE
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 37, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_values_and_gradients(chunk_size, dtype):
    hidden, weight, labels = make_linear(37, 48, 777, dtype, seed=10)
    check_linear(hidden, weight, labels, backend=BACKEND, chunk_size=chunk_size, temperature=0.8)


def test_linear_frozen_weight_and_logp_only():
    hidden, weight, labels = make_linear(37, 32, 1000, torch.float32, seed=11)
    check_linear(hidden, weight, labels, backend=BACKEND, chunk_size=8, entropy=False,
                 need_weight=False)


def test_linear_matches_token_logprobs_on_materialized_logits():
    hidden, weight, labels = make_linear(29, 32, 500, torch.float32, seed=12)
    got = linear_token_logprobs(hidden, weight, labels, return_entropy=True, chunk_size=7,
                                backend=BACKEND)
    want = token_logprobs(hidden @ weight.T, labels, return_entropy=True, backend=BACKEND)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)


def test_linear_never_materializes_full_logits(monkeypatch):
    """The row kernels only ever see one chunk's logits, forward and backward."""
    seen = []
    for table in (ROW_FORWARD, ROW_BACKWARD):
        inner = table[BACKEND]

        def spy(logits, *args, _inner=inner, **kwargs):
            seen.append(logits.shape[0])
            return _inner(logits, *args, **kwargs)

        monkeypatch.setitem(table, BACKEND, spy)
    hidden, weight, labels = make_linear(50, 16, 300, torch.float32, seed=13)
    hidden.requires_grad_()
    linear_token_logprobs(hidden, weight, labels, chunk_size=16, backend=BACKEND).sum().backward()
    assert seen == [16, 16, 16, 2] * 2


def test_linear_batched_shape():
    hidden, weight, labels = make_linear(24, 16, 300, torch.float32, seed=13)
    out = linear_token_logprobs(hidden.view(4, 6, 16), weight, labels.view(4, 6), backend=BACKEND)
    assert out.shape == (4, 6)


# ---------------------------------------------------------------------------------------------
# The Triton path on CUDA (run by bench/gpu_suite.sh): against the CPU path on the same inputs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [777, 151936])
def test_cuda_triton_matches_cpu_path(dtype, vocab):
    logits, labels = make_case(64, vocab, dtype, seed=15)
    results = []
    for device in ("cpu", "cuda"):
        x = logits.detach().to(device).requires_grad_()  # a leaf on each device
        logp, entropy = token_logprobs(x, labels.to(device), temperature=0.9, return_entropy=True,
                                       backend="torch" if device == "cpu" else "triton")
        g_lp, g_h = (g.to(device) for g in upstream(64, 15))
        ((logp * g_lp).sum() + (entropy * g_h).sum()).backward()
        results.append([t.detach().cpu().double() for t in (logp, entropy, x.grad)])
    for name, cpu, cuda in zip(("logp", "entropy", "d logits"), *results):
        scale = max(1.0, float(cpu.abs().max()))
        assert float((cpu - cuda).abs().max()) <= 1e-5 * scale + torch.finfo(dtype).eps * scale, name
    assert (results[1][0] <= 0).all()
    for kind in ADVERSARIAL:
        bad_logits, bad_labels, temperature = adversarial_case(kind, dtype)
        logp = token_logprobs(bad_logits.cuda(), bad_labels.cuda(), temperature=temperature,
                              backend="triton")
        assert not torch.isnan(logp).any() and (logp <= 0).all(), kind


@pytest.mark.gpu
def test_cuda_linear_matches_cpu_path():
    hidden, weight, labels = make_linear(300, 64, 5000, torch.float32, seed=16)
    grads = []
    for device, backend in (("cpu", "torch"), ("cuda", "triton")):
        h, w = (x.detach().to(device).requires_grad_() for x in (hidden, weight))
        logp, entropy = linear_token_logprobs(h, w, labels.to(device), return_entropy=True,
                                              chunk_size=128, backend=backend)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        grads.append([t.detach().cpu() for t in (logp, entropy, h.grad, w.grad)])
    for cpu, cuda in zip(*grads):
        assert torch.allclose(cpu, cuda, atol=1e-3, rtol=1e-3)  # fp32 matmuls: summation order only


QWEN_VOCAB = 151936  # Qwen2/2.5/3: BLOCK_V = 4096, 38 blocks per row, the last one partial


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_qwen_vocabulary_matches_float64(dtype):
    """token_logprobs at Qwen's vocabulary on CUDA: logp, entropy and d logits of 300 tokens
    (every 5th ignored) against the float64 reference, computed on the GPU."""
    logits, labels = make_case(300, QWEN_VOCAB, dtype, seed=17, device="cuda")
    check_token_logprobs(logits, labels, backend="triton", temperature=0.9, seed=17)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_linear_qwen_vocabulary_matches_float64(dtype):
    """linear_token_logprobs at Qwen's vocabulary on CUDA (300 tokens in chunks of 128, the
    last partial): logp, entropy, d hidden and d weight against the float64 reference on the
    GPU."""
    hidden, weight, labels = make_linear(300, 64, QWEN_VOCAB, dtype, seed=18, device="cuda")
    check_linear(hidden, weight, labels, backend="triton", chunk_size=128, temperature=0.9,
                 seed=18)


# ---------------------------------------------------------------------------------------------
# Bad inputs (in a child process)

PRELUDE = textwrap.dedent("""
    import math
    import torch
    from agentrl_fast.ops.token_logprobs import token_logprobs, linear_token_logprobs

    x = torch.randn(6, 10)
    y = torch.tensor([1, 2, -100, 9, 0, 3])
    h = torch.randn(6, 4)
    w = torch.randn(10, 4)
""")

CASES = {
    "valid": ("NoError", "", "token_logprobs(x, y, return_entropy=True)"),
    "valid_linear": ("NoError", "", "linear_token_logprobs(h, w, y, chunk_size=4)"),
    "logits_not_tensor": ("TypeError", "logits must be a torch.Tensor", "token_logprobs(x.tolist(), y)"),
    "logits_int": ("TypeError", "logits must be bfloat16, float16 or float32", "token_logprobs(x.long(), y)"),
    "logits_float64": ("TypeError", "logits must be bfloat16, float16 or float32",
                       "token_logprobs(x.double(), y)"),
    "logits_1d": ("ValueError", "logits must be [T, V]", "token_logprobs(x[0], y[0])"),
    "logits_empty_vocab": ("ValueError", "vocabulary (last) dimension", "token_logprobs(x[:, :0], y)"),
    "labels_float": ("TypeError", "labels must be int64 or int32", "token_logprobs(x, y.float())"),
    "labels_bool": ("TypeError", "labels must be int64 or int32", "token_logprobs(x, y > 0)"),
    "labels_short": ("ValueError", "labels must have shape logits.shape[:-1] = (6,)",
                     "token_logprobs(x, y[:5])"),
    "labels_unshifted": ("ValueError", "shift them before the call", "token_logprobs(x, y[:5])"),
    "labels_not_tensor": ("TypeError", "labels must be a torch.Tensor", "token_logprobs(x, [1, 2])"),
    "label_too_large": ("ValueError", "labels must be in [0, V = 10) or equal ignore_index = -100, got labels[1] = 10",
                        "token_logprobs(x, torch.tensor([1, 10, 0, 0, 0, 0]))"),
    "label_negative": ("ValueError", "got labels[0] = -1", "token_logprobs(x, torch.tensor([-1, 0, 0, 0, 0, 0]))"),
    "label_unvalidated": ("NoError", "",
                          "token_logprobs(x, torch.tensor([-7, 10**6, 0, 0, 0, 0]), validate=False)"),
    "temperature_zero": ("ValueError", "temperature must be finite and > 0", "token_logprobs(x, y, temperature=0.0)"),
    "temperature_negative": ("ValueError", "temperature must be finite and > 0", "token_logprobs(x, y, temperature=-1)"),
    "temperature_nan": ("ValueError", "temperature must be finite and > 0", "token_logprobs(x, y, temperature=math.nan)"),
    "temperature_inf": ("ValueError", "temperature must be finite and > 0", "token_logprobs(x, y, temperature=math.inf)"),
    "temperature_string": ("TypeError", "temperature must be a real number", "token_logprobs(x, y, temperature='1')"),
    "temperature_tensor": ("TypeError", "temperature must be a real number",
                           "token_logprobs(x, y, temperature=torch.tensor(1.0))"),
    "ignore_index_float": ("TypeError", "ignore_index must be a Python int", "token_logprobs(x, y, ignore_index=-100.0)"),
    "ignore_index_huge": ("ValueError", "ignore_index must fit in int32", "token_logprobs(x, y, ignore_index=2**40)"),
    "return_entropy_int": ("TypeError", "return_entropy must be a bool", "token_logprobs(x, y, return_entropy=1)"),
    "inplace_backward_str": ("TypeError", "inplace_backward must be a bool",
                             "token_logprobs(x, y, inplace_backward='yes')"),
    "backend_unknown": ("ValueError", "backend must be one of", "token_logprobs(x, y, backend='cuda')"),
    "backend_triton_on_cpu": ("ValueError", "backend 'triton' is not available on cpu",
                              "token_logprobs(x, y, backend='triton')"),
    "linear_weight_dtype": ("TypeError", "weight must have the dtype of hidden",
                            "linear_token_logprobs(h, w.half(), y)"),
    "linear_weight_1d": ("ValueError", "weight must be 2-D [V, H]", "linear_token_logprobs(h, w[0], y)"),
    "linear_hidden_size": ("ValueError", "hidden's last dimension must equal weight.shape[1] = 4",
                           "linear_token_logprobs(h[:, :3], w, y)"),
    "linear_labels_shape": ("ValueError", "labels must have shape hidden.shape[:-1] = (6,)",
                            "linear_token_logprobs(h, w, y[:4])"),
    "linear_chunk_zero": ("ValueError", "chunk_size must be >= 1", "linear_token_logprobs(h, w, y, chunk_size=0)"),
    "linear_chunk_float": ("TypeError", "chunk_size must be a Python int or None",
                           "linear_token_logprobs(h, w, y, chunk_size=2.5)"),
    "linear_label_range": ("ValueError", "labels must be in [0, V = 10)",
                           "linear_token_logprobs(h, w, torch.tensor([0, 0, 0, 11, 0, 0]))"),
    "linear_hidden_int": ("TypeError", "hidden must be bfloat16, float16 or float32",
                          "linear_token_logprobs(h.long(), w, y)"),
}


outcomes, test_bad_input = bad_input_tests(PRELUDE, CASES)
