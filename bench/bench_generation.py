"""Benchmark: our two generators on the same weights, prompts and sampling — ``TorchGenerator``
(batched sampling in this process) against ``VLLMGenerator`` (a vLLM CPU server, started with
``VLLMServer`` from the vLLM side environment's interpreter, ``--vllm-python``).

Model sizes (``--sizes``), float32, the built-in vault tokenizer (about 1000 ids, so nearly all
parameters are in the layers):

* ``default``: the main job's tiny Qwen3 (``RunConfig()``, ``build``) with head_dim 32, as in
  ``tests/test_vllm.py`` (vLLM's CPU attention refuses 16);
* ``100M``: a Qwen3 of about 100M parameters (hidden 768, 12 layers, 12 query / 4 KV heads of
  64, MLP 2816; fused layers, as ``build`` gives the main job's); the exact count is printed.

Each size is exported (``export_pretrained``) into a temporary folder and served from there.
All torch measurements run first, before the server starts (so an idle server cannot slow
them), then the vLLM ones. Workloads, the same for both generators:

* ``generate B=<b>``: ``generate`` on the first-turn prompts of the first B train tasks of the
  vault environment (``RolloutEngine.prompt_ids``), ``--max-new-tokens`` new tokens with no stop
  ids (every sequence decodes the full length), temperature 1.0, seeds 0..B-1. Both engines keep
  a prefix cache (a repeat of the same prompts would prefill only their last token), so it is
  dropped before every timed call (not timed). ``tokens_per_s`` = B x new tokens / time.
* ``rollout``: ``RolloutEngine(generator, chat, environment, config.train.rollout).run(tasks,
  seed=0)`` on ``--tasks`` train tasks x the main job's samples per task (its limits and
  temperature 0.7). The policy is untrained (random weights) with its LM head set so that a
  stop id (``</tool_call>`` or ``<|im_end|>``) is likely at most positions
  (``with_stop_direction``, weights only, so both engines run it): turns of a few tokens and
  rollouts of many turns, the traffic of a multi-turn agent (turns per episode are printed).
  The engines sample with different random
  streams, so the two runs' trajectories (and token counts) may differ: ``tokens_per_s`` counts
  each run's own generated tokens; ``shape`` holds the episodes (episodes/s = episodes / time).
  vLLM's prefix cache is dropped before each run (the engine drops TorchGenerator's itself).
* ``update_weights``: ``VLLMGenerator.update_weights(policy)`` (safetensors to /dev/shm, every
  server reloads in place), and for reference ``TorchGenerator.update_weights`` on a separate
  copy of the policy (a ``load_state_dict``); ``gbps`` = state-dict bytes / time.

Rows (``bench.common.Row``, ``op="generation"``, ``provider`` ``"torch"`` or ``"vllm"``, one pair
per workload; ``shape`` = ``<size> | <workload>``): ``time_ms`` the median of ``--repeats`` timed
calls (after a warm-up call for ``generate``), and on the vLLM row ``ratio`` = vLLM time / torch
time of the same workload (> 1: TorchGenerator is faster; note this is not common.py's
"provider / ours" reading, as both providers are ours). Rows are appended to
``<out-dir>/generation.jsonl``; ``<out-dir>/generation.md`` (command, date, commit, machine, one
table) is overwritten.

Sanity check (printed, and in the markdown): the trainer's teacher-forced log-probs
(``policy_logprobs`` on packed attention, as ``tests/test_vllm.py`` checks them) of the B=max
generations of each engine against the log-probs the engine returned — the largest absolute
difference. Token ids are not compared: the engines draw from different random streams.

Quiet machine: every measurement records how much CPU other processes used meanwhile (cores,
from /proc; the vLLM server's process group is part of the workload, not "other"). A
measurement with more than ``QUIET_CORES`` of other load is repeated up to twice (the quietest
kept; not with ``--tiny``); ``--wait-quiet S`` waits up to S seconds for an idle machine before
each. The server's threads are bound to all cores (``VLLMServer``'s default); torch runs on
``--threads`` threads (default 2).

Usage (from the repository root)::

    python bench/bench_generation.py [--tiny] [--sizes default,100M] [--threads 2]
        [--max-new-tokens 64] [--batch-sizes 1,16,64] [--tasks 8] [--repeats 3]
        [--wait-quiet SECONDS] [--vllm-python PATH] [--out-dir bench/results]
"""

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.config import RunConfig  # noqa: E402
from agentrl_fast.config.sampling import SamplingParams  # noqa: E402
from agentrl_fast.harness import RolloutEngine, rollout_metrics
from agentrl_fast.generators import ScriptedGenerator, TorchGenerator, VLLMGenerator, VLLMServer
from agentrl_fast.envs import expert_action
from agentrl_fast.models.attention import use_packed_attention  # noqa: E402
from agentrl_fast.models.policy import policy_logprobs  # noqa: E402
from agentrl_fast.models.fused import use_fused_layers  # noqa: E402
from agentrl_fast.models.tiny import tiny_qwen3, with_stop_direction  # noqa: E402
from agentrl_fast.train.export import export_pretrained  # noqa: E402
from agentrl_fast.train.run import build  # noqa: E402

