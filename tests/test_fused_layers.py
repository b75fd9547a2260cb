"""Fused RMSNorm and SwiGLU (agentrl_fast.ops.fused_layers, csrc/fused_layers.cpp) and the
Liger-style patch of HF models (agentrl_fast.models.fused).

Against float64 references (forward and gradients), every dtype the kernels take, odd and tiny
widths, empty and one-row inputs, extreme gate values; outputs poisoned before the kernel runs;
the weight gradient the same for 1 and 2 threads; bad input named at the boundary. The patched
models give HF's logits and gradients and stay patched through copies and into the critic.
"""

import copy

import pytest
import torch
import transformers

from agentrl_fast.models.critic import make_critic
from agentrl_fast.models.fused import use_fused_layers, uses_fused_layers
from agentrl_fast.ops.fused_layers import rms_norm, swiglu
from agentrl_fast.ops.reference import rms_norm_reference, swiglu_reference

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Forward tolerance per dtype: the output is rounded to it (half: 2^-11, bf16: 2^-8 relative).
TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (1, 1), (1, 7), (5, 64), (3, 4, 16), (33, 130), (2000, 64)])
def test_rms_norm_matches_the_float64_reference(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=sum(shape), scale=3.0)
    weight = (1 + 0.3 * _randn(shape[-1], seed=1)).to(dtype)
    y = rms_norm(x, weight, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    want = rms_norm_reference(x, weight, 1e-5)
    torch.testing.assert_close(y.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (7, 64), (3, 5, 16), (300, 130)])
def test_rms_norm_gradients_match_the_float64_reference(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=3, scale=2.0).requires_grad_()
    weight = (1 + 0.3 * _randn(shape[-1], seed=4)).to(dtype).requires_grad_()
    dy = _randn(*shape, dtype=dtype, seed=5)
    rms_norm(x, weight, 1e-6).backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    (w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)).backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=tol, atol=tol * shape[0])


def test_rms_norm_gradcheck_and_low_precision_gradients():
    x = _randn(4, 6, dtype=torch.float64, seed=6).requires_grad_()
    weight = (1 + 0.3 * _randn(6, dtype=torch.float64, seed=7)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, weight))
    for dtype in (torch.bfloat16, torch.float16):
        xl = x.detach().to(dtype).requires_grad_()
        wl = weight.detach().to(dtype).requires_grad_()
        rms_norm(xl, wl, 1e-6).sum().backward()
        assert xl.grad.dtype == wl.grad.dtype == dtype
        x.grad = weight.grad = None
        rms_norm(x, weight, 1e-6).sum().backward()
        torch.testing.assert_close(xl.grad.double(), x.grad, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(wl.grad.double(), weight.grad, rtol=3e-2, atol=3e-2)


def test_rms_norm_is_hf_qwen3s_norm_and_an_all_zero_row_stays_finite():
    norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * _randn(64, seed=8))
    x = _randn(50, 64, seed=9)
    x[3] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        module = norm.to(dtype)
        y = rms_norm(x.to(dtype), module.weight, 1e-6)
        assert torch.isfinite(y).all() and (y[3] == 0).all()
        torch.testing.assert_close(y, module(x.to(dtype)), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_kernels_write_every_output_element():
    x, weight = _randn(37, 24, seed=10), 1 + _randn(24, seed=11)  # float32: rstd float32
    y, rstd = torch.full_like(x, float("nan")), torch.full((37,), float("nan"))
    torch.ops.agentrl_fast.rms_norm_cpu_out(x, weight, 1e-6, y, rstd)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    dx, dw = torch.full_like(x, float("nan")), torch.full((24,), float("nan"))
    torch.ops.agentrl_fast.rms_norm_cpu_backward_out(torch.ones_like(x), x, weight, rstd, dx, dw)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    gate, up = _randn(1001, seed=12), _randn(1001, seed=13)  # a tail past the 8-wide vectors
    out = torch.full_like(gate, float("nan"))
    torch.ops.agentrl_fast.swiglu_cpu_out(gate, up, out)
    assert torch.isfinite(out).all()
    dg, du = torch.full_like(gate, float("nan")), torch.full_like(gate, float("nan"))
    torch.ops.agentrl_fast.swiglu_cpu_backward_out(torch.ones_like(gate), gate, up, dg, du)
    assert torch.isfinite(dg).all() and torch.isfinite(du).all()


def test_rms_norm_weight_gradient_does_not_depend_on_threads():
    x = _randn(5000, 64, seed=14).requires_grad_()
    weight = (1 + _randn(64, seed=15)).requires_grad_()
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            weight.grad = None
            rms_norm(x, weight).sum().backward()
            grads.append(weight.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (100, 257), (4, 8, 128)])
