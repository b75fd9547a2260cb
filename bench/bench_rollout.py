"""Benchmark: rollout throughput of the harness (RolloutEngine) on the built-in vault
environment, and its two schedules, ``"lockstep"`` (the default) and ``"overlap"``
(``agentrl_fast/harness/rollout.py``, module doc).

Workloads, all in this process, with fixed seeds (``--seed``), N tasks x M samples each:

* ``sampled``: a tiny random Qwen3 (hidden 64, 2 layers; and hidden 256, 4 layers, where
  generation dominates) whose LM head is biased towards the stop tokens (as in
  ``tests/test_rollout.py``), sampled by ``TorchGenerator``: many short turns, compaction into
  sub-traces, limits. A random model never writes a valid tool call, so its turns get parse-error
  results and no tool runs.
* ``expert-forced``: the same models decoding the scripted expert's actions
  (``expert_action``) token by token with a KV cache — one forward per generated token, as in
  ``TorchGenerator``, with the model's log-probs of the forced tokens. Every turn calls a real
  tool (``open_vault``, ``memory_write``, ``memory_read``) and every rollout succeeds, so this is
  the workload where tool latency shows: ``open_vault`` is run as an async tool that first
  sleeps a fixed latency (hidden 64: 0, 20, 100 ms; hidden 256: 0, 100 ms).
* ``scripted``: ``ScriptedGenerator(expert_action)``, no model: the harness's own cost per
  episode (prompt rendering, decode/encode, tools, SQLite memory, compaction).
* ``TorchGenerator.generate``: the raw decode rate (B prompts, ``max_new_tokens`` decoded without
  stops) for reference.

Rows (``bench.common.Row``, ``op="rollout"``; ``shape`` holds the configuration and what the
rollouts came out as: turns and sub-traces per rollout, generated tokens), per run:

* ``<schedule>``: ``time_ms`` the wall time of ``RolloutEngine.run``, ``tokens_per_s`` the
  generated tokens per second (episodes/s = episodes in ``shape`` / ``time_ms``), ``ratio`` this
  time / the lockstep time of the same configuration (< 1: faster than lockstep);
* ``<schedule>: generate``, ``<schedule>: tools (RolloutStats)``, ``<schedule>: tools running``:
  ``time_ms`` the time in ``generator.generate``; ``RolloutStats.tool_seconds`` (the engine's own
  measure: the union of its tool calls' intervals); the wall time during which at least one tool call was running (union of the
  calls' intervals, measured by wrapping every tool); ``ratio`` that time / the run's wall time
  (the share).

Each configuration runs in rounds of one lockstep and one overlap run back to back (the order
alternating), ``--repeats`` rounds (2 more for configurations of about a second); per schedule
the run with the median wall time is kept, and overlap's speed-up is the median of the rounds'
lockstep / overlap ratios. A round during which other processes used more than ``QUIET_CORES``
of CPU is repeated (at most twice the rounds; the quietest are kept; no retries with ``--tiny``;
``--wait-quiet`` waits for an idle machine before each run), and each printed run says how much
CPU others used. Lockstep and overlap must produce the same token ids for every rollout (each
sequence samples from its own seeded generator); the script checks it and says so.
``--device cuda`` moves the models to the GPU (not yet run there).

Usage (from the repository root)::

    python bench/bench_rollout.py [--device cpu] [--tiny] [--out bench/results/rollout.jsonl]
                                  [--seed 0] [--tasks 16] [--samples 4] [--repeats 3]
                                  [--threads N] [--wait-quiet SECONDS]
"""

import argparse
import asyncio
import dataclasses
import functools
import inspect
import os
import statistics
import threading
import time
from pathlib import Path

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.harness import ChatFormat  # noqa: E402
from agentrl_fast.envs import build_tokenizer
from agentrl_fast.generators.base import Generation
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.generators.torch_generator import TorchGenerator
from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.harness.rollout import RolloutEngine, rollout_metrics
from agentrl_fast.envs.vault import VaultEnvironment, expert_action  # noqa: E402
from agentrl_fast.models.tiny import tiny_qwen3, with_token_bias  # noqa: E402