DEFAULT_VLLM_PYTHON = "~/.cache/agentrl_fast/side-envs/vllm/bin/python"
SIZES = ("default", "100M")
# As bench_rollout.py: on 2 cores a second busy process makes torch's threads wait on each other.
QUIET_CORES = 0.25
RETRIES = 2
MIN_WINDOW = 0.5  # seconds: the shortest window other processes' load is measured over
LOGPROB_TOLERANCE = 2e-5  # tests/test_vllm.py's


# ---------------------------------------------------------------------------------------------
# Load from other processes


def _group_cpu_seconds(pgid: int | None) -> float:
    """CPU seconds used so far by the live processes of process group ``pgid`` (the server and
    its engine core: started in a session of their own)."""
    if pgid is None:
        return 0.0
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                text = handle.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # from field 3 (state) on
        if int(fields[2]) == pgid:  # field 5: pgrp; 14, 15: utime, stime
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores used during a block by processes other than this one and the vLLM server's group
    (whose work is what is being timed): /proc/stat's busy time minus both."""

    def __init__(self, pgid: int | None = None):
        self.pgid = pgid

    def __enter__(self):
        self.start = self._sample()
        return self

    def __exit__(self, *exc):
        # /proc/stat counts clock ticks (10 ms): over a shorter window others' load is noise.
        time.sleep(max(0.0, MIN_WINDOW - (time.perf_counter() - self.start[2])))
        (busy0, mine0, wall0), (busy1, mine1, wall1) = self.start, self._sample()
        self.cores = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(wall1 - wall0, 1e-9)

    def _sample(self) -> tuple[float, float, float]:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        times = os.times()
        return busy, times.user + times.system + _group_cpu_seconds(self.pgid), \
            time.perf_counter()

    @staticmethod
    def wait(max_seconds: float, pgid: int | None) -> None:
        """Wait until others use under ``QUIET_CORES`` for a second, at most ``max_seconds``."""
        deadline = time.perf_counter() + max_seconds
        while time.perf_counter() < deadline:
            with OtherLoad(pgid) as load:
                time.sleep(1.0)
            if load.cores < QUIET_CORES:
                return


@dataclasses.dataclass
class Result:
    """One engine's measurement of one workload."""

    seconds: float          # median of the timed calls
    other: float            # cores other processes used meanwhile
    tokens: int = 0         # generated tokens (of the median call)
    episodes: int = 0
    nbytes: int = 0         # weights moved (update_weights)
    outputs: object = None  # the last call's result


def timed(call, prepare, repeats: int, args, pgid: int | None) -> tuple[list, list[float], float]:
    """``repeats`` calls of ``call()``, each after an untimed ``prepare()``: (results, seconds,
    other load). A try that others disturbed is repeated (at most ``RETRIES`` more; none with
    ``--tiny``), and the quietest is kept."""
    best = None
    for _ in range(1 if args.tiny else 1 + RETRIES):
        if args.wait_quiet > 0:
            OtherLoad.wait(args.wait_quiet, pgid)
        results, seconds = [], []
        with OtherLoad(pgid) as load:
            for _ in range(repeats):
                prepare()
                start = time.perf_counter()
                results.append(call())
                seconds.append(time.perf_counter() - start)
        if best is None or load.cores < best[2]:
            best = (results, seconds, load.cores)
        if load.cores < QUIET_CORES:
            break
    return best


