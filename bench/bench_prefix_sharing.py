"""Benchmark: prefix-shared (tree) packing against the plain packing of the same sub-traces (issue
47), the attention op and the main job's training step, each beside a FLOP model's ideal.

In one run:

1. **The op**, forward + backward (``torch.autograd.grad`` of a random ``dout``):
   ``varlen_attention(prefix_of=...)`` on the shared layout against the plain op on the unshared
   packing of the same sequences, on

   - the main job's micro-batches: real sub-traces of ``configs/default.yaml`` (the vault
     expert through the trainer's rollout engine, ``train.rollout`` limits and compaction),
     8 tasks x 4 samples grouped by task (the first mini-batch: 2 tasks x 4), the same
     shuffled (8 random rollouts), and 32 tasks x 1 (8 rollouts), laid out by
     ``pack_sub_traces(share_prefixes=True)``; the tiny model's 4 query / 2 KV heads of 16;
   - long prompts: one 2048-token prompt with 8 suffixes of 256, 8 query / 2 KV heads, head
     dim 64 (CPU) or 64 and 128 (CUDA, bfloat16).

   Backends: every one available except the float32 reference above ``--max-reference-gflop``.
   CPU: ``native`` (its own prefix kernels), ``native+generic`` (the generic LSE-merge path
   over native's plain kernels: native registered again here without its prefix kernels, so
   its cross pass is the float32 reference one), ``cpu_flash`` (the generic path, torch's flash
   kernel as the cross pass). CUDA: ``triton`` (its own prefix kernels), ``triton+1split``
   (the same with each prefix tile's dk/dv in one program: what the split buys; on the long
   prompts ``+2split``, ``+4split``, ``+8split`` too: where the launcher's count stands),
   ``torch`` and ``flash_attn`` (the generic path over their raw varlen kernels). Inputs are random normal on
   the shared rows; the unshared packing's are gathered from them (``rows``), so both compute
   the same function: their outputs are compared before anything is timed.

2. **A training step of the main job** (the default run: PPO, separate critic, 4 mini-batches
   of whole rollouts, ``micro_batch_tokens`` 16384), at 8 tasks x 4 samples and 32 x 1, with
   shuffled mini-batches (a seeded shuffle of the rollouts) and task-grouped ones (of the
   tasks): per micro-batch the policy's forward + backward of the PPO loss path
   (``policy_logprobs`` on the action rows with entropies, ``ppo_loss``) and the critic's
   (``critic_values``, ``value_loss``), with and without ``layout=`` (``pack_sub_traces``
   with ``share_prefixes`` True / False); optimizer steps are not timed. Packing (host side,
   per step) is timed apart. ``--profile`` prints a profile of each step's shared and plain
   passes (where the time goes). The mini-batches are the trainer's of a run's first step.

3. **The trainer's step**: ``Trainer.train_on`` of the same rollouts (the critic's scoring,
   GAE, the updates with their optimizer steps) by two trainers of the same policy with
   ``train.share_prefixes`` on and off, each call the run's first step again (a fixed step
   batch); the trainer's own ``shared_token_fraction`` metrics beside it.

FLOP model. Attention: forward ``4 * D * Hq`` per (query, key) pair a query attends (plain: a
causal sequence of L tokens has ``L(L+1)/2`` pairs; shared: a suffix of length L after a
prefix of P adds ``L * P``), backward 2.5x the forward (flash-attention's count), times the
layers. Linear layers: ``2 * params * rows`` forward, 3x that forward + backward, for every
linear of the backbone on every row the model runs, the LM head on the action rows only
(``policy_logprobs(token_mask=)``), the critic's scalar head on every row. Ideal speed-up =
plain FLOPs / shared FLOPs, for attention and the linear layers separately and combined;
"% of ideal" = measured speed-up / ideal. Element-wise work (norms, rotary, SwiGLU) scales with
the rows like the linear layers and is not counted; fixed per-call costs do not shrink at all.

Timing: ``bench/common.py``'s ``benchmark``: on the CPU the shared and plain variants
alternate call by call after a warm-up (``--rounds`` each, the median; shared machines drift),
on CUDA each is timed by ``triton.testing.do_bench`` (median). Rows go to
``prefix_sharing.jsonl`` (ops ``prefix_attention``, ``prefix_step`` and
``prefix_trainer_step``; ratio = plain time / shared time), the tables to a markdown record (``--record``; default
``bench/results/prefix_sharing.md``, or ``OUT/prefix_sharing.md`` with ``--out``).

Usage (from the repository root)::

    python bench/bench_prefix_sharing.py [--device cpu|cuda] [--threads N] [--tiny] [--out DIR]
        [--profile-ops]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import common  # bench/ is the script's folder: first on sys.path
from agentrl_fast.ops import varlen_attention_triton as triton_launcher
from agentrl_fast.ops.varlen_attention import (BACKENDS, available_backends, register_backend,
                                               varlen_attention)

FWD_BWD = 3.5  # forward + backward FLOPs over forward FLOPs (backward 2.5x the forward)
MATRIX_PASSES = 3  # a linear layer's forward + backward: 3 matrix products of its forward's size
CONFIG = common.ROOT / "configs" / "default.yaml"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Sizes:
    """What one run measures."""
    long_prompt: tuple[int, int, int]  # (prompt tokens, suffixes, tokens per suffix)
    long_heads: tuple[int, int]  # (query heads, KV heads)
    long_head_dims: tuple[int, ...]
    op_scenarios: tuple[tuple[str, int, int], ...]  # (mini-batch order, tasks, samples per task)
    step_scenarios: tuple[tuple[str, int, int], ...]
    mini_batches: int


# The main job's comparisons: (mini-batch order, tasks, samples per task).
MAIN_JOB_OPS = (("task", 8, 4), ("shuffle", 8, 4), ("shuffle", 32, 1))
MAIN_JOB_STEPS = (("shuffle", 8, 4), ("task", 8, 4), ("shuffle", 32, 1), ("task", 32, 1))
SIZES = {
    "cpu": Sizes((2048, 8, 256), (8, 2), (64,), MAIN_JOB_OPS, MAIN_JOB_STEPS, 4),
    "cuda": Sizes((2048, 8, 256), (8, 2), (128, 64), MAIN_JOB_OPS, MAIN_JOB_STEPS, 4),
    "tiny": Sizes((256, 4, 64), (4, 2), (16,), (("task", 2, 2),),
                  (("task", 2, 2), ("shuffle", 4, 1)), 1),
}


# ---------------------------------------------------------------------------------------------
# Layouts and the FLOP model (pure functions of lengths).


@dataclass
class Layouts:
    """The same ``B`` sequences packed plainly (``plain_cu [B+1]``, ``T`` tokens) and with shared
    prefixes (``shared_cu [Bs+1]`` over ``Ts`` rows, ``prefix_of [Bs]``); ``rows [T]`` int64:
    the shared row of each plain token."""
    name: str
    plain_cu: list[int]
    shared_cu: list[int]
    prefix_of: list[int]
    rows: torch.Tensor

    @property
    def plain_tokens(self) -> int:
        return self.plain_cu[-1]

    @property
    def shared_rows(self) -> int:
        return self.shared_cu[-1]


def _lengths(cu: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(cu)]


def plain_pairs(cu: list[int]) -> int:
    """(query, key) pairs of causal attention within each sequence of ``cu`` ``[B+1]``."""
    return sum(n * (n + 1) // 2 for n in _lengths(cu))


def shared_pairs(cu: list[int], prefix_of: list[int]) -> int:
    """(query, key) pairs of the prefix-shared mode: causal within each segment, plus every key
    of its prefix for each token of a suffix."""
    lengths = _lengths(cu)
    return sum(n * (n + 1) // 2 + (n * lengths[p] if p >= 0 else 0)
               for n, p in zip(lengths, prefix_of))


def attention_flops(pairs: int, heads_q: int, head_dim: int, factor: float = FWD_BWD) -> float:
    """Forward ``4 * D * Hq`` per pair, times ``factor`` (3.5: forward + backward)."""
    return 4.0 * head_dim * heads_q * pairs * factor


def long_prompt_layouts(prompt: int, suffixes: int, suffix: int) -> Layouts:
    """One prompt with ``suffixes`` suffixes: plainly ``suffixes`` sequences of ``prompt +
    suffix`` tokens, shared ``[P][S1]..[Sn]``."""
    plain_cu = [i * (prompt + suffix) for i in range(suffixes + 1)]
    shared_cu = [0] + [prompt + i * suffix for i in range(suffixes + 1)]
    rows = torch.cat([torch.cat([torch.arange(prompt),
                                 torch.arange(prompt + i * suffix, prompt + (i + 1) * suffix)])
                      for i in range(suffixes)])
    return Layouts(f"prompt {prompt} + {suffixes} x {suffix}", plain_cu, shared_cu,
                   [-1] + [0] * suffixes, rows)


def packed_layouts(name: str, packed) -> Layouts:
    """A ``PackedBatch`` with its ``shared`` layout (``pack_sub_traces(share_prefixes=True)``)."""
    shared = packed.shared
    return Layouts(name, packed.cu_seqlens.tolist(), shared.cu_seqlens.tolist(),
                   shared.prefix_of.tolist(), shared.rows.cpu())


def trie_saved(keys: list[list[int]]) -> int:
    """Tokens a full trie over the shareable prefixes ``keys`` would save (every shared prefix
    laid out once, at any depth): their tokens less the trie's nodes."""
    root: dict = {}
    nodes = 0
    for key in keys:
        node = root
        for token in key:
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return sum(len(k) for k in keys) - nodes