SCHEDULES = ("lockstep", "overlap")
MAX_NEW_TOKENS = 24
CONTEXT_BUDGET = 240
# A run during which other processes used more CPU than this (cores) is repeated: on 2 cores a
# second busy process makes torch's 2 intra-op threads wait on each other (10x slower steps).
QUIET_CORES = 0.25


# ---------------------------------------------------------------------------------------------
# Environment with timed (and optionally slow) tools


class ToolClock:
    """Start/end times of every tool call (thread-safe: sync tools run in worker threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.intervals: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        with self.lock:
            self.intervals.append((start, end))

    def reset(self) -> None:
        with self.lock:
            self.intervals.clear()

    def busy_seconds(self) -> float:
        """Wall time during which at least one call was running (union of the intervals)."""
        total, cover_start, cover_end = 0.0, None, None
        for start, end in sorted(self.intervals):
            if cover_end is None or start > cover_end:
                if cover_end is not None:
                    total += cover_end - cover_start
                cover_start, cover_end = start, end
            else:
                cover_end = max(cover_end, end)
        if cover_end is not None:
            total += cover_end - cover_start
        return total


def _timed(t, clock: ToolClock, latency: float):
    """The tool ``t`` with its calls timed; ``latency`` > 0: an async tool that sleeps that long,
    then calls the original (sync, microseconds)."""
    fn = t.fn
    if latency > 0:
        async def slow(**arguments):
            start = time.perf_counter()
            try:
                await asyncio.sleep(latency)
                return fn(**arguments)
            finally:
                clock.add(start, time.perf_counter())
        return dataclasses.replace(t, fn=slow)
    if t.is_async:
        async def timed_async(**arguments):
            start = time.perf_counter()
            try:
                return await fn(**arguments)
            finally:
                clock.add(start, time.perf_counter())
        return dataclasses.replace(t, fn=timed_async)

    def timed_sync(**arguments):
        start = time.perf_counter()
        try:
            return fn(**arguments)
        finally:
            clock.add(start, time.perf_counter())
    return dataclasses.replace(t, fn=timed_sync)


class TimedVaultEnvironment(VaultEnvironment):
    """The built-in environment with every tool call timed into ``clock``; ``open_vault`` first
    sleeps ``latency`` seconds (asyncio.sleep) when ``latency`` > 0."""

    def __init__(self, clock: ToolClock, latency: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.latency = clock, latency

    def start(self, task, memory, seed):
        episode = super().start(task, memory, seed)
        episode.tools = [_timed(t, self.clock, self.latency if t.name == "open_vault" else 0.0)
                         for t in episode.tools]
        return episode


# ---------------------------------------------------------------------------------------------
# Models and generators


def stop_biased_qwen3(chat: ChatFormat, hidden: int, layers: int, device: torch.device,
                      seed: int) -> torch.nn.Module:
    """A random Qwen3 over the vault tokenizer (4 query heads, 2 KV heads), its LM head biased
    towards ``</tool_call>`` (+5) and ``<|im_end|>`` (+2) so that its turns are short, as the
    rollout tests build it."""
    model = tiny_qwen3(len(chat.tokenizer), hidden_size=hidden, num_layers=layers,
                       head_dim=hidden // 4, max_positions=1024, seed=seed).eval()
    return with_token_bias(model, {chat.tool_call_close_id: 5.0, chat.im_end_id: 2.0}).to(device)


class ForcedExpertGenerator:
    """The scripted expert's outputs, decoded through ``model`` token by token with a KV cache
    (one batched forward per step, like ``TorchGenerator``): the cost of generating them, and
    the model's log-probs of them at the sampling temperature."""

    def __init__(self, model: torch.nn.Module, chat: ChatFormat):
        self.model, self.chat = model, chat
        self.expert = ScriptedGenerator(expert_action, chat)
        self.pad_id = chat.tokenizer.pad_token_id
        # As TorchGenerator: transformers 5 calls the KV cache argument "cache".
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @torch.no_grad()
    def generate(self, prompts, sampling: SamplingParams, seeds=None) -> list[Generation]:
        from transformers import DynamicCache

        targets = self.expert.generate(prompts, sampling)
        device = next(self.model.parameters()).device
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(list(prompt))
            attention_mask[row, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        steps = max(len(t.ids) for t in targets)
        forced = torch.full((batch, steps), self.pad_id, dtype=torch.long)
        for row, target in enumerate(targets):
            forced[row, :len(target.ids)] = torch.tensor(target.ids)
        forced = forced.to(device)
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=True, logits_to_keep=1,
                            **{self._cache_argument: cache}).logits[:, -1]
        columns = []
        for step in range(steps):
            logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
            columns.append(logprobs.gather(-1, forced[:, step:step + 1])[:, 0].cpu())
            if step == steps - 1:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            logits = self.model(input_ids=forced[:, step:step + 1], attention_mask=attention_mask,
                                position_ids=position_ids, use_cache=True,
                                **{self._cache_argument: cache}).logits[:, -1]
        table = torch.stack(columns, dim=1).tolist()
        return [Generation(t.ids, table[row][:len(t.ids)], t.finish_reason)
                for row, t in enumerate(targets)]


