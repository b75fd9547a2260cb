"""Benchmark: fused log-probs/entropy (``token_logprobs``, ``linear_token_logprobs``; docs/design.md,
"Token-level PPO loss", last paragraph). Forward + backward of ``logp`` and ``entropy``
(the loss ``sum(logp * g1 + entropy * g2)`` with random ``g1, g2``), bf16 logits.

Providers, all in this process, checked before they are timed (ours against the float64
reference on a small instance; every provider's ``logp`` against ours on the timed one):

* ``agentrl_fast``: ours (Triton on CUDA, the torch path on the CPU); for ``token_logprobs``
  also ``agentrl_fast (inplace_backward)`` (d logits written over the logits buffer; timed on
  the overwritten buffer, whose values stay finite).
* ``eager``: what verl runs: ``log_softmax(logits.float() / temperature)`` + gather, entropy as
  ``logsumexp - sum(softmax * logits)``; for ``linear_token_logprobs`` after
  ``logits = hidden @ weight.T``.
* ``eager-rowloop``: TRL's ``selective_log_softmax`` for bf16 (a Python loop over the batch's
  sequences, ``log_softmax`` per sequence; logits ``[B, L, V]`` with ``L = --seq-len``), plus
  verl's entropy on the same loop.
* ``torch.compile``: ``torch.compile(dynamic=True)`` of ``eager`` (for the linear op: the
  matmul, then the same compiled graph; one compile in all). Skipped with ``--tiny``: its
  compile alone takes longer than the tiny budget on a CI CPU.
* ``liger``: Liger-Kernel's ``liger_cross_entropy`` / ``liger_fused_linear_cross_entropy`` with
  ``reduction="none"`` (``logp = -loss``; no entropy), when ``liger_kernel`` is importable.

Shapes: T = 16384 and 65536 tokens, V = 151936, H = 4096 on CUDA; tiny ones on the CPU. Each row
gives time, tokens/s, achieved bandwidth (``token_logprobs``: 3 passes over ``[T, V]`` in the
logits' dtype — forward read, backward read and write) or matrix rate (``linear``: the 3
matmuls of ``2 T H V`` FLOPs a forward + backward needs at least; ours does 4), the peak memory
above the inputs (``peak_gib``, CUDA only) and the ratio provider time / ours. The copy bandwidth
and the bf16 matmul rate are measured in the same run. Baselines that run out of memory (eager
at T = 65536) are reported and skipped; past ``--budget-seconds`` only our rows still run.

Usage (from the repository root)::

    python bench/bench_token_logprobs.py [--device cpu|cuda] [--tiny] [--out DIR]
"""

import argparse
import importlib.util
import time

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.ops.reference import (  # noqa: E402
    linear_token_logprobs_reference, token_logprobs_reference)
from agentrl_fast.ops.token_logprobs import linear_token_logprobs, token_logprobs  # noqa: E402

TEMPERATURE = 0.9


Row = common.Row  # peak_gib: peak memory above the inputs (GiB; CUDA only)


# ---------------------------------------------------------------------------------------------
# Providers: each returns (logp, entropy or None), differentiable


def ours(logits, labels, inplace=False):
    return token_logprobs(logits, labels, temperature=TEMPERATURE, return_entropy=True,
                          inplace_backward=inplace, validate=False)


def eager(logits, labels):
    """verl's logprobs_from_logits (naive) and entropy_from_logits, in float32."""
    z = logits.float() / TEMPERATURE
    log_probs = torch.log_softmax(z, dim=-1)
    logp = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(z, dim=-1)
    entropy = torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)
    return logp, entropy


def eager_rowloop(logits, labels, seq_len):
    """TRL's selective_log_softmax for bf16: a loop over sequences, log_softmax per sequence
    (in the logits' dtype, as TRL does); entropy per sequence like verl's."""
    rows = logits.view(-1, seq_len, logits.shape[-1])
    row_labels = labels.view(-1, seq_len)
    logps, entropies = [], []
    for row, row_label in zip(rows, row_labels):
        z = row / TEMPERATURE
        log_probs = torch.log_softmax(z, dim=-1)
        logps.append(log_probs.gather(-1, row_label.unsqueeze(-1)).squeeze(-1))
        entropies.append(-(log_probs.exp() * log_probs).sum(-1))
    return torch.cat(logps).float(), torch.cat(entropies).float()


_compiled = {}


def compiled_eager(logits, labels):
    if "eager" not in _compiled:
        _compiled["eager"] = torch.compile(eager, dynamic=True)
    return _compiled["eager"](logits, labels)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger(logits, labels):
    from liger_kernel.transformers.functional import liger_cross_entropy

    loss = liger_cross_entropy(logits / TEMPERATURE, labels, reduction="none")
    return -loss.float(), None


def linear_ours(hidden, weight, labels):
    return linear_token_logprobs(hidden, weight, labels, temperature=TEMPERATURE,
                                 return_entropy=True, validate=False)


def linear_eager(hidden, weight, labels):
    return eager(hidden @ weight.T, labels)