# ---------------------------------------------------------------------------------------------
# Timing.


@dataclass(frozen=True)
class Timing:
    """Median wall-clock milliseconds and, on the CPU, the median process CPU milliseconds of
    the same calls (less sensitive to other jobs on a shared machine; None on CUDA)."""
    wall_ms: float
    cpu_ms: float | None = None


def paired_times(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int,
                 max_seconds: float, warmup: bool = True) -> dict[str, Timing]:
    """Each function's ``Timing``. CPU: one warm-up call each (unless ``warmup`` is False: the
    caller's check was it), then ``rounds`` rounds of one timed call each in turn
    (``common.benchmark``; fewer rounds, at least 2, past ``max_seconds``). CUDA:
    ``common.benchmark`` of each."""
    if device.type == "cuda":
        return {name: Timing(common.benchmark(fn, device, max_seconds=max_seconds))
                for name, fn in fns.items()}
    if warmup:
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for done in range(rounds):
        for name, fn in fns.items():
            before = time.process_time()
            wall[name].append(common.benchmark(fn, device, warmup=0, repeats=1))
            cpu[name].append((time.process_time() - before) * 1e3)
        if done >= 1 and time.perf_counter() - start > max_seconds:
            break
    return {name: Timing(statistics.median(wall[name]), statistics.median(cpu[name]))
            for name in fns}


@dataclass
class Compared:
    """Plain and shared timings of one comparison."""
    plain: Timing
    shared: Timing

    @property
    def speedup(self) -> float:
        return self.plain.wall_ms / self.shared.wall_ms

    @property
    def cpu_speedup(self) -> float | None:
        return self.plain.cpu_ms / self.shared.cpu_ms if self.shared.cpu_ms else None


