"""The Triton path of ``token_logprobs`` / ``linear_token_logprobs`` under ``TRITON_INTERPRET=1``
(run by ``tests/test_triton_kernels.py`` in a child process): the same checks as the CPU tests,
through ``backend="triton"``, on small shapes (the interpreter is slow).

Vocabularies below 16384 use BLOCK_V = 1024 (agentrl_fast/kernels/token_logprobs.py), so V = 777 and 1000 are
one partial block; V = 5000 and the launcher's ``block_v=128`` override walk several blocks with
a partial last one.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

# The CPU test module shares this file's name; load its helpers under another name.
_spec = importlib.util.spec_from_file_location(
    "token_logprobs_checks", Path(__file__).resolve().parent.parent / "test_token_logprobs.py")
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)

from agentrl_fast.ops.token_logprobs import (linear_token_logprobs, resolve_backend,  # noqa: E402
                                             token_logprobs)

BACKEND = "triton"


def test_auto_takes_the_triton_path():
    assert resolve_backend("auto", torch.device("cpu")) == "triton"


@pytest.mark.parametrize("dtype,vocab,temperature", [
    (torch.float32, 1000, 1.0), (torch.float32, 777, 0.7), (torch.bfloat16, 1000, 0.7),
    (torch.bfloat16, 777, 1.0), (torch.float16, 777, 1.3), (torch.float32, 1, 1.0),
    (torch.float32, 2, 0.5), (torch.float32, 5000, 0.9), (torch.bfloat16, 5000, 1.0),
], ids=str)
def test_values_and_gradients(dtype, vocab, temperature):
    num_rows = 37 if vocab < 5000 else 11
    logits, labels = checks.make_case(num_rows, vocab, dtype, seed=vocab)
    checks.check_token_logprobs(logits, labels, backend=BACKEND, temperature=temperature)


def test_logp_only_int32_labels():
    logits, labels = checks.make_case(23, 777, torch.float32, seed=1, label_dtype=torch.int32)
    checks.check_token_logprobs(logits, labels, backend=BACKEND, entropy=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward(dtype):
    logits, labels = checks.make_case(37, 1000, dtype, seed=2)
    checks.check_token_logprobs(logits, labels, backend=BACKEND, inplace_backward=True)


def test_batched_shape_strided_rows_custom_ignore_index():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 10, 300, generator=gen)
    labels = torch.randint(0, 300, (2, 9), generator=gen)
    labels[1, :3] = -1
    checks.check_token_logprobs(wide[:, :-1], labels, backend=BACKEND, ignore_index=-1)


@pytest.mark.parametrize("block_v", [None, 128])
def test_poisoned_outputs_are_written(block_v):
    checks.check_poisoned_outputs(BACKEND, block_v=block_v)


def test_bf16_against_fp32_reference():
    checks.check_bf16_against_fp32(BACKEND)
    checks.check_bf16_against_fp32(BACKEND, seed=1, temperature=0.6, vocab=777)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_adversarial_logits_give_nonpositive_logprobs(dtype):
    for kind in checks.ADVERSARIAL:
        checks.check_adversarial(kind, dtype, BACKEND)


def test_random_logits_give_nonpositive_logprobs():
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        scale = 10 ** float(torch.empty(()).uniform_(-3, 4, generator=gen))
        vocab = int(torch.randint(1, 3000, (), generator=gen))
        logits = torch.randn(8, vocab, generator=gen) * scale
        labels = torch.randint(0, vocab, (8,), generator=gen)
        logp = token_logprobs(logits, labels, temperature=float(torch.rand((), generator=gen)) + 0.05,
                              backend=BACKEND)
        assert (logp <= 0).all()


def test_triton_matches_torch_path():
    logits, labels = checks.make_case(37, 777, torch.bfloat16, seed=4)
    a = token_logprobs(logits, labels, return_entropy=True, temperature=0.9, backend=BACKEND)
    b = token_logprobs(logits, labels, return_entropy=True, temperature=0.9, backend="torch")
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_values_and_gradients(chunk_size, dtype):
    hidden, weight, labels = checks.make_linear(37, 32, 777, dtype, seed=10)
    checks.check_linear(hidden, weight, labels, backend=BACKEND, chunk_size=chunk_size,
                        temperature=0.8)


def test_linear_frozen_weight_logp_only():
    hidden, weight, labels = checks.make_linear(20, 16, 1000, torch.float32, seed=11)
    checks.check_linear(hidden, weight, labels, backend=BACKEND, chunk_size=8, entropy=False,
                        need_weight=False)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_float64_is_refused_not_rounded(backend):
    """Both backends compute in float32: float64 logits, hidden or weight raise a TypeError
    naming the argument (under the interpreter "auto" means the Triton path), never a float32
    result."""
    logits, labels = checks.make_case(5, 50, torch.float64, seed=0)
    with pytest.raises(TypeError, match="logits must be bfloat16, float16 or float32, got "
                                        "torch.float64"):
        token_logprobs(logits, labels, backend=backend)
    hidden, weight = torch.randn(5, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="hidden must be bfloat16, float16 or float32"):
        linear_token_logprobs(hidden, weight, labels, backend=backend)
    with pytest.raises(TypeError, match="weight must be bfloat16, float16 or float32"):
        linear_token_logprobs(hidden.float(), weight, labels, backend=backend)