def test_swiglu_matches_the_float64_reference(dtype, shape):
    gate = _randn(*shape, dtype=dtype, seed=16, scale=4.0)
    up = _randn(*shape, dtype=dtype, seed=17)
    out = swiglu(gate, up)
    assert out.dtype == dtype and out.shape == gate.shape
    torch.testing.assert_close(out.double(), swiglu_reference(gate, up), rtol=TOL[dtype] * 2,
                               atol=TOL[dtype] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_gradients_and_extreme_gates(dtype):
    gate = _randn(9, 33, dtype=dtype, seed=18, scale=4.0)
    gate[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0], dtype=dtype)
    up = _randn(9, 33, dtype=dtype, seed=19)
    dout = _randn(9, 33, dtype=dtype, seed=20)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    swiglu(g, u).backward(dout)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    (torch.nn.functional.silu(g64) * u64).backward(dout.double())
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    assert torch.isfinite(g.grad).all() and torch.isfinite(u.grad).all()
    torch.testing.assert_close(g.grad.double(), g64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(u.grad.double(), u64.grad, rtol=tol, atol=tol)
    if dtype == torch.float64:
        a, b = gate[1:3, :5].clone().requires_grad_(), up[1:3, :5].clone().requires_grad_()
        assert torch.autograd.gradcheck(swiglu, (a, b))


def test_bad_input_is_named():
    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight must be \\[D\\]"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="floating point"):
        rms_norm(torch.ones(4, 8, dtype=torch.long), weight)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        rms_norm(x, weight, -1.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0], weight)
    with pytest.raises(ValueError, match="gate and up must have one shape"):
        swiglu(torch.randn(3), torch.randn(4))
    with pytest.raises(TypeError, match="floating point"):
        swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    # the kernels themselves check what reaches them
    with pytest.raises(ValueError, match="must be contiguous"):
        torch.ops.agentrl_fast.swiglu_cpu_out(torch.randn(4, 4).t(), torch.randn(4, 4),
                                              torch.empty(4, 4))
    with pytest.raises(TypeError, match="one dtype"):
        torch.ops.agentrl_fast.swiglu_cpu_out(torch.randn(4), torch.randn(4).double(), torch.empty(4))
    # mixed dtypes fall back to torch ops (HF's formula), not an error
    y = rms_norm(x.double(), weight)
    torch.testing.assert_close(y, rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


def _tiny(family: str, seed: int = 0):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, tie_word_embeddings=False)
    cls, config = {"qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                   "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig)}[family]
    torch.manual_seed(seed)
    return cls(config(**common)).float()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_models_give_hf_logits_and_gradients(family):
    plain = _tiny(family)
    fused = use_fused_layers(copy.deepcopy(plain))
    assert uses_fused_layers(fused) and not uses_fused_layers(plain)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    names = {type(m).__name__ for m in fused.modules()}
    assert any(n.startswith("Fused") and n.endswith("RMSNorm") for n in names)
    assert any(n.startswith("Fused") and n.endswith("MLP") for n in names)
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (plain, fused):
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = outs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # copies stay fused; the critic of a fused policy is fused; a second call changes nothing
    assert uses_fused_layers(copy.deepcopy(fused)) and uses_fused_layers(make_critic(fused))
    assert {type(m) for m in use_fused_layers(fused).modules()} == {type(m) for m in fused.modules()}


def test_use_fused_layers_refuses_other_families():
    config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not one of qwen3, qwen2, llama"):
        use_fused_layers(transformers.GPT2LMHeadModel(config))