def linear_compiled(hidden, weight, labels):
    """The matmul (cuBLAS either way), then the compiled eager graph (one compile for both ops)."""
    return compiled_eager(hidden @ weight.T, labels)


def linear_liger(hidden, weight, labels):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(hidden / TEMPERATURE, weight, labels,
                                            reduction="none")
    return -loss.float(), None


# ---------------------------------------------------------------------------------------------
# Inputs, checks, timing


def make_inputs(num_tokens, vocab, hidden_size, device, dtype, seed, linear):
    gen = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen, device=device)
    g_logp = torch.randn(num_tokens, generator=gen, device=device)
    g_entropy = torch.randn(num_tokens, generator=gen, device=device) * 0.01
    if linear:
        hidden = torch.randn(num_tokens, hidden_size, generator=gen, device=device, dtype=dtype)
        weight = torch.randn(vocab, hidden_size, generator=gen, device=device, dtype=dtype)
        weight /= hidden_size ** 0.5 / 4  # logits of a few units, like a trained LM head
        return {"tensors": (hidden.requires_grad_(), weight.requires_grad_()), "labels": labels,
                "grads": (g_logp, g_entropy)}
    logits = torch.randn(num_tokens, vocab, generator=gen, device=device, dtype=dtype) * 4
    return {"tensors": (logits.requires_grad_(),), "labels": labels, "grads": (g_logp, g_entropy)}


def step(fn, inputs):
    """One forward + backward; returns the detached logp."""
    for t in inputs["tensors"]:
        t.grad = None
    logp, entropy = fn(*inputs["tensors"], inputs["labels"])
    loss = (logp * inputs["grads"][0]).sum()
    if entropy is not None:
        loss = loss + (entropy * inputs["grads"][1]).sum()
    loss.backward()
    return logp.detach()


def check_small(device, dtype, linear):
    """Ours against the float64 reference (values and gradients) on a small instance."""
    inputs = make_inputs(64, 3001, 64, device, dtype, seed=1, linear=linear)
    fn = (lambda h, w, y: linear_ours(h, w, y)) if linear else (lambda x, y: ours(x, y))
    logp = step(fn, inputs)
    grads = [t.grad.double() for t in inputs["tensors"]]
    refs = [t.detach().double().requires_grad_() for t in inputs["tensors"]]
    reference = linear_token_logprobs_reference if linear else token_logprobs_reference
    ref_lp, ref_h = reference(*refs, inputs["labels"], temperature=TEMPERATURE, return_entropy=True)
    ((ref_lp * inputs["grads"][0].double()).sum() + (ref_h * inputs["grads"][1].double()).sum()).backward()
    # bf16 logits/gradients: one rounding of the dtype (x the logits' and matmul depth scale).
    eps = torch.finfo(dtype).eps * (64 if linear else 4)
    errors = [float((logp.double() - ref_lp.detach()).abs().max())]
    errors += [float((g - r.grad).abs().max() / max(1.0, float(r.grad.abs().max())))
               for g, r in zip(grads, refs)]
    if not all(e <= eps * max(1.0, float(ref_lp.detach().abs().max())) for e in errors):
        raise AssertionError(f"ours vs float64 reference: errors {errors} > {eps:.3g}")
    return errors


