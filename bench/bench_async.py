"""Benchmark: synchronous against asynchronous training (``train.max_staleness`` 0, 1, 2) on
this machine: wall time per 1000 trained tokens, where the time goes, and (``--learning``) the
held-out success each reaches after the same number of trained samples.

Runs. The main job (``RunConfig()``, head_dim 32 so that the torch and vLLM runs train the same
model: vLLM's CPU attention refuses 16), ``--steps`` PPO steps (default 10), checkpoints off,
``train.max_staleness`` = k, built with ``build`` and trained by ``Trainer(...).train()`` then
``close()``. Every run starts from the same policy: the main job's policy after a short
supervised warm-start on expert demonstrations (``--warmstart-steps`` SFT steps on
``--warmstart-demos`` demonstrations, no validation target; done once per process). Why not the
random policy: it writes one 24-token turn that is no tool call and the episode ends, so no tool
ever runs and the tool latencies below would measure nothing; 50 SFT steps give ~18 turns and
~18 tool calls per episode. ``--warmstart-steps 0`` starts from the random policy.

Tools: the vault environment's ``open_vault`` first sleeps 0 / 50 / 200 ms (``--latencies``;
an async tool: ``TimedVaultEnvironment`` of ``bench_rollout.py``, which also times every tool
call).

Generators (``--generators``):

* ``torch``: the Trainer's default ``TorchGenerator`` (no ``generator=``): synchronous, it
  samples in the learner's thread; asynchronous, the producer thread samples from its own copy
  of the policy on half the intra-op threads.
* ``vllm``: ``VLLMGenerator`` on one ``VLLMServer`` (the vLLM side environment's interpreter,
  ``--vllm-python``), started once per process on an export of the warm-started policy and
  reused by every run; each Trainer pushes its policy's weights at construction and after every
  step (asynchronous: the producer pushes the published ones before its next generate call).
  The server is a separate process, bound to all cores: it shares them with the learner. It is
  stopped once the vLLM runs are done (an idle server must not sit beside the next runs).
* ``remote``: a STAND-IN for generation on other hardware, labelled "remote stand-in (sleeps)".
  Its tokens are the scripted expert's (``ScriptedGenerator(expert_action)``: no model, a few
  ms of CPU per call, log-prob 0 per token, every episode solved); each ``generate`` call then
  sleeps ``seconds_per_token x`` the tokens it returns, so generation costs wall time but no
  local CPU. ``seconds_per_token`` is this machine's: a synchronous rollout step of the
  warm-started policy on ``TorchGenerator`` (latency 0, the main job's rollout settings),
  generate seconds / generated tokens (``--remote-seconds-per-token`` overrides it). So it is a
  device as fast per token as these cores, whatever the batch, that leaves the cores to the
  learner. The traffic is the expert's (fewer, successful turns), not the policy's: compare its
  sync and async rows with each other, not with the other generators' rows. With log-probs 0
  the synchronous PPO ratio is meaningless (the work per token is the same; the policy's
  learning is not what these rows measure).

Per run (one row, ``op="async"``, ``provider`` "sync" / "async k=1" / "async k=2", ``shape``
generator and tool latency): ``time_ms`` = wall time per 1000 trained tokens (wall: from the
Trainer's construction, which starts the producer, to the end of ``train()``, ``close()``
excluded; trained tokens: the lengths of the sub-traces ``Trainer._learn`` got, counted by
wrapping it), ``tokens_per_s`` trained tokens per second, ``ratio`` = the sync run's
time_ms / this one's (> 1: faster than synchronous). Where the time goes (``async.md``):

* learner side (these add up to the wall time): ``learning`` the time in ``Trainer._learn``
  (scoring, advantages, updates); ``waiting`` the time the learner waited for rollouts
  (synchronous: the whole rollout phase, ``rollout_seconds``; asynchronous:
  ``learner_wait_seconds``); ``other`` the rest (the Trainer's construction, weight
  publication / pushes, schedulers, metrics);
* rollout side (running beside the learner when asynchronous): ``generation`` the seconds in
  ``generate`` (``RolloutStats.generate_seconds`` of the engine that sampled: the Trainer's
  engine summed over steps, or the producer's; the producer's include its weight swaps and
  groups generated but never trained on), ``tools`` the wall time during which at least one
  tool call ran (union of the calls' intervals);
* ``weight sync`` (vLLM): ``VLLMGenerator.stats["weight_sync_seconds"]`` (learner side when
  synchronous, inside the producer's generation when asynchronous); ``stale drops``:
  ``stale_groups_dropped`` summed; ``stale tokens``: the share of trained action tokens sampled
  by older weights (``staleness_lag_<j>``, j >= 1); ``other load``: cores that other processes
  (not this one, not the vLLM server) used during the run.

The honest caveat: this machine has 2 cores. The learner uses all intra-op threads (2 by
default, ``--threads``; the critic beside the policy on half of them), and the asynchronous
producer samples on half of them too: generation and learning share the same cores, so overlap
can hide the tools' sleeps and what one side leaves idle, but not the generation's CPU time.
The vLLM server is another process on the same cores (and is much slower than
``TorchGenerator`` for this tiny model on a CPU: ``bench/results/generation.md``). Only the
remote stand-in takes generation off these cores; its rows say what overlap buys when
generation runs elsewhere.

Learning check (``--learning``, 0 ms tools, torch): the main job's warm-start (2000
demonstrations, validation target; ``--learning-warmstart-steps`` caps its SFT steps), then
``--learning-steps`` PPO steps (default 20) per mode of ``--learning-staleness`` (default 0,1)
from that same policy: equal trained samples (steps x tasks_per_step x samples_per_task), then
greedy success on the first ``--eval-tasks`` held-out tasks (``evaluate``), before and after.
One seed (``--seed``): differences of a few points are noise.

Outputs: rows appended to ``<out-dir>/async.jsonl`` (learning check: ``op="async-learning"``,
``time_ms`` the RL wall time, ``ratio`` sync's / this one's, success in ``shape``);
``<out-dir>/async.md`` (command, date, commit, machine, tables, notes) overwritten. A run that
other processes disturbed (over ``QUIET_CORES`` cores) is flagged, not repeated (runs are long);
``--wait-quiet S`` waits up to S seconds for an idle machine before each run.

``--tiny``: a smoke run of about half a minute (2 steps of 2 tasks, 0 ms tools, torch unless
``--generators`` names others, a 5-step warm-start; with ``--learning``: 10 SFT steps, 2 RL
steps, 8 evaluation tasks).

Usage (from the repository root)::

    python bench/bench_async.py [--tiny] [--generators torch,vllm,remote] [--latencies 0,50,200]
        [--staleness 0,1,2] [--steps 10] [--threads 2] [--warmstart-steps 50]
        [--warmstart-demos 300] [--remote-seconds-per-token S] [--wait-quiet SECONDS]
        [--learning] [--learning-steps 20] [--learning-staleness 0,1]
        [--learning-warmstart-steps N] [--eval-tasks 100] [--seed 0] [--vllm-python PATH]
        [--out-dir bench/results]
"""

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from bench_generation import (DEFAULT_VLLM_PYTHON, QUIET_CORES, OtherLoad,  # noqa: E402
                                    machine_note, vllm_version)
