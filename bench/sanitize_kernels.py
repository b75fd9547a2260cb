"""Runs every CUDA and Triton kernel of agentrl_fast once on a small input, for NVIDIA's
compute-sanitizer (memcheck, racecheck, synccheck), all of them or one per process:

    compute-sanitizer --tool memcheck python bench/sanitize_kernels.py --only varlen_attention
    python bench/sanitize_kernels.py --list          # the kernel names, one a line
    python bench/sanitize_kernels.py --triton-only   # all but the CUDA C++ kernel (gae)
    python bench/sanitize_kernels.py --device cpu    # CI's dry run: the same ops on the CPU

Each kernel runs forward and backward on inputs with the edges where bad accesses hide (odd
lengths, length-1 and empty sequences, partial tiles and blocks, several tiles of one sequence,
ignored rows, masked tokens), checks that its outputs are finite, syncs the device and prints
one line. The exit status is 1 when a kernel raised or gave non-finite values; what the
sanitizer finds it reports itself (``--error-exitcode`` makes it fail the run).

PyTorch's caching allocator carves tensors out of large segments, inside which memcheck cannot
see an access past a tensor's end: run as a script, this turns caching off
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` unless set), so every tensor is an allocation of its own.
(Imported, as the CPU test does, it leaves the environment alone.)

With ``--device cpu`` each op takes its CPU path (``backend="auto"``): the C++ GAE kernel, the
native attention kernel and the torch paths, or the Triton kernels under the interpreter when
``TRITON_INTERPRET=1``.
"""

import argparse
import contextlib
import os
import sys
import time

if __name__ == "__main__":  # before torch initializes CUDA
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402


from agentrl_fast.ops import (gae, linear_token_logprobs, ppo_loss, token_logprobs,  # noqa: E402
                              value_loss, varlen_attention)
from agentrl_fast.ops import varlen_attention_triton as triton_launcher  # noqa: E402

IGNORE = -100


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cu_seqlens(lengths: list[int], device: str) -> torch.Tensor:
    """``[B+1]`` int32."""
    return torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)


def _finite(*tensors: torch.Tensor) -> None:
    for x in tensors:
        if not torch.isfinite(x).all():
            raise AssertionError(f"non-finite values in a {tuple(x.shape)} {x.dtype} output")