def peak_gib(fn, inputs, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step(fn, inputs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def timing_options(args):
    if args.tiny:
        return {"warmup": 1, "repeats": 3, "max_seconds": 1.0}
    return {"max_seconds": args.max_seconds}


def bench_shape(op, providers, num_tokens, vocab, hidden_size, device, dtype, args, ceilings):
    linear = op == "linear_token_logprobs"
    inputs = make_inputs(num_tokens, vocab, hidden_size, device, dtype, seed=args.seed,
                         linear=linear)
    shape = (f"T={num_tokens} V={vocab}" + (f" H={hidden_size}" if linear else "")
             + " fwd+bwd logp+entropy")
    print(f"bench {op} {shape}", flush=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows, ours_ms, reference = [], None, None
    for name, fn in providers:
        start = time.perf_counter()
        if not name.startswith("agentrl_fast") and start - args.started > args.budget_seconds:
            print(f"  {name}: skipped (past the run's {args.budget_seconds:.0f} s budget)")
            continue
        try:
            logp = step(fn, inputs)
            if reference is None:
                reference = logp
            else:
                error = float((logp - reference).abs().max())
                if not error <= 0.05 + 0.02 * float(reference.abs().max()):  # bf16 logits
                    raise AssertionError(f"{name}: logp differs from ours by {error:.3g}")
            ms = common.benchmark(lambda: step(fn, inputs), device, **timing_options(args))
            memory = peak_gib(fn, inputs, device)
        except torch.OutOfMemoryError:
            print(f"  {name}: out of memory", flush=True)
            for t in inputs["tensors"]:
                t.grad = None
            torch.cuda.empty_cache()
            continue
        except Exception as error:  # an optional baseline that cannot take these inputs
            if name.startswith("agentrl_fast"):
                raise
            print(f"  {name}: skipped ({type(error).__name__}: {str(error)[:200]})", flush=True)
            continue
        ours_ms = ours_ms or ms
        seconds = ms * 1e-3
        row = Row(op=op, provider=name, shape=shape, dtype=str(dtype).removeprefix("torch."),
                  device=common.device_name(device), time_ms=ms,
                  tokens_per_s=num_tokens / seconds, ratio=ms / ours_ms, peak_gib=memory)
        if linear:
            row.tflops = 6 * num_tokens * hidden_size * vocab / seconds / 1e12
            note = f"{row.tflops:.3g} TFLOP/s = {row.tflops / ceilings['tflops']:.0%} of matmul rate"
        else:
            row.gbps = 3 * num_tokens * vocab * itemsize / seconds / 1e9
            note = f"{row.gbps:.3g} GB/s = {row.gbps / ceilings['gbps']:.0%} of copy bandwidth"
        mem = "" if memory is None else f", peak {memory:.2f} GiB"
        print(f"  {name}: {ms:.3f} ms, {note}{mem} ({time.perf_counter() - start:.1f} s)",
              flush=True)
        rows.append(row)
    inputs = None  # free the [T, V] buffers before the next shape
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def matmul_tflops(device, dtype, tiny) -> float:
    n = 512 if tiny or device.type != "cuda" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = common.benchmark(lambda: a @ b, device, warmup=1, repeats=3, max_seconds=2.0)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def run(args):
    device, dtype = torch.device(args.device), torch.bfloat16
    start = args.started = time.perf_counter()
    if args.tiny:
        token_sizes, vocab, hidden_size, seq_len = [256], 4096, 256, 64
    elif device.type == "cuda":
        token_sizes, vocab, hidden_size, seq_len = [16384, 65536], 151936, 4096, args.seq_len
    else:
        token_sizes, vocab, hidden_size, seq_len = [1024], 151936, 1024, 512
    print(f"T in {token_sizes}, V = {vocab}, H = {hidden_size}, bf16, temperature {TEMPERATURE}")
    for op, linear in (("token_logprobs", False), ("linear_token_logprobs", True)):
        print(f"check {op}: ours vs float64 reference, errors "
              f"{', '.join(f'{e:.1e}' for e in check_small(device, dtype, linear))}", flush=True)
    ceilings = {"gbps": common.copy_bandwidth_gbps(device),
                "tflops": matmul_tflops(device, dtype, args.tiny)}
    print(f"ceilings ({common.device_name(device)}): copy {ceilings['gbps']:.1f} GB/s, "
          f"bf16 matmul {ceilings['tflops']:.3g} TFLOP/s", flush=True)
    use_compile = not args.tiny and not args.no_compile
    token_providers = [
        ("agentrl_fast", lambda x, y: ours(x, y)),
        ("eager", eager),
        ("eager-rowloop", lambda x, y: eager_rowloop(x, y, seq_len)),
    ]
    linear_providers = [("agentrl_fast", linear_ours), ("eager", linear_eager)]
    if use_compile:
        token_providers.append(("torch.compile", compiled_eager))
        linear_providers.append(("torch.compile", linear_compiled))
    if args.only_compiled:  # the GPU suite's last stage: compiled baselines after the others
        token_providers = [p for p in token_providers if p[0] in ("agentrl_fast", "torch.compile")]
        linear_providers = [p for p in linear_providers
                            if p[0] in ("agentrl_fast", "torch.compile")]
    if liger_available():
        token_providers.append(("liger", liger))
        linear_providers.append(("liger", linear_liger))
    else:
        print("note: liger_kernel is not importable; skipping Liger-Kernel's fused ops")
    # Last: it overwrites the logits with their gradient (the others are checked against ours
    # on the intact logits first).
    token_providers.append(("agentrl_fast (inplace_backward)", lambda x, y: ours(x, y, inplace=True)))
    rows, path = [], None
    for op, providers in (("token_logprobs", token_providers),
                          ("linear_token_logprobs", linear_providers)):
        for num_tokens in token_sizes:
            new = bench_shape(op, providers, num_tokens, vocab, hidden_size, device, dtype, args,
                              ceilings)
            path = common.write_rows(new, "token_logprobs", args.out)  # kept if cut off later
            rows += new
    common.print_table(rows)
    print(f"rows appended to {path}")
    print(f"total {time.perf_counter() - start:.1f} s")
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CI dry run, < 30 s)")
    parser.add_argument("--out", default=None,
                        help="folder for token_logprobs.jsonl (default bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=4096,
                        help="sequence length of eager-rowloop's [B, L, V] view (CUDA)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--only-compiled", action="store_true",
                        help="ours and torch.compile only (the GPU suite's compiled stage)")
    parser.add_argument("--budget-seconds", type=float, default=45.0,
                        help="after this many seconds only our providers still run (the GPU "
                             "suite's stage cap)")
    parser.add_argument("--max-seconds", type=float, default=5.0,
                        help="stop repeating a provider after about this many seconds")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