from bench_rollout import TimedVaultEnvironment, ToolClock  # noqa: E402
from agentrl_fast.config import RunConfig  # noqa: E402
from agentrl_fast.harness import RolloutEngine
from agentrl_fast.generators import ScriptedGenerator, TorchGenerator, VLLMGenerator, VLLMServer
from agentrl_fast.envs import expert_action
from agentrl_fast.train.export import export_pretrained  # noqa: E402
from agentrl_fast.train.ppo import Trainer  # noqa: E402
from agentrl_fast.train.run import (build, evaluate, expert_demonstrations,  # noqa: E402
                                    warm_start)

GENERATORS = ("torch", "vllm", "remote")
LABELS = {"torch": "torch", "vllm": "vllm", "remote": "remote stand-in (sleeps)"}


def mode_name(k: int) -> str:
    return "sync" if k == 0 else f"async k={k}"


def quiet(*args, **kwargs) -> None:
    """The Trainer's log, silenced."""


# ---------------------------------------------------------------------------------------------
# Config, policy, environment


def main_job(args) -> RunConfig:
    """The main job with head_dim 32 (vLLM's CPU attention refuses 16) and ``--seed``."""
    config = RunConfig(seed=args.seed)
    config.model.head_dim = 32
    config.train = dataclasses.replace(config.train, steps=args.steps,
                                       tasks_per_step=args.tasks_per_step)
    return config