def median_of(results: list, seconds: list[float]) -> tuple[object, float]:
    """The result and time of the median call (the lower middle one for an even count)."""
    order = sorted(range(len(seconds)), key=seconds.__getitem__)
    k = order[(len(order) - 1) // 2]
    return results[k], seconds[k]


# ---------------------------------------------------------------------------------------------
# Models


def build_size(size: str):
    """``(config, environment, chat, policy)`` of a model size (see the module doc)."""
    config = RunConfig()
    config.model.head_dim = 32  # vLLM's CPU attention refuses 16
    environment, chat, policy = build(config)
    if size == "100M":
        policy = tiny_qwen3(len(chat.tokenizer), hidden_size=768, num_layers=12, num_heads=12,
                            num_kv_heads=4, head_dim=64, intermediate_size=2816,
                            seed=config.seed)
        use_fused_layers(policy)  # as build() gives the main job's policy
    # Short turns (a random model rarely samples a stop id): rollouts of many turns, the
    # traffic of a multi-turn agent. Weights only, so both engines run the same model.
    with_stop_direction(policy, chat.tool_call_close_id, chat.im_end_id)
    return config, environment, chat, policy.eval()


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def vault_prompts(environment, chat, count: int) -> list[list[int]]:
    """The first ids of rollouts of the first ``count`` train tasks."""
    engine = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, environment)
    tasks = environment.tasks("train")
    if len(tasks) < count:
        raise SystemExit(f"the vault environment has {len(tasks)} train tasks, fewer than "
                         f"B={count}")
    return [engine.prompt_ids(task) for task in tasks[:count]]


def drop_prefix_cache(generator) -> None:
    """Forget every cached prefix: TorchGenerator's in process, each vLLM server's over HTTP."""
    if isinstance(generator, TorchGenerator):
        generator.reset_prefix_cache()
        return
    for endpoint in generator.endpoints:
        request = urllib.request.Request(f"{endpoint.base_url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=60):
            pass


# ---------------------------------------------------------------------------------------------
# Workloads


def measure_generate(generator, prompts, new_tokens: int, args, pgid) -> Result:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)  # no stop ids
    seeds = list(range(len(prompts)))

    def call():
        return generator.generate(prompts, sampling, seeds)

    drop_prefix_cache(generator)
    call()  # warm-up
    results, seconds, other = timed(call, lambda: drop_prefix_cache(generator), args.repeats,
                                    args, pgid)
    outputs, best = median_of(results, seconds)
    if any(g.finish_reason == "error" or len(g.ids) != new_tokens for g in outputs):
        raise RuntimeError(f"{type(generator).__name__}: a sequence did not decode all "
                           f"{new_tokens} tokens: {[(len(g.ids), g.error) for g in outputs]}")
    return Result(best, other, tokens=len(prompts) * new_tokens, outputs=outputs)


def measure_rollout(generator, chat, environment, config, tasks, args, pgid) -> Result:
    engine = RolloutEngine(generator, chat, environment, config.train.rollout)
    results, seconds, other = timed(lambda: (engine.run(tasks, seed=0), engine.stats),
                                    lambda: drop_prefix_cache(generator), args.repeats, args, pgid)
    (trajectories, stats), best = median_of(results, seconds)
    return Result(best, other, tokens=stats.generated_tokens, episodes=stats.episodes,
                  outputs=rollout_metrics(trajectories))


def measure_sync(generator, policy, args, pgid) -> Result:
    repeats = 2 if args.tiny else 5
    results, seconds, other = timed(lambda: generator.update_weights(policy), lambda: None,
                                    repeats, args, pgid)
    return Result(statistics.median(seconds), other, nbytes=state_bytes(policy))


def measure_engine(name, generator, sync_generator, setup, args, pgid) -> dict[str, Result]:
    """Every workload on one engine: ``{workload: Result}``, printing each as it ends."""
    config, environment, chat, policy, prompts = setup
    out = {}
    for batch in args.batch_sizes:
        out[f"generate B={batch}"] = measure_generate(generator, prompts[:batch],
                                                      args.max_new_tokens, args, pgid)
        report(name, f"generate B={batch}", out[f"generate B={batch}"])
    tasks = environment.tasks("train")[:args.tasks]
    out["rollout"] = measure_rollout(generator, chat, environment, config, tasks, args, pgid)
    report(name, "rollout", out["rollout"])
    out["update_weights"] = measure_sync(sync_generator, policy, args, pgid)
    report(name, "update_weights", out["update_weights"])
    return out