class Budget:
    """Seconds after which nothing new starts (None: no limit)."""

    def __init__(self, seconds: float | None):
        self.deadline = None if not seconds else time.perf_counter() + seconds

    def spent(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


def matrix_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """TFLOP/s of an ``n^3`` matmul in ``dtype``: the ceiling the op's rates are stated against."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    options = {"warmup": 1, "repeats": 3, "max_seconds": 1.0} if device.type == "cpu" else {}
    ms = common.benchmark(lambda: torch.mm(a, b, out=c), device, **options)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Part 1: the op.


def generic_backend(name: str) -> str:
    """``name`` registered again as ``NAME+generic`` without its own prefix kernels, so the
    prefix-shared mode runs the generic LSE-merge path over its plain kernels."""
    generic = f"{name}+generic"
    if generic not in BACKENDS:
        register_backend(dataclasses.replace(BACKENDS[name], name=generic, prefix_forward=None,
                                             prefix_backward=None))
    return generic


# The dk/dv split counts timed beside the launcher's own on CUDA's long prompts: what the
# split buys (1) and where its choice (``prefix_dkdv_splits``) stands among the others.
SPLIT_SWEEP = (1, 2, 4, 8)


def split_backend(splits: int, name: str = "triton") -> str:
    """``triton+{splits}split``: the Triton prefix kernels with each prefix key tile's dk/dv
    over ``splits`` programs (``dkdv_splits_held`` during its backward)."""
    variant = f"{name}+{splits}split"
    if variant not in BACKENDS:
        backward = BACKENDS[name].prefix_backward

        def held(*args) -> None:
            with triton_launcher.dkdv_splits_held(splits):
                backward(*args)

        register_backend(dataclasses.replace(BACKENDS[name], name=variant,
                                             prefix_backward=held))
    return variant


def op_backends(device: torch.device, reference_ok: bool) -> list[str]:
    """The backends timed: every available one (the reference only when ``reference_ok``), on
    the CPU native's generic path too, on CUDA triton with one dk/dv split too."""
    names = [n for n in available_backends(device) if "+" not in n
             and (n != "reference" or reference_ok)]
    if device.type == "cpu" and "native" in names and BACKENDS["native"].prefix_forward:
        names.insert(names.index("native") + 1, generic_backend("native"))
    if device.type == "cuda" and "triton" in names:
        names.insert(names.index("triton") + 1, split_backend(1))
    return names


def launcher_splits(layouts: Layouts, heads: tuple[int, int], dtype: torch.dtype,
                    head_dim: int, device: torch.device) -> int:
    """The dk/dv split count the Triton launcher picks for ``layouts``' shared packing."""
    q, k = (torch.empty(layouts.shared_rows, h, head_dim, dtype=dtype, device=device)
            for h in heads)
    return triton_launcher.chosen_dkdv_splits(
        q, k, torch.tensor(layouts.shared_cu, dtype=torch.int32, device=device),
        torch.tensor(layouts.prefix_of, dtype=torch.int32, device=device))


def long_prompt_backends(backends: list[str]) -> list[str]:
    """``backends`` with, after ``triton+1split``, the other counts of ``SPLIT_SWEEP``."""
    if "triton+1split" not in backends:
        return backends
    at = backends.index("triton+1split") + 1
    return backends[:at] + [split_backend(n) for n in SPLIT_SWEEP[1:]] + backends[at:]


@dataclass
class OpInputs:
    """Random inputs of both packings: shared ``q [Ts, Hq, D]``, ``k, v [Ts, Hk, D]`` and the
    plain ones gathered from them (``[T, ...]``), leaves; a ``dout`` each."""
    shared: tuple[torch.Tensor, ...]
    plain: tuple[torch.Tensor, ...]
    dout_shared: torch.Tensor
    dout_plain: torch.Tensor
    shared_cu: torch.Tensor
    plain_cu: torch.Tensor
    prefix_of: torch.Tensor
    shared_max: int
    plain_max: int


def op_inputs(layouts: Layouts, heads: tuple[int, int], head_dim: int, dtype: torch.dtype,
              device: torch.device, seed: int) -> OpInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = layouts.rows.to(device)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    shared = (randn(layouts.shared_rows, heads[0], head_dim),
              randn(layouts.shared_rows, heads[1], head_dim),
              randn(layouts.shared_rows, heads[1], head_dim))
    plain = tuple(x[rows].requires_grad_() for x in shared)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return OpInputs(tuple(x.requires_grad_() for x in shared), plain,
                    randn(layouts.shared_rows, heads[0], head_dim),
                    randn(layouts.plain_tokens, heads[0], head_dim),
                    int32(layouts.shared_cu), int32(layouts.plain_cu), int32(layouts.prefix_of),
                    max(_lengths(layouts.shared_cu)), max(_lengths(layouts.plain_cu)))


def op_calls(inputs: OpInputs, backend: str) -> dict[str, Callable[[], tuple]]:
    """``{"shared": fn, "plain": fn}``: forward + backward, each returning (out, dq, dk, dv)."""
    def call(leaves, cu, max_len, prefix_of, dout):
        def run():
            out = varlen_attention(*leaves, cu, max_len, prefix_of=prefix_of, backend=backend,
                                   validate=False)
            return (out.detach(),) + torch.autograd.grad(out, leaves, dout)
        return run

    return {"shared": call(inputs.shared, inputs.shared_cu, inputs.shared_max, inputs.prefix_of,
                           inputs.dout_shared),
            "plain": call(inputs.plain, inputs.plain_cu, inputs.plain_max, None,
                          inputs.dout_plain)}


def relative_difference(plain: torch.Tensor, shared: torch.Tensor, rows: torch.Tensor) -> float:
    """max |plain out - shared out[rows]| / max |plain out|: the same function on both packings."""
    plain, shared = plain.float(), shared.float()
    return float((plain - shared[rows.to(shared.device)]).abs().max()
                 / plain.abs().max().clamp_min(1e-30))


@dataclass
class OpResult(Compared):
    layouts: Layouts = None
    backend: str = ""
    heads: tuple[int, int] = (0, 0)
    head_dim: int = 0
    dtype: str = ""
    difference: float = 0.0

    @property
    def ideal(self) -> float:
        return plain_pairs(self.layouts.plain_cu) / shared_pairs(self.layouts.shared_cu,
                                                                 self.layouts.prefix_of)

    def tflops(self, shared: bool) -> float:
        pairs = (shared_pairs(self.layouts.shared_cu, self.layouts.prefix_of) if shared
                 else plain_pairs(self.layouts.plain_cu))
        ms = (self.shared if shared else self.plain).wall_ms
        return attention_flops(pairs, self.heads[0], self.head_dim) / (ms * 1e-3) / 1e12


def run_op(layouts: Layouts, heads: tuple[int, int], head_dim: int, dtype: torch.dtype,
           backends: list[str], device: torch.device, args, budget: Budget,
           failures: list[str]) -> list[OpResult]:
    """Every backend on one instance: checked (outputs of both packings agree), then timed."""
    results = []
    inputs = op_inputs(layouts, heads, head_dim, dtype, device, args.seed)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    gflop = attention_flops(plain_pairs(layouts.plain_cu), heads[0], head_dim) / 1e9
    print(f"op {layouts.name}: T={layouts.plain_tokens} -> {layouts.shared_rows} rows, "
          f"Hq={heads[0]} Hk={heads[1]} D={head_dim} {dtype}, plain fwd+bwd {gflop:.3g} GFLOP",
          flush=True)
    plain_runs: dict[str, tuple[torch.Tensor, Timing]] = {}  # plain kernel: (out, timing)
    for backend in backends:
        if budget.spent():
            print(f"  note: time budget spent; skipped {backend}", flush=True)
            continue
        if backend == "reference" and gflop > args.max_reference_gflop:
            print(f"  note: reference skipped ({gflop:.3g} GFLOP > --max-reference-gflop "
                  f"{args.max_reference_gflop})", flush=True)
            continue
        result = time_backend(inputs, layouts, backend, plain_runs, args, device)
        if isinstance(result, str):
            print(f"  note: {backend} skipped: {result}", flush=True)
            continue
        if not result.difference <= tolerance:
            failures.append(f"{layouts.name} {backend}: shared and plain outputs differ by "
                            f"{result.difference:.3g} (> {tolerance:g})")
            print(f"  FAILED {failures[-1]}", flush=True)
            continue
        result.heads, result.head_dim = heads, head_dim
        result.dtype = str(dtype).removeprefix("torch.")
        results.append(result)
        print(f"  {backend}: plain {result.plain.wall_ms:.3f} ms, shared "
              f"{result.shared.wall_ms:.3f} ms, speed-up {result.speedup:.2f}x of ideal "
              f"{result.ideal:.2f}x ({result.speedup / result.ideal:.0%})"
              + (f", CPU time {result.cpu_speedup:.2f}x" if result.cpu_speedup else "")
              + f"; max rel diff {result.difference:.1e}", flush=True)
    return results


def time_backend(inputs: OpInputs, layouts: Layouts, backend: str,
                 plain_runs: dict[str, tuple[torch.Tensor, Timing]], args,
                 device: torch.device) -> OpResult | str:
    """One backend on one instance: its shared and plain passes checked against each other,
    then timed (the check call is the warm-up). ``NAME+generic`` runs NAME's plain kernel: its
    plain output and time are NAME's (``plain_runs``). A string: why it cannot run."""
    base = backend.split("+")[0]
    calls = op_calls(inputs, backend)
    try:
        shared_out = calls["shared"]()[0]
        plain_out, plain = plain_runs.get(base) or (calls["plain"]()[0], None)
    except (ValueError, RuntimeError, NotImplementedError) as error:
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    if plain is not None:
        del calls["plain"]
    difference = relative_difference(plain_out, shared_out, layouts.rows)
    times = paired_times(calls, device, args.rounds, args.max_seconds, warmup=False)
    if args.profile_ops and device.type == "cuda" and backend in PROFILED:
        profile_op(calls, backend, device)
    if plain is None:
        plain = plain_runs.setdefault(base, (plain_out, times["plain"]))[1]
    return OpResult(plain, times["shared"], layouts, backend, difference=difference)


PROFILED = ("triton", "torch")  # --profile-ops: our kernels and the generic path over torch's


def profile_op(calls: dict[str, Callable[[], tuple]], backend: str, device: torch.device) -> None:
    """Where one call's time goes on the GPU: its kernels by GPU time, and the host's time
    (``--profile-ops``; after the timed calls)."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in calls.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        print(f"  profile of {backend} {name}:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))


def op_rows(results: list[OpResult], device: torch.device) -> list[common.Row]:
    rows = []
    for r in results:
        shape = (f"{r.layouts.name} T={r.layouts.plain_tokens}->{r.layouts.shared_rows} "
                 f"Hq={r.heads[0]} Hk={r.heads[1]} D={r.head_dim} fwd+bwd")
        for shared in (True, False) if "+" not in r.backend else (True,):  # (NAME's plain)
            ms = (r.shared if shared else r.plain).wall_ms
            rows.append(common.Row(
                op="prefix_attention", provider=f"{r.backend} {'shared' if shared else 'plain'}",
                shape=shape, dtype=r.dtype, device=common.device_name(device), time_ms=ms,
                tokens_per_s=r.layouts.plain_tokens / (ms * 1e-3), tflops=r.tflops(shared),
                ratio=ms / r.shared.wall_ms))
    return rows


# ---------------------------------------------------------------------------------------------
# The main job: models, rollouts, mini-batches, micro-batches.


@dataclass
class MainJob:
    config: object
    environment: object
    chat: object
    policy: torch.nn.Module
    critic: torch.nn.Module


def main_job(device: torch.device) -> MainJob:
    """The default run's environment, chat format, policy (the tiny model, fused layers, packed
    attention) and separate critic, on ``device``."""
    from agentrl_fast.config import load_config
    from agentrl_fast.models.attention import use_packed_attention
    from agentrl_fast.models.critic import make_critic
    from agentrl_fast.train.run import build

    config = load_config(CONFIG)
    environment, chat, policy = build(config)
    policy = use_packed_attention(policy).to(device)
    policy.train()
    critic = make_critic(policy)
    critic.train()
    return MainJob(config, environment, chat, policy, critic)


def rollouts(job: MainJob, tasks: int, samples: int, seed: int) -> list:
    """``tasks x samples`` rollouts of the vault expert through the trainer's rollout engine
    (the run's ``train.rollout`` limits and compaction), task by task."""
    from agentrl_fast.envs import expert_action
    from agentrl_fast.generators import ScriptedGenerator
    from agentrl_fast.harness import RolloutEngine

    config = dataclasses.replace(job.config.train.rollout, samples_per_task=samples)
    engine = RolloutEngine(ScriptedGenerator(expert_action, job.chat), job.chat,
                           job.environment, config)
    return engine.run(job.environment.tasks("train")[:tasks], seed=seed)


def mini_batches(trajectories: list, order: str, count: int, seed: int) -> list[list[int]]:
    """The first epoch's mini-batches of sub-trace numbers (the sub-traces in rollout order) of
    a run's first step (``seed``: ``train.seed``), as the trainer draws them
    (``train.update.mini_batches``): ``count`` groups of a seeded shuffle of the rollouts
    (``"shuffle"``) or of the tasks, a task's rollouts kept together (``"task"``)."""
    from agentrl_fast.seeds import derive_seed

    units, first = {}, 0
    for trajectory in trajectories:
        members = list(range(first, first + len(trajectory.sub_traces)))
        first += len(members)
        key = trajectory.task_id if order == "task" else trajectory.rollout_id
        units.setdefault(key, []).extend(members)
    groups = list(units.values())
    shuffled = torch.randperm(len(groups), generator=torch.Generator().manual_seed(
        derive_seed(seed, "minibatch", 0, 0))).tolist()
    size = math.ceil(len(groups) / count)
    return [sorted(i for g in shuffled[k:k + size] for i in groups[g])
            for k in range(0, len(groups), size)]


def micro_plan(sub_traces: list, groups: list[list[int]], budget: int) -> list[list[int]]:
    """Each mini-batch's micro-batches under ``micro_batch_tokens`` (the trainer's plan)."""
    from agentrl_fast.train.packing import micro_batches

    plan = []
    for indices in groups:
        for micro in micro_batches([len(sub_traces[i].ids) for i in indices], budget):
            plan.append([indices[j] for j in micro])
    return plan


def pack_step(sub_traces: list, plan: list[list[int]], share: bool) -> list:
    from agentrl_fast.train.packing import pack_sub_traces, rollout_index_map

    index = rollout_index_map(sub_traces)
    return [pack_sub_traces(sub_traces, micro, index, share_prefixes=share) for micro in plan]


# ---------------------------------------------------------------------------------------------
# Part 2: the training step.


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP model reads of the policy."""
    layers: int
    heads_q: int
    head_dim: int
    hidden: int
    vocab: int
    backbone_linear: int  # parameters in the backbone's linear layers


def model_shape(policy: torch.nn.Module) -> ModelShape:
    config = policy.config
    backbone = getattr(policy, policy.base_model_prefix)
    linear = sum(m.weight.numel() for m in backbone.modules() if isinstance(m, torch.nn.Linear))
    return ModelShape(config.num_hidden_layers, config.num_attention_heads,
                      getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
                      config.hidden_size, policy.get_output_embeddings().weight.shape[0], linear)


@dataclass
class StepFlops:
    """FLOPs of a step's passes, plain and shared."""
    attention_plain: float = 0.0
    attention_shared: float = 0.0
    linear_plain: float = 0.0
    linear_shared: float = 0.0
    tokens: int = 0
    rows: int = 0
    trie_saved: int = 0

    def add(self, packed, shape: ModelShape, shareable: list[int], policy: bool = True,
            backward: bool = True) -> None:
        """One micro-batch (a ``PackedBatch`` with its ``shared`` layout) through the critic
        and, with ``policy``, the policy (the LM head on the action rows only), forward and,
        with ``backward``, backward."""
        layout = packed.shared
        models = 2 if policy else 1
        plain = plain_pairs(packed.cu_seqlens.tolist())
        shared = shared_pairs(layout.cu_seqlens.tolist(), layout.prefix_of.tolist())
        per_pair = models * shape.layers * attention_flops(
            1, shape.heads_q, shape.head_dim, FWD_BWD if backward else 1.0)
        self.attention_plain += per_pair * plain
        self.attention_shared += per_pair * shared
        head = shape.hidden * shape.vocab * int(packed.action_mask.sum()) if policy else 0
        passes = MATRIX_PASSES if backward else 1
        for rows, field in ((packed.num_tokens, "linear_plain"),
                            (layout.input_ids.shape[1], "linear_shared")):
            flops = 2 * passes * (models * shape.backbone_linear * rows + head
                                  + shape.hidden * rows)  # the critic's scalar head
            setattr(self, field, getattr(self, field) + flops)
        self.tokens += packed.num_tokens
        self.rows += layout.input_ids.shape[1]
        ids = packed.input_ids[0].tolist()
        bounds = packed.cu_seqlens.tolist()
        self.trie_saved += trie_saved([ids[a:a + n] for a, n in zip(bounds[:-1], shareable)])

    def plus(self, other: StepFlops) -> StepFlops:
        return StepFlops(*(getattr(self, f.name) + getattr(other, f.name)
                           for f in dataclasses.fields(self)))

    def ideal(self, part: str) -> float:
        if part == "combined":
            return ((self.attention_plain + self.linear_plain)
                    / (self.attention_shared + self.linear_shared))
        return getattr(self, f"{part}_plain") / getattr(self, f"{part}_shared")

    @property
    def shared_fraction(self) -> float:
        return 1 - self.rows / self.tokens


def _shareable(sub_trace) -> int:
    """Tokens before the first action token (what ``pack_sub_traces`` may share)."""
    return next((i for i, a in enumerate(sub_trace.action_mask) if a), len(sub_trace.ids))


@dataclass
class Micro:
    """One micro-batch's tensors on the device and its loss inputs."""
    packed: object
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor


def step_inputs(job: MainJob, packed_list: list, device: torch.device, seed: int) -> list[Micro]:
    """Each micro-batch on the device with the loss's inputs: old log-probs from a no-grad
    pass (scoring), random advantages and returns, zero old values."""
    from agentrl_fast.models.policy import policy_logprobs

    gen = torch.Generator().manual_seed(seed)
    micros = []
    temperature = job.config.train.rollout.sampling.temperature
    for packed in packed_list:
        packed = packed.to(device)
        with torch.no_grad():
            old = policy_logprobs(job.policy, packed.input_ids, packed.position_ids,
                                  packed.cu_seqlens, packed.max_seqlen, temperature=temperature,
                                  token_mask=packed.action_mask)
        count = packed.num_tokens
        micros.append(Micro(packed, old, torch.randn(count, generator=gen).to(device),
                            torch.zeros(count, device=device),
                            torch.randn(count, generator=gen).to(device)))
    return micros


def step_call(job: MainJob, micros: list[Micro], shared: bool,
              device: torch.device) -> Callable[[], None]:
    """The step's forward + backward passes: per micro-batch the policy's PPO loss path and the
    critic's value loss, each backward (gradients accumulate, as over a mini-batch)."""
    from agentrl_fast.models.critic import critic_values
    from agentrl_fast.models.policy import policy_logprobs
    from agentrl_fast.ops import ppo_loss, value_loss

    train = job.config.train
    temperature = train.rollout.sampling.temperature

    def run():
        job.policy.zero_grad(set_to_none=True)
        job.critic.zero_grad(set_to_none=True)
        for m in micros:
            p = m.packed
            inputs = (p.input_ids, p.position_ids, p.cu_seqlens, p.max_seqlen)
            layout = p.shared if shared else None
            logp, entropy = policy_logprobs(job.policy, *inputs, temperature=temperature,
                                            return_entropy=True, token_mask=p.action_mask,
                                            layout=layout)
            loss, _ = ppo_loss(logp, m.old_logprobs, m.advantages, p.action_mask,
                               clip_low=train.clip_low, clip_high=train.clip_high,
                               entropy=entropy, entropy_coef=train.entropy_coef)
            loss.backward()
            values, _ = critic_values(job.critic, *inputs, layout=layout)
            loss, _ = value_loss(values, m.old_values, m.returns, p.action_mask,
                                 clip=train.value_clip)
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


@dataclass
class StepResult(Compared):
    order: str = ""
    tasks: int = 0
    samples: int = 0
    micro_batches: int = 0
    flops: StepFlops = None
    packing: Compared = None  # pack_sub_traces of the step's micro-batches (host)
    same_as: str = ""  # another scenario with the same micro-batches (timed once)

    @property
    def name(self) -> str:
        return f"{self.tasks}x{self.samples} {self.order}"


def step_plan(trajectories: list, order: str, count: int, budget: int, seed: int
              ) -> list[list[int]]:
    """The step's micro-batches (sub-trace numbers) for a mini-batch order."""
    sub_traces = [s for t in trajectories for s in t.sub_traces]
    return micro_plan(sub_traces, mini_batches(trajectories, order, count, seed), budget)


def step_scenario(job: MainJob, trajectories: list, scenario: tuple[str, int, int],
                  plan: list[list[int]], device: torch.device, args) -> StepResult:
    """One step's timings and FLOPs: ``scenario`` (mini-batch order, tasks, samples per task),
    ``plan`` its micro-batches."""
    order, tasks, samples = scenario
    sub_traces = [s for t in trajectories for s in t.sub_traces]
    packed = pack_step(sub_traces, plan, True)
    shape = model_shape(job.policy)
    flops = StepFlops()
    for micro, batch in zip(plan, packed):
        flops.add(batch, shape, [_shareable(sub_traces[i]) for i in micro])
    packing = paired_times({"plain": lambda: pack_step(sub_traces, plan, False),
                            "shared": lambda: pack_step(sub_traces, plan, True)},
                           torch.device("cpu"), args.rounds, args.max_seconds / 4)
    micros = step_inputs(job, packed, device, args.seed)
    calls = {"shared": step_call(job, micros, True, device),
             "plain": step_call(job, micros, False, device)}
    if args.profile:
        profile_step(calls)
    times = paired_times(calls, device, args.rounds, args.max_seconds)
    return StepResult(times["plain"], times["shared"], order, tasks, samples, len(plan), flops,
                      Compared(packing["plain"], packing["shared"]))


def profile_step(calls: dict[str, Callable[[], None]]) -> None:
    """The ops each variant spends its time in (after a warm-up call)."""
    from torch.profiler import profile

    for name, fn in calls.items():
        fn()
        with profile() as prof:
            fn()
        print(f"profile of the {name} step:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


# ---------------------------------------------------------------------------------------------
# Part 3: the trainer's own step, train.share_prefixes on and off.


@dataclass
class TrainerResult(Compared):
    order: str = ""
    tasks: int = 0
    samples: int = 0
    scoring: StepFlops = None  # the critic's scoring forward over the step's micro-batches
    update: StepFlops = None  # the updates' forward + backward (the step's ``StepFlops``)
    metrics: dict = None  # the sharing trainer's metrics of its last call
    same_as: str = ""

    @property
    def name(self) -> str:
        return f"{self.tasks}x{self.samples} {self.order}"

    @property
    def ideal(self) -> float:
        return self.scoring.plus(self.update).ideal("combined")


def scoring_flops(job: MainJob, trajectories: list, order: str, shape: ModelShape) -> StepFlops:
    """The critic's scoring forward (the policy does not score in the default synchronous run)
    over the trainer's scoring micro-batches (``StepContext.plan`` of every sub-trace)."""
    from agentrl_fast.train.context import StepContext
    from agentrl_fast.train.packing import pack_sub_traces
    from agentrl_fast.train.step_batch import StepBatch

    batch = StepBatch.of(trajectories)
    config = dataclasses.replace(job.config.train, mini_batch_order=order)
    context = StepContext(config, torch.device("cpu"), 1.0, 0.0, 0, share_prefixes=True)
    flops = StepFlops()
    for group in context.plan(batch, range(batch.num_sequences)):
        packed = pack_sub_traces(batch.sub_traces, group, share_prefixes=True)
        flops.add(packed, shape, [_shareable(batch.sub_traces[i]) for i in group], policy=False,
                  backward=False)
    return flops


def trainer_scenario(job: MainJob, trajectories: list, step: StepResult, mini_batches: int,
                     device: torch.device, args) -> TrainerResult:
    """``Trainer.train_on`` of the step's rollouts (scoring, advantages, the updates with their
    optimizer steps, the generator's weights refreshed) by two trainers of the same policy, with
    ``train.share_prefixes`` on and off, each call the run's first step (the same
    mini-batches)."""
    from agentrl_fast.train.ppo import Trainer

    train = job.config.train
    config = dataclasses.replace(
        train, tasks_per_step=step.tasks, mini_batch_order=step.order, mini_batches=mini_batches,
        checkpoint_every=0, checkpoint_dir=None,
        rollout=dataclasses.replace(train.rollout, samples_per_task=step.samples))
    notes: list[str] = []
    trainers = {name: Trainer(copy.deepcopy(job.policy), job.chat, job.environment,
                              dataclasses.replace(config, share_prefixes=share), log=notes.append)
                for name, share in (("shared", True), ("plain", False))}
    metrics: dict[str, dict] = {}

    def call(name: str) -> Callable[[], None]:
        def run():
            trainers[name].step_index = 0  # a fixed step batch: the same mini-batches each call
            metrics[name] = trainers[name].train_on(trajectories)
        return run

    try:
        times = paired_times({name: call(name) for name in trainers}, device, args.rounds,
                             args.max_seconds)
    finally:
        for trainer in trainers.values():
            trainer.close()
    if "shared_token_fraction" not in metrics["shared"]:
        raise RuntimeError(f"the trainer with share_prefixes=True did not share: {notes}")
    return TrainerResult(times["plain"], times["shared"], step.order, step.tasks, step.samples,
                         scoring_flops(job, trajectories, step.order, model_shape(job.policy)),
                         step.flops, metrics["shared"])


def trainer_rows(results: list[TrainerResult], device: torch.device) -> list[common.Row]:
    rows = []
    for r in results:
        shape = (f"main job {r.name}: Trainer.train_on, share_prefixes on / off, "
                 f"T={r.update.tokens}")
        for shared in (True, False):
            ms = (r.shared if shared else r.plain).wall_ms
            rows.append(common.Row(
                op="prefix_trainer_step", provider="shared" if shared else "plain", shape=shape,
                dtype="float32", device=common.device_name(device), time_ms=ms,
                tokens_per_s=r.update.tokens / (ms * 1e-3), ratio=ms / r.shared.wall_ms))
    return rows


def step_rows(results: list[StepResult], device: torch.device) -> list[common.Row]:
    rows = []
    for r in results:
        shape = (f"main job {r.name}: {r.micro_batches} micro-batches, T={r.flops.tokens}->"
                 f"{r.flops.rows} rows, policy+critic fwd+bwd")
        for shared in (True, False):
            ms = (r.shared if shared else r.plain).wall_ms
            flops = (r.flops.attention_shared + r.flops.linear_shared if shared
                     else r.flops.attention_plain + r.flops.linear_plain)
            rows.append(common.Row(
                op="prefix_step", provider="shared" if shared else "plain", shape=shape,
                dtype="float32", device=common.device_name(device), time_ms=ms,
                tokens_per_s=r.flops.tokens / (ms * 1e-3), tflops=flops / (ms * 1e-3) / 1e12,
                ratio=ms / r.shared.wall_ms))
    return rows


# ---------------------------------------------------------------------------------------------
# The record.


def _rule(head: str) -> str:
    """The markdown rule under a table's header."""
    return "|" + "|".join([" --- "] * (head.count("|") - 1)) + "|"


def _versus_ideal(r: Compared, ideal: float) -> str:
    """``speed-up | % of ideal | saving reached`` cells: wall clock, then CPU time in
    parentheses where measured. Saving reached: (1 - 1/speed-up) / (1 - 1/ideal)."""
    def cells(speedup: float) -> tuple[str, str, str]:
        saving = (1 - 1 / speedup) / (1 - 1 / ideal) if ideal > 1 + 1e-9 else None
        return (f"{speedup:.2f}x", f"{speedup / ideal:.0%}",
                "-" if saving is None else f"{saving:.0%}")

    wall = cells(r.speedup)
    if r.cpu_speedup is None:
        return " | ".join(wall)
    cpu = cells(r.cpu_speedup)
    return " | ".join(f"{a} ({b})" for a, b in zip(wall, cpu))


def op_table(results: list[OpResult], rate: float | None) -> list[str]:
    head = ("| instance | backend | dtype | plain ms | shared ms | ideal | speed-up | % of ideal "
            "| saving reached |" + (" TFLOP/s plain / shared (% of matmul) |" if rate else "")
            + " max rel diff |")
    lines = [head, _rule(head)]
    for r in results:
        instance = (f"{r.layouts.name}, T {r.layouts.plain_tokens} -> {r.layouts.shared_rows}, "
                    f"{r.heads[0]}/{r.heads[1]} heads of {r.head_dim}")
        line = (f"| {instance} | {r.backend} | {r.dtype} | {r.plain.wall_ms:.2f} | "
                f"{r.shared.wall_ms:.2f} | {r.ideal:.2f}x | {_versus_ideal(r, r.ideal)} |")
        if rate:
            plain, shared = r.tflops(False), r.tflops(True)
            line += f" {plain:.1f} / {shared:.1f} ({plain / rate:.0%} / {shared / rate:.0%}) |"
        lines.append(line + f" {r.difference:.1e} |")
    return lines


def step_table(results: list[StepResult]) -> list[str]:
    head = ("| step | micro-batches | tokens -> rows | shared-token fraction (trie bound) "
            "| ideal: attention / linear / combined | plain ms | shared ms | speed-up "
            "| % of ideal | saving reached | packing ms plain / shared |")
    lines = [head, _rule(head)]
    for r in results:
        f, ideal = r.flops, r.flops.ideal("combined")
        name = f"{r.name} (= {r.same_as})" if r.same_as else r.name
        lines.append(
            f"| {name} | {r.micro_batches} | {f.tokens} -> {f.rows} | {f.shared_fraction:.1%} "
            f"({f.trie_saved / f.tokens:.1%}) | {f.ideal('attention'):.2f}x / "
            f"{f.ideal('linear'):.2f}x / {ideal:.2f}x | {r.plain.wall_ms:.1f} | "
            f"{r.shared.wall_ms:.1f} | {_versus_ideal(r, ideal)} | "
            f"{r.packing.plain.wall_ms:.1f} / {r.packing.shared.wall_ms:.1f} |")
    return lines


def trainer_table(results: list[TrainerResult]) -> list[str]:
    head = ("| step | shared-token fraction: updates / scoring (the trainer's metrics) | ideal "
            "(scoring + updates) | plain ms | shared ms | speed-up | % of ideal "
            "| saving reached |")
    lines = [head, _rule(head)]
    for r in results:
        name = f"{r.name} (= {r.same_as})" if r.same_as else r.name
        m = r.metrics
        lines.append(f"| {name} | {m['shared_token_fraction']:.1%} / "
                     f"{m.get('scoring_shared_token_fraction', 0.0):.1%} | {r.ideal:.2f}x | "
                     f"{r.plain.wall_ms:.1f} | {r.shared.wall_ms:.1f} | "
                     f"{_versus_ideal(r, r.ideal)} |")
    return lines


TITLE = ("# Prefix-shared (tree) packing against the plain packing: the attention op and the "
         "main job's training step")
OP_HEADING = ("## The op: varlen_attention forward + backward, the shared layout against the "
              "plain packing of the same sequences")
STEP_HEADING = "## A training step of the main job: policy and critic forward + backward"
TRAINER_HEADING = "## The trainer's step: `Trainer.train_on`, `train.share_prefixes` on and off"
TRAINER_NOTE = (
    "`Trainer.train_on` of the same rollouts by two trainers of the same policy, "
    "`train.share_prefixes` on and off (`train.mini_batch_order` as named), each call the run's "
    "first step (the same mini-batches): the critic's scoring (forward, the whole step in "
    "micro-batches of `micro_batch_tokens`), GAE, the updates above with their optimizer steps "
    "and gradient clipping, the generator's weights refreshed. Ideal: the FLOP model over the "
    "scoring forward and the updates; optimizer steps, GAE and the weight copy are fixed costs "
    "outside it.")
OP_NOTE = (
    "Ideal = plain (query, key) pairs / shared pairs (forward 4 D Hq FLOPs per pair, backward "
    "2.5x); % of ideal = speed-up / ideal; saving reached = (1 - 1/speed-up) / (1 - 1/ideal), "
    "the share of the ideal time saving. CPU: wall clock, then in parentheses the same calls' "
    "process CPU time. Main-job instances: the first micro-batch of a step of the default "
    "run's sub-traces. `native+generic`: the generic LSE-merge path over native's plain "
    "kernels (its cross pass the float32 reference one); its plain column is native's.")
STEP_NOTE = (
    "Per step: every micro-batch of the first epoch's {mini_batches} mini-batches of whole "
    "rollouts (micro_batch_tokens {budget}), the policy's PPO loss path (`policy_logprobs` on "
    "the action rows, with entropies, `ppo_loss`) and the critic's (`critic_values`, "
    "`value_loss`), each backward; optimizer steps not timed. Rollouts: the vault expert "
    "through the trainer's rollout engine (`train.rollout` of configs/default.yaml), all "
    "successful; the expert is deterministic per task, so a task's samples are identical and "
    "their later sub-traces' prompts (system prompt, task, compaction summary) coincide, more "
    "than sampled rollouts' would. FLOP model: attention as above, x {layers} layers, policy and "
    "critic; linear layers 6 x params x rows ({linear} parameters in the backbone's linear "
    "layers, on every row; the LM head, {hidden} x {vocab}, on the action rows only, the same "
    "rows in both layouts; the critic's scalar head on every row). Shared-token fraction = 1 - "
    "shared rows / plain tokens; trie bound: what a full prefix trie over the same shareable "
    "prefixes (the tokens before each sub-trace's first action token) would save. Packing: "
    "`pack_sub_traces` of the step's micro-batches with and without `share_prefixes` (host).")


class Report:
    """The run's results so far: rows appended and the record rewritten after each part, so a
    run cut off (the GPU suite's stage cap) keeps what it finished."""

    def __init__(self, device: torch.device, args):
        self.device, self.args = device, args
        self.ops: list[OpResult] = []
        self.steps: list[StepResult] = []
        self.trainers: list[TrainerResult] = []
        self.rates: dict[str, float] = {}
        self.shape: ModelShape | None = None  # the main job's policy, once built
        self.micro_batch_tokens = 0
        self.start, self.load = time.perf_counter(), os.getloadavg()[0]
        self.path = args.record or (os.path.join(args.out, "prefix_sharing.md") if args.out
                                    else common.RESULTS / "prefix_sharing.md")

    def add(self, rows: list[common.Row]) -> None:
        if rows:
            common.write_rows(rows, "prefix_sharing", self.args.out)
        common.write_record(self.path, self.text())

    def text(self) -> str:
        machine = f"{common.device_name(self.device)}, torch {torch.__version__}"
        if self.device.type == "cpu":
            machine += (f"; load average {self.load:.1f} at the start, {os.getloadavg()[0]:.1f} "
                        "at the end (the machine is shared with other jobs)")
        seconds = time.perf_counter() - self.start
        lines = [TITLE, "", f"Machine: {machine}. Run time {seconds:.0f} s.", "", OP_HEADING, "",
                 OP_NOTE]
        if self.rates:
            lines += ["", "Matrix rate measured in the same run: "
                      + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in self.rates.items()) + "."]
        lines += ["", *op_table(self.ops, self.rates.get("bfloat16"))]
        if self.shape is not None:
            s = self.shape
            note = STEP_NOTE.format(mini_batches=SIZES[self.size_name].mini_batches,
                                    budget=self.micro_batch_tokens, layers=s.layers,
                                    linear=s.backbone_linear, hidden=s.hidden, vocab=s.vocab)
            lines += ["", STEP_HEADING, "", note, "", *step_table(self.steps)]
        if self.trainers:
            lines += ["", TRAINER_HEADING, "", TRAINER_NOTE, "", *trainer_table(self.trainers)]
        return "\n".join(lines) + "\n"

    @property
    def size_name(self) -> str:
        return "tiny" if self.args.tiny else self.device.type


# ---------------------------------------------------------------------------------------------
# The run.


def run_long_prompts(report: Report, sizes: Sizes, backends: list[str], budget: Budget,
                     failures: list[str]) -> None:
    args, device = report.args, report.device
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    layouts = long_prompt_layouts(*sizes.long_prompt)
    for head_dim in sizes.long_head_dims:
        results = run_op(layouts, sizes.long_heads, head_dim, dtype,
                         long_prompt_backends(backends), device, args, budget, failures)
        if device.type == "cuda" and "triton" in backends:
            splits = launcher_splits(layouts, sizes.long_heads, dtype, head_dim, device)
            print(f"  triton's own dk/dv split count here: {splits}", flush=True)
        report.ops += results
        report.add(op_rows(results, device))


class Rollouts:
    """The main job's rollouts per (tasks, samples per task), made once."""

    def __init__(self, job: MainJob, seed: int):
        self.job, self.seed, self.made = job, seed, {}

    def __call__(self, tasks: int, samples: int) -> list:
        if (tasks, samples) not in self.made:
            self.made[tasks, samples] = rollouts(self.job, tasks, samples, self.seed)
        return self.made[tasks, samples]


def run_main_job_ops(report: Report, job: MainJob, found: Rollouts, sizes: Sizes,
                     backends: list[str], budget: Budget, failures: list[str]) -> None:
    shape = report.shape
    heads = (shape.heads_q, job.policy.config.num_key_value_heads)
    for order, tasks, samples in sizes.op_scenarios:
        if budget.spent():
            print(f"note: time budget spent; skipped the op on {tasks}x{samples} {order}")
            continue
        trajectories = found(tasks, samples)
        sub_traces = [s for t in trajectories for s in t.sub_traces]
        plan = step_plan(trajectories, order, sizes.mini_batches, report.micro_batch_tokens,
                         job.config.train.seed)
        packed = pack_step(sub_traces, plan[:1], True)[0]
        layouts = packed_layouts(f"main job {tasks}x{samples} {order}, first micro-batch", packed)
        results = run_op(layouts, heads, shape.head_dim, torch.float32, backends, report.device,
                         report.args, budget, failures)
        report.ops += results
        report.add(op_rows(results, report.device))


def run_steps(report: Report, job: MainJob, found: Rollouts, sizes: Sizes,
              budget: Budget) -> None:
    """Each step scenario at the model level, then through the trainer (the same micro-batches
    timed once: at one sample per task the orders agree)."""
    timed: dict[str, tuple[StepResult, TrainerResult | None]] = {}
    for order, tasks, samples in sizes.step_scenarios:
        if budget.spent():
            print(f"note: time budget spent; skipped the step {tasks}x{samples} {order}")
            continue
        trajectories = found(tasks, samples)
        plan = step_plan(trajectories, order, sizes.mini_batches, report.micro_batch_tokens,
                         job.config.train.seed)
        key = f"{tasks}x{samples} {plan}"
        if key in timed:
            step, trainer = (dataclasses.replace(r, order=order, same_as=r.name) if r else None
                             for r in timed[key])
        else:
            step = step_scenario(job, trajectories, (order, tasks, samples), plan, report.device,
                                 report.args)
            trainer = None if budget.spent() else trainer_scenario(
                job, trajectories, step, sizes.mini_batches, report.device, report.args)
            timed[key] = (step, trainer)
        print_step(step, trainer)
        report.steps.append(step)
        if trainer is not None:
            report.trainers.append(trainer)
        if not step.same_as:
            report.add(step_rows([step], report.device)
                       + (trainer_rows([trainer], report.device) if trainer else []))
        else:
            report.add([])


def print_step(step: StepResult, trainer: TrainerResult | None) -> None:
    ideal = step.flops.ideal("combined")
    print(f"step {step.name}: plain {step.plain.wall_ms:.1f} ms, shared {step.shared.wall_ms:.1f} "
          f"ms, speed-up {step.speedup:.2f}x of ideal {ideal:.2f}x ({step.speedup / ideal:.0%}); "
          f"shared-token fraction {step.flops.shared_fraction:.1%}"
          + (f" (the micro-batches of {step.same_as})" if step.same_as else ""), flush=True)
    if trainer is not None:
        fraction = trainer.metrics["shared_token_fraction"]
        print(f"  Trainer.train_on: plain {trainer.plain.wall_ms:.1f} ms, shared "
              f"{trainer.shared.wall_ms:.1f} ms, speed-up {trainer.speedup:.2f}x of ideal "
              f"{trainer.ideal:.2f}x ({trainer.speedup / trainer.ideal:.0%}); its "
              f"shared_token_fraction {fraction:.1%}", flush=True)
        if abs(fraction - step.flops.shared_fraction) > 1e-9:
            print(f"  note: the trainer's update micro-batches differ from the emulated ones "
                  f"({fraction:.4f} shared, here {step.flops.shared_fraction:.4f})", flush=True)


def run(args) -> list[str]:
    """Every part in turn (long prompts first: the headline on a GPU); returns the failures."""
    device = torch.device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    report = Report(device, args)
    sizes = SIZES[report.size_name]
    budget = Budget(args.time_budget)
    failures: list[str] = []
    backends = op_backends(device, reference_ok=device.type == "cpu")
    print(f"device {common.device_name(device)}; backends {', '.join(backends)}", flush=True)
    run_long_prompts(report, sizes, backends, budget, failures)
    if not budget.spent():
        job = main_job(device)
        report.micro_batch_tokens = job.config.train.micro_batch_tokens
        report.shape = model_shape(job.policy)
        found = Rollouts(job, args.seed)
        run_main_job_ops(report, job, found, sizes, backends, budget, failures)
        run_steps(report, job, found, sizes, budget)
    if device.type == "cuda":
        report.rates = {"bfloat16": matrix_rate(device, torch.bfloat16, 8192),
                        "float32": matrix_rate(device, torch.float32, 8192)}
    report.add([])
    print(report.text())
    print(f"record written to {report.path}; rows appended to "
          f"{os.path.join(args.out or common.RESULTS, 'prefix_sharing.jsonl')}")
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny sizes (the CI dry run): a 256-token prompt with 4 suffixes of "
                             "64, 2 tasks x 2 samples, one mini-batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default torch's; 1 with --tiny)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="the long-prompt instances' dtype (default bfloat16 on CUDA, "
                             "float32 on the CPU); the main job's are float32, its dtype")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed calls of each variant (CPU: alternating; default 5, 2 with "
                             "--tiny)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop adding rounds after about this many seconds per comparison "
                             "(default 10 on the CPU, 2 on CUDA, 0.5 with --tiny)")
    parser.add_argument("--max-reference-gflop", type=float, default=2.0,
                        help="skip the float32 reference backend above this many GFLOP")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which nothing new starts (default none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile-ops", action="store_true",
                        help="on CUDA: a torch.profiler table of the triton and torch op "
                             "calls' kernels")
    parser.add_argument("--profile", action="store_true",
                        help="print a torch.profiler table of each step's passes")
    parser.add_argument("--out", default=None,
                        help="folder for prefix_sharing.jsonl and the record (default "
                             "bench/results)")
    parser.add_argument("--record", default=None, help="the markdown record's path")
    args = parser.parse_args(argv)
    if args.threads is None and args.tiny:
        args.threads = 1
    if args.rounds is None:
        args.rounds = 2 if args.tiny else 5
    if args.max_seconds is None:
        args.max_seconds = 0.5 if args.tiny else (2.0 if args.device == "cuda" else 10.0)
    return args


def main() -> None:
    start = time.perf_counter()
    failures = run(parse_args())
    print(f"total {time.perf_counter() - start:.1f} s")
    for failure in failures:
        print(f"FAILED {failure}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