def warm_policy(config: RunConfig, steps: int, demos: int):
    """``(chat, policy)``: the main job's policy after ``steps`` SFT steps on ``demos`` expert
    demonstrations, a fixed count (no validation checks: the same policy for every run)."""
    config = copy.deepcopy(config)
    config.warmstart = dataclasses.replace(config.warmstart, steps=steps, demos=demos,
                                           target_success=None)
    environment, chat, policy = build(config)
    if steps:
        losses, _ = warm_start(config, policy, chat, environment,
                               expert_demonstrations(config, chat, environment))
        print(f"warm-start: {demos} demonstrations, {steps} SFT steps, loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}", flush=True)
    return chat, policy.eval()


def slow_environment(config: RunConfig, latency_ms: float, clock: ToolClock):
    """The run's vault environment (``build``'s fields), ``open_vault`` sleeping first."""
    fields = {f.name: getattr(config.env, f.name) for f in dataclasses.fields(config.env)
              if f.name != "name"}
    return TimedVaultEnvironment(clock, latency_ms / 1e3, **fields)


# ---------------------------------------------------------------------------------------------
# Generators


class RemoteStandIn:
    """Generation on other hardware, simulated (module doc): the scripted expert's tokens,
    returned after sleeping ``seconds_per_token`` x their count; no local model runs."""

    def __init__(self, chat, seconds_per_token: float):
        self.expert = ScriptedGenerator(expert_action, chat)
        self.seconds_per_token = seconds_per_token

    def generate(self, prompts, sampling, seeds=None):
        out = self.expert.generate(prompts, sampling, seeds)
        time.sleep(self.seconds_per_token * sum(len(g.ids) for g in out))
        return out

    def update_weights(self, model) -> None:
        """The stand-in has no weights: the expert does not learn."""


def torch_seconds_per_token(config, chat, policy) -> float:
    """Generate seconds per generated token of one synchronous rollout step of ``policy`` on
    ``TorchGenerator`` (0 ms tools): the remote stand-in's speed."""
    environment = slow_environment(config, 0.0, ToolClock())
    generator = TorchGenerator(copy.deepcopy(policy), pad_id=chat.tokenizer.pad_token_id or 0)
    engine = RolloutEngine(generator, chat, environment, config.train.rollout)
    engine.run(environment.tasks("train")[:config.train.tasks_per_step], seed=config.seed)
    return engine.stats.generate_seconds / max(engine.stats.generated_tokens, 1)