def report(engine: str, workload: str, r: Result) -> None:
    text = f"  {engine:<6} {workload:<16} {r.seconds * 1e3:10.1f} ms"
    if r.tokens:
        text += f"  {r.tokens / r.seconds:9.0f} tok/s"
    if r.episodes:
        m = r.outputs
        text += (f"  {r.episodes / r.seconds:6.2f} ep/s ({r.episodes} episodes, {r.tokens} "
                 f"tokens, {m['turns']:.1f} turns and {m['sub_traces']:.1f} sub-traces each)")
    if r.nbytes:
        text += f"  {r.nbytes / r.seconds / 1e9:6.2f} GB/s ({r.nbytes / 1e6:.0f} MB)"
    print(f"{text}  [other processes: {r.other:.2f} cores]", flush=True)


# ---------------------------------------------------------------------------------------------
# Log-prob parity


def largest_logprob_difference(policy, prompts, generations) -> float:
    """max |returned log-prob - the trainer's teacher-forced one| (temperature 1.0), all
    sequences packed into one forward of a packed-attention copy of ``policy``."""
    model = use_packed_attention(copy.deepcopy(policy))
    sequences = [list(p) + g.ids for p, g in zip(prompts, generations)]
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    tokens = torch.tensor([t for s in sequences for t in s])[None]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    with torch.no_grad():
        logp = policy_logprobs(model, tokens, positions, cu_seqlens, int(lengths.max()),
                               temperature=1.0)
    worst = 0.0
    for start, prompt, g in zip(cu_seqlens.tolist(), prompts, generations):
        at = start + len(prompt)
        diff = (logp[at:at + len(g.ids)] - torch.tensor(g.logprobs)).abs().max()
        worst = max(worst, float(diff))
    return worst


# ---------------------------------------------------------------------------------------------
# One size


def run_size(size: str, args) -> tuple[list[common.Row], list[Result], list[str]]:
    """Both engines on one model size: its rows, the row's measurements (torch, vLLM, ... as
    the rows) and its notes for the markdown."""
    config, environment, chat, policy = build_size(size)
    params = sum(p.numel() for p in policy.parameters())
    c = policy.config
    label = (f"{size}: Qwen3 hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
             f"{c.num_attention_heads}/{c.num_key_value_heads} heads of {c.head_dim}, MLP "
             f"{c.intermediate_size}, vocab {c.vocab_size}: {params:,} parameters")
    print(label, flush=True)
    prompts = vault_prompts(environment, chat, max(args.batch_sizes))
    setup = (config, environment, chat, policy, prompts)
    pad = chat.tokenizer.pad_token_id or 0
    torch_results = measure_engine("torch", TorchGenerator(policy, pad_id=pad),
                                   TorchGenerator(copy.deepcopy(policy), pad_id=pad),
                                   setup, args, None)
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as folder:
        model_dir = export_pretrained(policy, Path(folder) / "policy", tokenizer=chat.tokenizer)
        start = time.perf_counter()
        with VLLMServer(model_dir, python=args.vllm_python) as server:
            started = time.perf_counter() - start
            version = vllm_version(server)
            print(f"  vLLM {version} server up in {started:.0f} s (cores {server.threads}, log "
                  f"{server.log_path})", flush=True)
            with VLLMGenerator(server, timeout=1800.0, retries=0) as generator:
                vllm_results = measure_engine("vllm", generator, generator, setup, args,
                                              server.process.pid)
    notes = [label, f"{size}: vLLM {version}, server start {started:.0f} s"]
    notes += parity_notes(size, policy, prompts, torch_results, vllm_results, args)
    rows, results = make_rows(size, prompts, torch_results, vllm_results, args)
    return rows, results, notes


def vllm_version(server: VLLMServer) -> str:
    with urllib.request.urlopen(f"{server.base_url}/version", timeout=10) as response:
        return json.load(response).get("version", "?")


def parity_notes(size, policy, prompts, torch_results, vllm_results, args) -> list[str]:
    workload = f"generate B={max(args.batch_sizes)}"
    notes = []
    for engine, results in (("vLLM", vllm_results), ("TorchGenerator", torch_results)):
        generations = results[workload].outputs
        diff = largest_logprob_difference(policy, prompts[:len(generations)], generations)
        flag = "" if diff < LOGPROB_TOLERANCE else \
            f" (WARNING: above the tests' tolerance {LOGPROB_TOLERANCE:g})"
        notes.append(f"{size}: {engine} {workload} log-probs vs the trainer's teacher-forced "
                     f"ones: max |diff| = {diff:.2e}{flag}")
        print("  " + notes[-1], flush=True)
    return notes