class CountingGenerator:
    """Counts ``generate`` calls, the prompts they batched, the prompt tokens they prefilled
    (with and without the left padding to the longest prompt) and the decode slots they ran
    (batch x the longest generation: a batch decodes until its last sequence stops)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = self.prompts = self.prompt_tokens = self.padded_prompt_tokens = 0
        self.generated = self.decode_slots = 0

    def generate(self, prompts, sampling, seeds=None):
        out = self.inner.generate(prompts, sampling, seeds)
        self.calls += 1
        self.prompts += len(prompts)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.padded_prompt_tokens += len(prompts) * max(len(p) for p in prompts)
        self.generated += sum(len(g.ids) for g in out)
        self.decode_slots += len(out) * max(len(g.ids) for g in out)
        return out


class OtherLoad:
    """CPU time that other processes used while a block ran, in cores (from /proc/stat minus
    this process's own CPU time): a loaded machine makes CPU timings meaningless."""

    def __enter__(self):
        self.start = self._sample()
        return self

    def __exit__(self, *exc):
        busy0, own0, wall0 = self.start
        busy1, own1, wall1 = self._sample()
        self.cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)

    @staticmethod
    def wait(max_seconds: float, probe: float = 1.0) -> float:
        """Wait until other processes use under ``QUIET_CORES`` for ``probe`` seconds, at most
        ``max_seconds``; returns the seconds waited."""
        start = time.perf_counter()
        while time.perf_counter() - start < max_seconds:
            with OtherLoad() as load:
                time.sleep(probe)
            if load.cores < QUIET_CORES:
                break
        return time.perf_counter() - start

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        try:
            with open("/proc/stat") as handle:
                fields = [int(x) for x in handle.readline().split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            busy = float("nan")
        times = os.times()
        return busy, times.user + times.system, time.perf_counter()


# ---------------------------------------------------------------------------------------------
# One configuration


@dataclasses.dataclass
class Run:
    label: str           # workload, e.g. "qwen3-h64-L2 sampled"
    schedule: str
    latency_ms: float
    tasks: int
    samples: int
    wall: float
    generate: float
    tools_summed: float
    tools_busy: float
    tool_calls_run: int
    generated_tokens: int
    generate_calls: int
    mean_batch: float
    prompt_tokens: int          # prefilled (unpadded), all generate calls
    padded_prompt_tokens: int   # prefilled with the left padding
    decode_slots: int           # batch x longest generation, summed over calls
    other_cores: float          # CPU that other processes used during the run
    metrics: dict
    ids: list
    walls: list = dataclasses.field(default_factory=list)  # of the rounds kept (run_rounds)
    paired: list = dataclasses.field(default_factory=list)  # lockstep / overlap wall, per round

    @property
    def episodes(self) -> int:
        return self.tasks * self.samples

    @property
    def shape(self) -> str:
        m = self.metrics
        return (f"{self.label} | vault {self.tasks}x{self.samples} | open_vault "
                f"+{self.latency_ms:g}ms | new<={MAX_NEW_TOKENS} budget {CONTEXT_BUDGET} | "
                f"{m['turns']:.2f} turns {m['sub_traces']:.2f} sub-traces/rollout, "
                f"{self.generated_tokens} tokens generated")


def rollout_config(schedule: str, samples: int) -> RolloutConfig:
    return RolloutConfig(samples_per_task=samples,
                         sampling=SamplingParams(temperature=1.0, top_p=0.95,
                                                 max_new_tokens=MAX_NEW_TOKENS),
                         context_budget=CONTEXT_BUDGET, max_turns=24, summary_chars=200,
                         schedule=schedule)


def run_once(label: str, make_generator, chat: ChatFormat, schedule: str, latency_ms: float,
             tasks: int, samples: int, seed: int) -> Run:
    clock = ToolClock()
    env = TimedVaultEnvironment(clock, latency_ms / 1e3)
    generator = CountingGenerator(make_generator())
    engine = RolloutEngine(generator, chat, env, rollout_config(schedule, samples))
    task_list = env.tasks("train")[:tasks]
    with OtherLoad() as load:
        trajectories = engine.run(task_list, seed=seed)
    stats = engine.stats
    g = generator
    return Run(label, schedule, latency_ms, tasks, samples, stats.wall_seconds,
               stats.generate_seconds, stats.tool_seconds, clock.busy_seconds(),
               len(clock.intervals), stats.generated_tokens, g.calls,
               g.prompts / max(g.calls, 1), g.prompt_tokens, g.padded_prompt_tokens,
               g.decode_slots, load.cores, rollout_metrics(trajectories),
               [[s.ids for s in t.sub_traces] for t in trajectories])


def run_rounds(rounds: int, max_tries: int, wait_quiet: float, label: str, make_generator,
               chat: ChatFormat, latency_ms: float, tasks: int,
               samples: int, seed: int) -> dict[str, Run]:
    """``rounds`` rounds of one lockstep and one overlap run back to back (the order alternates
    between rounds), counting only rounds that other processes left alone (under
    ``QUIET_CORES`` of their CPU), at most ``max_tries`` rounds, each run after waiting up to
    ``wait_quiet`` seconds for the machine to go quiet. Per schedule: the run with the median
    wall time of the quietest rounds, with ``walls`` set; the overlap run also gets ``paired``,
    the rounds' lockstep / overlap wall-time ratios."""
    pairs: list[dict[str, Run]] = []
    clean = 0
    while clean < rounds and len(pairs) < max(max_tries, rounds):
        pair = {}
        for schedule in SCHEDULES if len(pairs) % 2 == 0 else SCHEDULES[::-1]:
            if wait_quiet > 0:
                OtherLoad.wait(wait_quiet)
            pair[schedule] = run_once(label, make_generator, chat, schedule, latency_ms, tasks,
                                      samples, seed)
        pairs.append(pair)
        clean += max(r.other_cores for r in pair.values()) < QUIET_CORES
    pairs = sorted(pairs, key=lambda p: max(r.other_cores for r in p.values()))[:rounds]
    kept = {}
    for schedule in SCHEDULES:
        runs = [p[schedule] for p in pairs]
        walls = [r.wall for r in runs]
        kept[schedule] = runs[walls.index(statistics.median_low(walls))]
        kept[schedule].walls = sorted(walls)
    kept["overlap"].paired = sorted(p["lockstep"].wall / p["overlap"].wall for p in pairs)
    return kept


def run_rows(run: Run, lockstep_wall: float, device: torch.device) -> list[common.Row]:
    base = {"op": "rollout", "shape": run.shape, "dtype": "float32",
            "device": common.device_name(device)}
    s = run.schedule
    return [
        common.Row(provider=s, time_ms=run.wall * 1e3,
                   tokens_per_s=run.generated_tokens / run.wall, ratio=run.wall / lockstep_wall,
                   **base),
        common.Row(provider=f"{s}: generate", time_ms=run.generate * 1e3,
                   ratio=run.generate / run.wall, **base),
        common.Row(provider=f"{s}: tools (RolloutStats)", time_ms=run.tools_summed * 1e3,
                   ratio=run.tools_summed / run.wall, **base),
        common.Row(provider=f"{s}: tools running", time_ms=run.tools_busy * 1e3,
                   ratio=run.tools_busy / run.wall, **base),
    ]


def spread(run: Run) -> str:
    """The kept repeats' wall times, lowest-highest."""
    if len(run.walls) < 2:
        return "1 run"
    return f"{run.walls[0]:.2f}-{run.walls[-1]:.2f}"


def describe(run: Run) -> str:
    m = run.metrics
    return (f"  {run.label:<28} {run.schedule:<8} +{run.latency_ms:>3g}ms: "
            f"{run.wall:7.2f} s ({spread(run)})  {run.episodes / run.wall:7.1f} ep/s  "
            f"{run.generated_tokens / run.wall:7.0f} tok/s  gen {run.generate / run.wall:5.1%}  "
            f"tools(stats) {run.tools_summed / run.wall:6.1%}  tools running "
            f"{run.tools_busy / run.wall:5.1%} ({run.tool_calls_run} calls)  "
            f"{run.generate_calls} generate calls, mean batch {run.mean_batch:.1f}  "
            f"prefilled {run.prompt_tokens} tokens ({run.padded_prompt_tokens} padded), "
            f"decode slots used {run.generated_tokens / max(run.decode_slots, 1):.0%}  "
            f"turns {m['turns']:.2f} sub-traces {m['sub_traces']:.2f} success {m['success']:.2f}  "
            f"[other processes: {run.other_cores:.2f} cores]")


# ---------------------------------------------------------------------------------------------
# Raw decode


def raw_decode_rows(model: torch.nn.Module, label: str, chat: ChatFormat, env: VaultEnvironment,
                    batch: int, new_tokens: int, device: torch.device,
                    args: argparse.Namespace) -> list[common.Row]:
    """``TorchGenerator.generate`` on ``batch`` first-turn prompts of the environment, exactly
    ``new_tokens`` decoded (no stop ids); returns the rows."""
    from agentrl_fast.harness.memory import MemoryStore

    with MemoryStore() as store:
        prompts = []
        for task in env.tasks("train")[:batch]:
            episode = env.start(task, store.namespace(task.id), seed=0)
            messages = [{"role": "system", "content": episode.system_prompt},
                        {"role": "user", "content": episode.prompt}]
            prompts.append(chat.render_ids(messages, [t.schema for t in episode.tools],
                                           add_generation_prompt=True))
    generator = TorchGenerator(model, pad_id=chat.tokenizer.pad_token_id)
    seeds = list(range(batch))
    options = ({"warmup": 1, "repeats": 2, "max_seconds": 2.0} if args.tiny
               else {"warmup": 1, "repeats": 5, "max_seconds": 8.0})

    def timed(max_new: int) -> float:
        sampling = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=max_new)
        out = generator.generate(prompts, sampling, seeds)
        assert all(len(g.ids) == max_new for g in out)
        return common.benchmark(lambda: generator.generate(prompts, sampling, seeds), device,
                                **options)

    tries = []
    for _ in range(1 if args.tiny else 3):
        if args.wait_quiet > 0:
            OtherLoad.wait(args.wait_quiet)
        with OtherLoad() as load:
            total_ms = timed(new_tokens)
            prefill_ms = timed(1)  # prefill + one sampled token
        tries.append((load.cores, total_ms, prefill_ms))
        if load.cores < QUIET_CORES:
            break
    other, total_ms, prefill_ms = min(tries)
    decode_rate = batch * (new_tokens - 1) / ((total_ms - prefill_ms) * 1e-3)
    width = max(len(p) for p in prompts)
    shape = f"{label} | B={batch} prompts of <= {width} tokens | new={new_tokens}"
    base = {"op": "rollout", "dtype": "float32", "device": common.device_name(device)}
    rows = [
        common.Row(provider="TorchGenerator.generate", shape=shape, time_ms=total_ms,
                   tokens_per_s=batch * new_tokens / (total_ms * 1e-3), **base),
        common.Row(provider="TorchGenerator.generate: decode steps only", shape=shape,
                   time_ms=total_ms - prefill_ms, tokens_per_s=decode_rate,
                   ratio=(total_ms - prefill_ms) / total_ms, **base),
    ]
    print(f"  raw decode {shape}: {total_ms:.1f} ms, {rows[0].tokens_per_s:.0f} tok/s "
          f"(prefill + 1st token {prefill_ms:.1f} ms; decode steps {decode_rate:.0f} tok/s, "
          f"{(total_ms - prefill_ms) / (new_tokens - 1):.2f} ms/step) "
          f"[other processes: {other:.2f} cores]", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# The suite


def paired_speedup(run: Run) -> str:
    """Overlap's speed-up over lockstep: the median of the rounds' ratios (lowest-highest)."""
    p = run.paired
    if not p:
        return ""
    text = f"{statistics.median(p):.2f}x"
    return text + (f" ({p[0]:.2f}-{p[-1]:.2f})" if len(p) > 1 else "")


def compare_schedules(runs: dict[str, Run]) -> str:
    lock, over = runs["lockstep"], runs["overlap"]
    same = sum(a == b for a, b in zip(lock.ids, over.ids))
    note = f"same token ids in {same}/{len(lock.ids)} rollouts"
    if same != len(lock.ids):
        note += " (WARNING: schedules should not change a rollout's tokens)"
    return f"    overlap speed-up over lockstep {paired_speedup(over)} (paired rounds); {note}"


def run(args: argparse.Namespace) -> list[common.Row]:
    device = torch.device(args.device)
    tasks, samples = (4, 2) if args.tiny else (args.tasks, args.samples)
    repeats = 1 if args.tiny else args.repeats
    # Configurations of about a second (the small model with tools, the scripted expert) get
    # more rounds; --tiny: one round, no retries on a busy machine.
    cheap = 1 if args.tiny else repeats + 2
    max_tries = 0 if args.tiny else 2 * cheap
    start = time.perf_counter()
    env = VaultEnvironment()
    chat = ChatFormat(build_tokenizer(env.corpus(), vocab_size=1024, words=env.words()))
    print(f"vault tokenizer: {len(chat.tokenizer)} ids ({time.perf_counter() - start:.1f} s); "
          f"{tasks} tasks x {samples} samples, {repeats} rounds ({cheap} for runs of ~1 s), "
          f"median kept; {common.device_name(device)}, torch {torch.__version__}", flush=True)
    # model name -> (hidden, layers, open_vault latencies in ms for the expert-forced runs)
    models = ({"qwen3-h64-L2": (64, 2, (0.0, 20.0))} if args.tiny else
              {"qwen3-h64-L2": (64, 2, (0.0, 20.0, 100.0)),
               "qwen3-h256-L4": (256, 4, (0.0, 100.0))})
    rows: list[common.Row] = []
    summary: list[Run] = []

    def both(label, make_generator, latency, rounds):
        runs = run_rounds(rounds, max_tries, args.wait_quiet, label, make_generator, chat,
                          latency, tasks, samples, args.seed)
        for schedule in SCHEDULES:
            print(describe(runs[schedule]), flush=True)
        print(compare_schedules(runs), flush=True)
        for schedule in SCHEDULES:
            rows.extend(run_rows(runs[schedule], runs["lockstep"].wall, device))
            summary.append(runs[schedule])
        return runs

    for name, (hidden, layers, latencies) in models.items():
        model = stop_biased_qwen3(chat, hidden, layers, device, args.seed)
        sampler = functools.partial(TorchGenerator, model, pad_id=chat.tokenizer.pad_token_id)
        forced = functools.partial(ForcedExpertGenerator, model, chat)
        for schedule in SCHEDULES:  # warm-up, untimed
            run_once(name, sampler, chat, schedule, 0.0, 2, samples, args.seed + 1)
        print(f"{name} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters)",
              flush=True)
        rows.extend(raw_decode_rows(model, name, chat, env, tasks * samples, MAX_NEW_TOKENS,
                                    device, args))
        both(f"{name} sampled", sampler, 0.0, repeats)
        for latency in latencies:
            runs = both(f"{name} expert-forced", forced, latency,
                        cheap if hidden <= 64 else repeats)
            if runs["lockstep"].metrics["success"] != 1.0:
                raise AssertionError("the expert-forced rollouts should all succeed")
    runs = both("scripted expert (no model)", lambda: ScriptedGenerator(expert_action, chat), 0.0,
                cheap)
    if runs["lockstep"].metrics["success"] != 1.0:
        raise AssertionError("the scripted expert should solve every task")

    common.print_table(rows)
    print()
    print(markdown_table(summary))
    path = write(rows, args.out)
    print(f"rows appended to {path}")
    return rows


def markdown_table(runs: list[Run]) -> str:
    header = ("| workload | open_vault latency | schedule | wall s (rounds) | episodes/s | "
              "gen tokens/s | overlap speed-up (rounds) | in generate | tools (RolloutStats) | "
              "tools running | generate calls (mean batch) | prefilled / generated tokens | "
              "decode slots used | turns | sub-traces | other load |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for r in runs:
        speed = paired_speedup(r)
        lines.append(
            f"| {r.label} | {r.latency_ms:g} ms | {r.schedule} | {r.wall:.2f} ({spread(r)}) | "
            f"{r.episodes / r.wall:.1f} | {r.generated_tokens / r.wall:.0f} | {speed} | "
            f"{r.generate / r.wall:.0%} | {r.tools_summed / r.wall:.0%} | "
            f"{r.tools_busy / r.wall:.0%} | {r.generate_calls} ({r.mean_batch:.1f}) | "
            f"{r.padded_prompt_tokens / max(r.generated_tokens, 1):.0f} | "
            f"{r.generated_tokens / max(r.decode_slots, 1):.0%} | "
            f"{r.metrics['turns']:.2f} | {r.metrics['sub_traces']:.2f} | "
            f"{r.other_cores:.2f} cores |")
    return "\n".join(lines)


def write(rows: list[common.Row], out: str | None) -> Path:
    """``--out``: a ``.jsonl`` file, or a folder (``<folder>/rollout.jsonl``, as
    ``bench/gpu_suite.sh`` passes it)."""
    if out and out.endswith(".jsonl"):
        path = Path(out)
        return common.write_rows(rows, path.name.removesuffix(".jsonl"), path.parent)
    return common.write_rows(rows, "rollout", out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="CI-sized run: 4 tasks x 2 samples, the small model, one repeat")
    parser.add_argument("--out", default=None,
                        help="jsonl file to append rows to, or a folder for rollout.jsonl "
                             "(default bench/results/rollout.jsonl)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per configuration; the median wall time is kept")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each timed run, wait up to SECONDS for other processes to "
                             "leave the CPU idle (a shared machine); default 0: no waiting")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's, one per core)")
    return parser.parse_args(argv)


def main() -> None:
    start = time.perf_counter()
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run(args)
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