class Generators:
    """The sweep's generators, made when first asked for; the vLLM server is started on an
    export of ``policy`` and stopped by ``release("vllm")`` (an idle server must not share the
    cores with the next generator's runs)."""

    def __init__(self, args, config, chat, policy):
        self.args, self.config, self.chat, self.policy = args, config, chat, policy
        self.stacks: dict[str, contextlib.ExitStack] = {}
        self.made: dict = {}
        self.notes: list[str] = []
        self.pgid = None  # the vLLM server's process group, not "other load"

    def get(self, name: str):
        """The ``generator=`` argument of the Trainer (None: its default TorchGenerator)."""
        if name not in self.made:
            self.stacks[name] = contextlib.ExitStack()
            self.made[name] = {"torch": lambda stack: None, "vllm": self._vllm,
                               "remote": self._remote}[name](self.stacks[name])
        return self.made[name]

    def release(self, name: str) -> None:
        self.made.pop(name, None)
        stack = self.stacks.pop(name, None)
        if stack is not None:
            stack.close()
        if name == "vllm":
            self.pgid = None

    def close(self) -> None:
        for name in list(self.stacks):
            self.release(name)

    def _vllm(self, stack: contextlib.ExitStack):
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-async-"))
        model_dir = export_pretrained(self.policy, Path(folder) / "policy",
                                      tokenizer=self.chat.tokenizer)
        start = time.perf_counter()
        server = stack.enter_context(VLLMServer(model_dir, python=self.args.vllm_python))
        self.pgid = server.process.pid
        self.notes.append(f"vLLM {vllm_version(server)}: server up in "
                          f"{time.perf_counter() - start:.0f} s, bound to cores {server.threads}")
        print(self.notes[-1], flush=True)
        # A long timeout: a loaded 2-core machine must not fail requests (failures are counted).
        return stack.enter_context(VLLMGenerator(server, timeout=1800.0, retries=0))

    def _remote(self, stack: contextlib.ExitStack):
        rate = self.args.remote_seconds_per_token
        how = "given (--remote-seconds-per-token)"
        if rate is None:
            rate = torch_seconds_per_token(self.config, self.chat, self.policy)
            how = "measured: a synchronous TorchGenerator rollout step, generate s / tokens"
        self.notes.append(f"remote stand-in: the scripted expert's tokens, {rate * 1e3:.3f} ms "
                          f"slept per token ({how})")
        print(self.notes[-1], flush=True)
        return RemoteStandIn(self.chat, rate)


# ---------------------------------------------------------------------------------------------
# One run


@dataclasses.dataclass
class Result:
    generator: str
    latency_ms: float
    k: int
    steps: int
    wall: float
    trained_tokens: int
    trained_samples: int
    generated_tokens: int
    learning: float
    waiting: float
    generation: float
    tools: float
    weight_sync: float
    stale_drops: int
    stale_tokens: float  # share of trained action tokens sampled by older weights
    failed: int
    close_seconds: float
    other_load: float
    history: list
    final_policy: object = dataclasses.field(default=None, repr=False)  # the trained policy

    @property
    def ms_per_1000(self) -> float:
        return self.wall / max(self.trained_tokens, 1) * 1e6

    @property
    def other(self) -> float:
        return self.wall - self.learning - self.waiting


def instrument(trainer: Trainer) -> list[tuple[int, int, float]]:
    """Wrap ``trainer._learn``: per call ``(tokens, samples, seconds)`` trained on."""
    calls, learn = [], trainer._learn

    def timed(trajectories, sub_traces):
        start = time.perf_counter()
        out = learn(trajectories, sub_traces)
        calls.append((sum(len(s) for s in sub_traces), len(trajectories),
                      time.perf_counter() - start))
        return out
    trainer._learn = timed
    return calls


def rollout_side(trainer: Trainer, history: list, per_step: list) -> tuple[float, int, float]:
    """``(generation seconds, generated tokens, learner waiting seconds)``: the producer's
    engine when asynchronous, else the Trainer's engine summed over the steps (``per_step``)."""
    if trainer.producer is not None:
        stats = trainer.producer.engine.stats
        return (stats.generate_seconds, stats.generated_tokens,
                sum(m["learner_wait_seconds"] for m in history))
    return (sum(g for g, _ in per_step), sum(t for _, t in per_step),
            sum(m["rollout_seconds"] for m in history))