def make_rows(size, prompts, torch_results, vllm_results, args
              ) -> tuple[list[common.Row], list[Result]]:
    """A torch row then a vLLM row per workload, and the measurement behind each row."""
    rows, results = [], []
    for workload, t in torch_results.items():
        v = vllm_results[workload]
        for provider, r in (("torch", t), ("vllm", v)):
            results.append(r)
            rows.append(common.Row(
                op="generation", provider=provider,
                shape=f"{size} | {describe_workload(workload, r, prompts, args)}",
                dtype="float32", device="cpu", time_ms=r.seconds * 1e3,
                tokens_per_s=r.tokens / r.seconds if r.tokens else None,
                gbps=r.nbytes / r.seconds / 1e9 if r.nbytes else None,
                ratio=v.seconds / t.seconds if provider == "vllm" else None))
    return rows, results


def describe_workload(workload: str, r: Result, prompts, args) -> str:
    """The row's shape after the size; the same for both engines."""
    if workload.startswith("generate"):
        batch = int(workload.split("=")[1])
        width = max(len(p) for p in prompts[:batch])
        return f"{workload} x {args.max_new_tokens} new, prompts <= {width} tokens"
    if workload == "rollout":
        return f"rollout {args.tasks} tasks x {r.episodes // args.tasks} = {r.episodes} episodes"
    return f"update_weights {r.nbytes / 1e6:.0f} MB"


# ---------------------------------------------------------------------------------------------
# Markdown


def machine_note(args) -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers

    return (f"{os.cpu_count()} cores ({model}); torch {torch.__version__} on {args.threads} "
            f"threads, transformers {transformers.__version__}, Python "
            f"{platform.python_version()}; the vLLM server bound to all cores")


def rate(r: Result) -> str:
    if r.nbytes:
        return f"{r.nbytes / r.seconds / 1e9:.2f} GB/s"
    text = f"{r.tokens / r.seconds:,.0f} tok/s"
    return text + (f", {r.episodes / r.seconds:.2f} ep/s" if r.episodes else "")


def markdown(rows: list[common.Row], results: list[Result], notes: list[str], args) -> str:
    lines = ["# Generation: TorchGenerator vs VLLMGenerator on the CPU", "",
             f"Command: `python bench/bench_generation.py {' '.join(sys.argv[1:])}`".rstrip(),
             f"Date {rows[0].date}, commit {rows[0].commit}. Machine: {machine_note(args)}.", "",
             "vLLM / torch = vLLM's time over TorchGenerator's for the same workload (> 1: "
             "TorchGenerator faster). Other load: cores used by other processes during the "
             "torch / vLLM measurement.", "",
             "| size | workload | torch ms | torch rate | vLLM ms | vLLM rate | vLLM / torch | "
             "other load |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row, t, v in zip(rows[::2], results[::2], results[1::2]):
        size, workload = row.shape.split(" | ", 1)
        lines.append(f"| {size} | {workload} | {t.seconds * 1e3:,.1f} | {rate(t)} | "
                     f"{v.seconds * 1e3:,.1f} | {rate(v)} | {v.seconds / t.seconds:.2f} | "
                     f"{t.other:.2f} / {v.other:.2f} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: default size, B in (1, 8), 8 new tokens, 2 tasks, "
                             "one timed call each, no retries")
    parser.add_argument("--sizes", default="default,100M", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16,64", help="B of the generate workloads")
    parser.add_argument("--tasks", type=int, default=RunConfig().train.tasks_per_step,
                        help="rollout tasks (x the main job's samples per task)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the median is kept")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each measurement, wait up to SECONDS for an idle machine")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                        help="the vLLM side environment's interpreter")
    parser.add_argument("--out-dir", default=None, help="default bench/results")
    args = parser.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    if not args.sizes or set(args.sizes) - set(SIZES):
        parser.error(f"--sizes: a comma-separated list of {', '.join(SIZES)}")
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if args.tiny:
        args.sizes, args.batch_sizes, args.max_new_tokens = ["default"], [1, 8], 8
        args.tasks, args.repeats = 2, 1
    args.vllm_python = os.path.expanduser(args.vllm_python)
    return args


def main() -> None:
    start = time.perf_counter()
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows, results, notes = [], [], []
    for size in args.sizes:
        size_rows, size_results, size_notes = run_size(size, args)
        rows += size_rows
        results += size_results
        notes += size_notes
    common.print_table(rows)
    path = common.write_rows(rows, "generation", args.out_dir)
    text = markdown(rows, results, notes, args)
    md = path.with_suffix(".md")
    common.write_record(md, text)
    print(f"\n{text}\nrows appended to {path}; table written to {md}; "
          f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