def _backward(outputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ``sum_i <outputs_i, g_i>`` for random ``g_i`` (not all ones: a kernel that
    mixes rows up must not cancel out)."""
    gen = _generator(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
               for o in outputs)
    return list(torch.autograd.grad(loss, leaves))


def run_gae(device: str, backend: str) -> None:
    """The GAE scan: 5000 tokens, on CUDA 3 tiles of 2048 (the look-back chain between tiles),
    with sequences crossing tile boundaries, length-1 and empty ones."""
    lengths = [0, 1, 3000, 7, 0, 1900, 92]
    num_tokens, gen = sum(lengths), _generator(0)
    mask = torch.rand(num_tokens, generator=gen) < 0.7
    rewards = torch.randn(num_tokens, generator=gen) * mask
    values = torch.randn(num_tokens, generator=gen)
    boot = torch.randn(len(lengths), generator=gen)
    advantages, returns = gae(rewards.to(device), values.to(device), _cu_seqlens(lengths, device),
                              action_mask=mask.to(device), bootstrap_values=boot.to(device),
                              gamma=0.99, lam=0.95)
    _finite(advantages, returns)


def _attention(device: str, backend: str, heads_q: int, heads_k: int, head_dim: int) -> None:
    # Empty and length-1 sequences, and on CUDA one of 130 tokens (two 128-row tiles); shorter
    # on the CPU, where the Triton interpreter would take seconds per tile.
    lengths = [0, 1, 7, 130 if device == "cuda" else 20, 0, 13]
    num_tokens, gen = sum(lengths), _generator(2)
    q, k, v = (torch.randn(num_tokens, heads, head_dim, generator=gen)
               .to(device, torch.bfloat16).requires_grad_()
               for heads in (heads_q, heads_k, heads_k))
    cu = _cu_seqlens(lengths, device)
    for causal in (True, False):
        out, lse = varlen_attention(q, k, v, cu, max(lengths), causal=causal, return_lse=True,
                                    backend=backend)
        grads = _backward([out], [q, k, v])
        _finite(out, lse, *grads)


def run_varlen_attention(device: str, backend: str) -> None:
    """Attention forward and backward, bf16, GQA 4:2 at D = 64, causal and not."""
    _attention(device, backend, 4, 2, 64)


def run_varlen_attention_odd_head_dim(device: str, backend: str) -> None:
    """The same at an odd head dim (D = 59, padded to 64 with masked columns), MQA 4:1."""
    _attention(device, backend, 4, 1, 59)


def run_varlen_attention_prefix(device: str, backend: str) -> None:
    """The prefix-shared mode (``prefix_of``), bf16, GQA 4:2 at D = 64: a prefix over several
    tiles on CUDA with suffixes of one and several blocks, length 1, empty and non-adjacent,
    and a plain sequence that is a prefix too; both backwards; on CUDA each prefix tile's
    dk/dv also split over 3 programs (their float32 sums and the kernel that adds them)."""
    lengths = ([130, 70, 1, 0, 9, 33, 66] if device == "cuda" else [20, 7, 1, 0, 5, 9, 6])
    prefix_of = torch.tensor([-1, 0, 0, 0, -1, 0, 4], dtype=torch.int32, device=device)
    num_tokens, gen = sum(lengths), _generator(7)
    q, k, v = (torch.randn(num_tokens, heads, 64, generator=gen)
               .to(device, torch.bfloat16).requires_grad_() for heads in (4, 2, 2))
    cu = _cu_seqlens(lengths, device)
    held = ((contextlib.nullcontext(), triton_launcher.dkdv_splits_held(3))
            if device == "cuda" else (contextlib.nullcontext(),))
    for splits in held:
        with splits:
            for deterministic in (True, False):
                out = varlen_attention(q, k, v, cu, max(lengths), prefix_of=prefix_of,
                                       deterministic=deterministic, backend=backend)
                _finite(out, *_backward([out], [q, k, v]))


def _labels(num_rows: int, vocab: int, device: str) -> torch.Tensor:
    """``[T]`` int64, every third row ignored."""
    labels = torch.randint(0, vocab, (num_rows,), generator=_generator(3))
    labels[::3] = IGNORE
    return labels.to(device)


def run_token_logprobs(device: str, backend: str) -> None:
    """Log-probs and entropy of 6 rows (2 ignored) over V = 20011: the 4096-wide blocks of
    large vocabularies, the last one partial; then the in-place backward."""
    logits = (torch.randn(6, 20011, generator=_generator(4)) * 3).to(device, torch.bfloat16)
    logits.requires_grad_()
    labels = _labels(6, 20011, device)
    for inplace in (False, True):
        x = logits * 1 if inplace else logits  # in place: the buffer overwritten is not a leaf
        logp, entropy = token_logprobs(x, labels, temperature=0.8, return_entropy=True,
                                       inplace_backward=inplace, backend=backend)
        (grad,) = _backward([logp, entropy], [logits])
        _finite(logp, entropy, grad)


def run_linear_token_logprobs(device: str, backend: str) -> None:
    """The chunked LM-head variant: 6 rows in chunks of 4 (the last partial), V = 20011."""
    gen = _generator(5)
    hidden = torch.randn(6, 32, generator=gen).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(20011, 32, generator=gen) / 4).to(device, torch.bfloat16).requires_grad_()
    logp, entropy = linear_token_logprobs(hidden, weight, _labels(6, 20011, device),
                                          return_entropy=True, chunk_size=4, backend=backend)
    grads = _backward([logp, entropy], [hidden, weight])
    _finite(logp, entropy, *grads)


def _loss_batch(device: str) -> dict[str, torch.Tensor]:
    """2500 tokens: three 1024-token programs, the last partial; bf16 per-token inputs, 60 %
    of the tokens actions."""
    lengths = [0, 1, 1700, 9, 790]
    num_tokens, gen = sum(lengths), _generator(6)

    def randn(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(num_tokens, generator=gen) * scale

    logp = -torch.rand(num_tokens, generator=gen) * 3
    old = logp + randn(0.3)
    batch = {"logprobs": logp, "old_logprobs": old, "advantages": randn(),
             "ref_logprobs": logp + randn(0.4), "rollout_logprobs": old + randn(0.2),
             "entropy": torch.rand(num_tokens, generator=gen) * 2, "values": randn(),
             "old_values": randn(), "returns": randn()}
    batch = {k: v.to(device, torch.bfloat16) for k, v in batch.items()}
    batch["action_mask"] = (torch.rand(num_tokens, generator=gen) < 0.6).to(device)
    batch["cu_seqlens"] = _cu_seqlens(lengths, device)
    return batch


def run_ppo_loss(device: str, backend: str) -> None:
    """The PPO loss with every feature on (weights from a mode, dual clip, k3 KL, entropy,
    truncated importance weights), forward and backward; then token-mean without weights."""
    b = _loss_batch(device)
    logp, entropy = b["logprobs"].requires_grad_(), b["entropy"].requires_grad_()
    loss, metrics = ppo_loss(logp, b["old_logprobs"], b["advantages"], b["action_mask"],
                             cu_seqlens=b["cu_seqlens"], loss_agg_mode="seq-mean-token-mean",
                             clip_high=0.28, dual_clip=3.0, ref_logprobs=b["ref_logprobs"],
                             kl_coef=0.1, entropy=entropy, entropy_coef=0.01,
                             rollout_logprobs=b["rollout_logprobs"], tis_cap=2.0,
                             backend=backend)
    grads = torch.autograd.grad(loss, [logp, entropy])
    plain, _ = ppo_loss(logp, b["old_logprobs"], b["advantages"], b["action_mask"],
                        backend=backend)
    (plain_grad,) = torch.autograd.grad(plain, [logp])
    _finite(loss, plain, *metrics.values(), *grads, plain_grad)


def run_value_loss(device: str, backend: str) -> None:
    """The clipped value loss with token-mean aggregation, forward and backward."""
    b = _loss_batch(device)
    values = b["values"].requires_grad_()
    loss, metrics = value_loss(values, b["old_values"], b["returns"], b["action_mask"], clip=0.2,
                               backend=backend)
    (grad,) = torch.autograd.grad(loss, [values])
    _finite(loss, *metrics.values(), grad)


KERNELS = {
    "gae": run_gae,
    "varlen_attention": run_varlen_attention,
    "varlen_attention_odd_head_dim": run_varlen_attention_odd_head_dim,
    "token_logprobs": run_token_logprobs,
    "linear_token_logprobs": run_linear_token_logprobs,
    "ppo_loss": run_ppo_loss,
    "value_loss": run_value_loss,
    "varlen_attention_prefix": run_varlen_attention_prefix,  # last: a timeout loses it alone
}
CUDA_CPP = {"gae"}  # csrc/gae.cu; every other entry runs Triton kernels


def run_one(name: str, device: str) -> bool:
    """Runs kernel ``name`` and syncs; prints one line; True when it passed."""
    # The Triton kernels on CUDA; on the CPU each op's own choice (see the module docstring).
    backend = "triton" if device == "cuda" else "auto"
    start = time.perf_counter()
    try:
        KERNELS[name](device, backend)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - report every kernel, not only the first failure
        message = str(error).splitlines()[0] if str(error) else ""
        print(f"{name}: FAILED on {device} ({type(error).__name__}: {message})", flush=True)
        return False
    print(f"{name}: ok on {device} (backend {backend}, {time.perf_counter() - start:.2f} s)",
          flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(KERNELS), help="run this kernel only")
    parser.add_argument("--triton-only", action="store_true",
                        help=f"leave out the CUDA C++ kernels ({', '.join(sorted(CUDA_CPP))})")
    parser.add_argument("--list", action="store_true", help="print the kernel names and exit")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(KERNELS)
    if args.triton_only:
        names = [name for name in names if name not in CUDA_CPP]
    if args.list:
        print("\n".join(names))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False (use --device cpu)",
              file=sys.stderr)
        return 2
    passed = [run_one(name, args.device) for name in names]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