def stale_share(history: list, k: int) -> float:
    lagged = sum(m.get(f"staleness_lag_{j}", 0.0) for m in history for j in range(1, k + 1))
    total = lagged + sum(m.get("staleness_lag_0", 0.0) for m in history)
    return lagged / total if total else 0.0


def one_run(config, chat, policy, environment, clock, name, generator, latency_ms, k,
            pgid) -> Result:
    """``config.train.steps`` steps at ``max_staleness=k`` from a copy of ``policy``."""
    train = dataclasses.replace(config.train, seed=config.seed, max_staleness=k,
                                checkpoint_every=0)
    syncs = getattr(generator, "stats", {}).get("weight_sync_seconds", 0.0)
    clock.reset()
    per_step = []
    with OtherLoad(pgid) as load:
        start = time.perf_counter()
        trainer = Trainer(copy.deepcopy(policy), chat, environment, train, log=quiet,
                          generator=generator)
        calls = instrument(trainer)

        def on_step(metrics):  # the Trainer's engine's stats are of the last step only
            if trainer.producer is None:
                per_step.append((trainer.engine.stats.generate_seconds,
                                 trainer.engine.stats.generated_tokens))
        try:
            history = trainer.train(callback=on_step)
            wall = time.perf_counter() - start
            generation, generated, waiting = rollout_side(trainer, history, per_step)
            tools = clock.busy_seconds()
        finally:
            closing = time.perf_counter()
            trainer.close()
            closing = time.perf_counter() - closing
    syncs = getattr(generator, "stats", {}).get("weight_sync_seconds", 0.0) - syncs
    return Result(name, latency_ms, k, len(history), wall, sum(c[0] for c in calls),
                  sum(c[1] for c in calls), generated, sum(c[2] for c in calls), waiting,
                  generation, tools, syncs,
                  int(sum(m.get("stale_groups_dropped", 0) for m in history)),
                  stale_share(history, k), int(sum(m.get("failed_episodes", 0) for m in history)),
                  closing, load.cores, history, trainer.rollout_policy)


def describe(r: Result, sync: Result | None) -> str:
    speed = f"{sync.ms_per_1000 / r.ms_per_1000:.2f}x" if sync else "-"
    flag = " DISTURBED" if r.other_load > QUIET_CORES else ""
    return (f"  {LABELS[r.generator]:<24} {r.latency_ms:>4g} ms {mode_name(r.k):<9} "
            f"wall {r.wall:7.1f} s  {r.trained_tokens:7d} tok  {r.ms_per_1000:8.1f} ms/1k tok "
            f"({speed} vs sync)  learn {r.learning:6.1f}  wait {r.waiting:6.1f}  other "
            f"{r.other:5.1f}  | gen {r.generation:6.1f}  tools {r.tools:6.1f}  sync "
            f"{r.weight_sync:5.1f}  stale drops {r.stale_drops}  stale tok {r.stale_tokens:.0%}"
            f"  failed {r.failed}  close {r.close_seconds:.1f} s  [other load "
            f"{r.other_load:.2f} cores{flag}]")


# ---------------------------------------------------------------------------------------------
# The sweep and the learning check


def sweep(args, config, chat, policy, generators: Generators) -> list[Result]:
    """Every generator x tool latency x mode, sync first within each (the speed-up's base)."""
    results = []
    for name in args.generators:
        generator = generators.get(name)
        for latency in args.latencies:
            clock = ToolClock()
            environment = slow_environment(config, latency, clock)
            sync = None
            for k in args.staleness:
                if args.wait_quiet > 0:
                    OtherLoad.wait(args.wait_quiet, generators.pgid)
                r = one_run(config, chat, policy, environment, clock, name, generator,
                            latency, k, generators.pgid)
                sync = r if k == 0 else sync
                print(describe(r, sync if k else None), flush=True)
                results.append(r)
        generators.release(name)
    return results


def warm_up(config, chat, policy) -> None:
    """One synchronous step, not counted (first-call costs: allocator, lazy imports, caches);
    printed, as a gauge of a step's cost."""
    one = copy.deepcopy(config)
    one.train = dataclasses.replace(one.train, steps=1)
    clock = ToolClock()
    r = one_run(one, chat, policy, slow_environment(one, 0.0, clock), clock, "torch", None, 0.0,
                0, None)
    print(f"warm-up (not counted): one synchronous torch step, {r.wall:.1f} s (rollouts "
          f"{r.waiting:.1f} s, learning {r.learning:.1f} s, {r.trained_tokens} tokens)",
          flush=True)


def learning_check(args) -> dict:
    """The main job's warm-start, then ``--learning-steps`` steps per mode from it; greedy
    held-out success before and after (module doc)."""
    config = main_job(args)
    config.train = dataclasses.replace(config.train, steps=args.learning_steps)
    config.eval.tasks = args.eval_tasks
    if args.learning_warmstart_steps is not None:
        config.warmstart.steps = args.learning_warmstart_steps
    start = time.perf_counter()
    environment, chat, policy = build(config)
    losses, checks = warm_start(config, policy, chat, environment,
                                expert_demonstrations(config, chat, environment))
    before = evaluate(policy, chat, environment, config, seed=config.seed)
    out = {"warmstart_steps": len(losses), "warmstart_seconds": time.perf_counter() - start,
           "before": before, "runs": []}
    print(f"learning check: warm-start {len(losses)} SFT steps, held-out success "
          f"{before['success']:.3f} on {args.eval_tasks} tasks", flush=True)
    for k in args.learning_staleness:
        clock = ToolClock()
        r = one_run(config, chat, policy, slow_environment(config, 0.0, clock), clock, "torch",
                    None, 0.0, k, None)
        after = evaluate(r.final_policy, chat, environment, config, seed=config.seed)
        out["runs"].append((r, after))
        print(f"  {mode_name(k):<9} {r.steps} steps, {r.trained_samples} samples, wall "
              f"{r.wall:.0f} s: held-out success {after['success']:.3f} (reward "
              f"{after['reward']:.3f}) [other load {r.other_load:.2f} cores]", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# Rows and markdown


def shape_of(r: Result, config) -> str:
    t = config.train
    return (f"{LABELS[r.generator]} | open_vault +{r.latency_ms:g} ms | {r.steps} steps x "
            f"{t.tasks_per_step} tasks x {t.rollout.samples_per_task}")


def sync_of(r: Result, results: list[Result]) -> Result | None:
    return next((s for s in results if s.k == 0 and s.generator == r.generator
                 and s.latency_ms == r.latency_ms), None)


def make_rows(results: list[Result], learning: dict | None, config) -> list[common.Row]:
    device = common.device_name(torch.device("cpu"))
    rows = []
    for r in results:
        sync = sync_of(r, results)
        rows.append(common.Row(
            op="async", provider=mode_name(r.k), shape=shape_of(r, config), dtype="float32",
            device=device, time_ms=r.ms_per_1000, tokens_per_s=r.trained_tokens / r.wall,
            ratio=sync.ms_per_1000 / r.ms_per_1000 if sync else None))
    if learning:
        base = next((r for r, _ in learning["runs"] if r.k == 0), None)
        for r, after in learning["runs"]:
            rows.append(common.Row(
                op="async-learning", provider=mode_name(r.k), device=device, dtype="float32",
                shape=(f"torch | open_vault +0 ms | {r.steps} steps, {r.trained_samples} "
                       f"samples | held-out success {learning['before']['success']:.3f} -> "
                       f"{after['success']:.3f} on {config.eval.tasks} tasks"),
                time_ms=r.wall * 1e3, tokens_per_s=r.trained_tokens / r.wall,
                ratio=base.wall / r.wall if base else None))
    return rows


def throughput_table(results: list[Result]) -> list[str]:
    lines = ["| generator | tool ms | mode | wall s | trained tokens | ms / 1000 tokens | "
             "speed-up vs sync | generation s | tools s | learning s | waiting s | other s | "
             "weight sync s | stale drops (stale tokens) | other load |",
             "|" + " --- |" * 15]
    for r in results:
        sync = sync_of(r, results)
        speed = f"{sync.ms_per_1000 / r.ms_per_1000:.2f}x" if sync else "-"
        flag = " (disturbed)" if r.other_load > QUIET_CORES else ""
        lines.append(
            f"| {LABELS[r.generator]} | {r.latency_ms:g} | {mode_name(r.k)} | {r.wall:.1f} | "
            f"{r.trained_tokens:,} | {r.ms_per_1000:.1f} | {speed} | {r.generation:.1f} | "
            f"{r.tools:.1f} | {r.learning:.1f} | {r.waiting:.1f} | {r.other:.1f} | "
            f"{r.weight_sync:.1f} | {r.stale_drops} ({r.stale_tokens:.0%}) | "
            f"{r.other_load:.2f}{flag} |")
    return lines


def overlap_summary(results: list[Result]) -> list[str]:
    """Per generator and tool latency: the best asynchronous speed-up, and how much slower
    the learner's own work got beside the producer (learning s per trained token against
    sync's: > 1 means the two sides competed for the cores)."""
    lines = []
    for sync in (r for r in results if r.k == 0):
        others = [r for r in results if r.k and sync_of(r, results) is sync]
        if not others:
            continue
        best = min(others, key=lambda r: r.ms_per_1000)
        unit = sync.learning / max(sync.trained_tokens, 1)
        slower = ", ".join(f"{mode_name(r.k)} {r.learning / max(r.trained_tokens, 1) / unit:.2f}x"
                           for r in others) if unit else "-"
        lines.append(f"- {LABELS[sync.generator]}, {sync.latency_ms:g} ms tools: best "
                     f"{mode_name(best.k)}, {sync.ms_per_1000 / best.ms_per_1000:.2f}x the "
                     f"synchronous rate (sync waited {sync.waiting / sync.wall:.0%} of its wall "
                     f"time for rollouts, {mode_name(best.k)} {best.waiting / best.wall:.0%}); "
                     f"learning time per trained token against sync: {slower}")
    return lines


def learning_table(learning: dict, config) -> list[str]:
    before = learning["before"]
    lines = [f"Warm-start: {learning['warmstart_steps']} SFT steps "
             f"({learning['warmstart_seconds']:.0f} s with its checks and evaluation); held-out "
             f"greedy success {before['success']:.3f}, reward {before['reward']:.3f} on "
             f"{config.eval.tasks} tasks. One seed: a few points are noise.", "",
             "| mode | steps | trained samples | trained tokens | RL wall s | held-out success "
             "| held-out reward | stale drops (stale tokens) | other load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r, after in learning["runs"]:
        lines.append(f"| {mode_name(r.k)} | {r.steps} | {r.trained_samples} | "
                     f"{r.trained_tokens:,} | {r.wall:.0f} | {after['success']:.3f} | "
                     f"{after['reward']:.3f} | {r.stale_drops} ({r.stale_tokens:.0%}) | "
                     f"{r.other_load:.2f} |")
    return lines


def markdown(rows, results, learning, notes, args, config) -> str:
    lines = ["# Synchronous vs asynchronous training (`train.max_staleness`) on this machine", "",
             f"Command: `python bench/bench_async.py {' '.join(sys.argv[1:])}`".rstrip(),
             f"Date {rows[0].date}, commit {rows[0].commit}. Machine: {machine_note(args)}.", "",
             "How each number is measured, and how the remote stand-in works: the module doc "
             "of `bench/bench_async.py`. Learner side: learning + waiting + other = wall. "
             "Rollout side (beside the learner when asynchronous): generation, tools. "
             "On 2 cores the producer and the learner share the CPU; only the remote stand-in "
             "(which sleeps instead of computing) takes generation off it.", ""]
    if results:
        lines += ["## Wall time per 1000 trained tokens", ""] + throughput_table(results) + [""]
        summary = overlap_summary(results)
        if summary:
            lines += ["## What overlap buys here", ""] + summary + [""]
    if learning:
        lines += ["## Learning check (0 ms tools, TorchGenerator, equal trained samples)", ""]
        lines += learning_table(learning, config) + [""]
    return "\n".join(lines + [f"- {n}" for n in notes]) + "\n"


# ---------------------------------------------------------------------------------------------
# Main


def csv(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: 2 steps of 2 tasks, 0 ms tools, torch only unless "
                             "--generators says, a 5-step warm-start; with --learning: 2 steps, "
                             "10 SFT steps, 8 eval tasks")
    parser.add_argument("--generators", default=None,
                        help=f"of {', '.join(GENERATORS)} (default all; torch with --tiny); "
                             "'none': the learning check only")
    parser.add_argument("--latencies", default="0,50,200", help="open_vault latencies, ms")
    parser.add_argument("--staleness", default="0,1,2", help="train.max_staleness values")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks-per-step", type=int, default=RunConfig().train.tasks_per_step)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--warmstart-steps", type=int, default=50,
                        help="SFT steps before the throughput runs (0: the random policy)")
    parser.add_argument("--warmstart-demos", type=int, default=300)
    parser.add_argument("--remote-seconds-per-token", type=float, default=None,
                        help="the remote stand-in's sleep per token (default: measured)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each run, wait up to SECONDS for an idle machine")
    parser.add_argument("--learning", action="store_true", help="run the learning check too")
    parser.add_argument("--learning-steps", type=int, default=20)
    parser.add_argument("--learning-staleness", default="0,1")
    parser.add_argument("--learning-warmstart-steps", type=int, default=None,
                        help="cap the main job's warm-start (default: its own, up to 800)")
    parser.add_argument("--eval-tasks", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--out-dir", default=None, help="default bench/results")
    args = parser.parse_args(argv)
    if args.generators is None:
        args.generators = "torch" if args.tiny else ",".join(GENERATORS)
    args.generators = [] if args.generators == "none" else csv(args.generators)
    if set(args.generators) - set(GENERATORS):
        parser.error(f"--generators: a comma-separated list of {', '.join(GENERATORS)}, or none")
    args.latencies, args.staleness = csv(args.latencies, float), csv(args.staleness, int)
    args.learning_staleness = csv(args.learning_staleness, int)
    if args.tiny:
        args.steps, args.tasks_per_step, args.latencies = 2, 2, [0.0]
        args.warmstart_steps, args.warmstart_demos = 5, 50
        args.learning_steps, args.eval_tasks = 2, 8
        args.learning_warmstart_steps = 10
    if not args.generators and not args.learning:
        parser.error("nothing to run: --generators none without --learning")
    args.vllm_python = os.path.expanduser(args.vllm_python)
    return args


def main() -> None:
    start = time.perf_counter()
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = main_job(args)
    results, learning, notes = [], None, []
    if args.generators:
        chat, policy = warm_policy(config, args.warmstart_steps, args.warmstart_demos)
        warm_up(config, chat, policy)
        generators = Generators(args, config, chat, policy)
        try:
            results = sweep(args, config, chat, policy, generators)
        finally:
            generators.close()
        notes += [f"Throughput runs start from the main job's policy after {args.warmstart_steps} "
                  f"SFT steps on {args.warmstart_demos} expert demonstrations"] + generators.notes
    if args.learning:
        learning = learning_check(args)
        config.eval.tasks = args.eval_tasks
    rows = make_rows(results, learning, config)
    common.print_table(rows)
    path = common.write_rows(rows, "async", args.out_dir)
    md = path.with_suffix(".md")
    common.write_record(md, markdown(rows, results, learning, notes, args, config))
    print(f"\n{md.read_text()}\nrows appended to {path}; table written to {md}; "
          f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
