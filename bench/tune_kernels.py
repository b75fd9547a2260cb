"""The tuning sweep: block sizes, warps and stages of the Triton attention forward and backward
and of ``token_logprobs``, timed on this GPU; the fastest configuration of each launch is
written where the ops read it (``agentrl_fast/kernels/tuned.py``: ``agentrl_fast/kernels/tuned_configs.json``, keyed by
the GPU's name; commit that file).

    python bench/tune_kernels.py [--device cuda|cpu] [--tiny] [--budget 60] [--out-dir DIR]
        [--write PATH]

Launches tuned (``TARGETS``): attention forward and backward in bf16 at head dims 64 and 128
(causal, GQA 32/8 query/KV heads, a long-tail mix of 65536 tokens), ``token_logprobs`` forward
+ backward (bf16 logits, 4096 rows) at a vocabulary under 16384 and at 151936. Candidates: the
default configuration and every configuration that moves one of its parameters to another value
of ``VALUES`` (a coordinate sweep: ~6 per launch, not a grid) except the moves in ``SKIPPED``,
then the launch's ``EXTRA`` configurations, which move several parameters together (pipelined
attention backwards, spill-free only with another block or warp count): 44 candidates in all;
``tests/triton_aot.py`` compiles the ``EXTRA`` ones for sm_90. On CUDA every candidate is first
compiled in parallel processes (Triton's disk cache; compiles dominate a sweep), then timed with
``triton.testing.do_bench`` (median, L2 flushed); a candidate that fails to compile or launch is
a row with its error. The attention backward's candidates are timed forward + backward with the
forward's default, so their differences are the backward's.

Rows (``tune.jsonl``): ``op="tune"``, ``provider`` the launch (``<op> <key>``), ``shape`` the
configuration, ``ratio`` = the default's time / this one's (> 1: faster than the default);
``tune.md`` the table and the choices. The sweep stops starting candidates when ``--budget``
seconds are spent (a stage of ``bench/gpu_suite.sh``). A launch's choice is written when it
beats the default by 3 % or more (else the default is kept: timing noise must not move it).

``--device cpu`` (the suite's dry run): the kernels run under ``TRITON_INTERPRET=1`` on tiny
shapes, two candidates per launch, and the choices go to ``<out-dir>/tuned_configs.json``, never
to the repository's file (nothing is tuned on a CPU).
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Values tried per parameter (one parameter moved at a time from the default).
VALUES = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (32, 64, 128), "BLOCK": (32, 64, 128),
          "STEP": (16, 32, 64), "BLOCK_V": (1024, 2048, 4096, 8192), "num_warps": (4, 8),
          "num_stages": (1, 2, 3)}
KEEP_MARGIN = 1.03  # a candidate replaces the default only when this much faster
# Coordinate moves not timed, per launch: hopeless at compile time (triton 3.6, sm_90).
# BLOCK 32: M = 32 keys under wgmma's 64 per warpgroup; 128 keys with 4 warps spill 604 B
# (D 64), ~1.8 KB (D 128).
SKIPPED = {("varlen_attention_backward", "bf16_d64"): ({"BLOCK": 32}, {"BLOCK": 128}),
           ("varlen_attention_backward", "bf16_d128"): ({"BLOCK": 32}, {"num_warps": 4})}
# Configurations that move several parameters at once (merged into the default), timed after
# the coordinate moves: pipelined dk/dv kernels (cp.async loads of q and dO), each without
# spills in the hinted triton 3.6 compile (registers in brackets; the coordinate move to
# num_stages 2 is spill-free too: 239 at D 64, 254 at D 128).
EXTRA = {
    ("varlen_attention_backward", "bf16_d64"): (
        {"num_warps": 8, "num_stages": 2},                  # 64 x 64, 2 warpgroups (213)
        {"BLOCK": 128, "num_warps": 8, "num_stages": 2},    # 128 x 64, m64n64 mostly (243)
        {"STEP": 32, "num_stages": 3}),                     # 64 x 32, 4 warps (222)
    ("varlen_attention_backward", "bf16_d128"): (
        {"STEP": 16, "num_stages": 2},                      # 128 x 16, 8 warps (223)
        {"STEP": 16, "num_stages": 3},                      # (234)
        {"BLOCK": 64, "STEP": 64, "num_stages": 2}),        # 64 x 64, 8 warps (252)
}


@dataclasses.dataclass(frozen=True)
class Target:
    op: str     # agentrl_fast/kernels/tuned.py's op name
    key: str    # its key (the aot spec's suffix)
    kind: str   # "attention_forward" | "attention_backward" | "token_logprobs"
    head_dim: int = 64
    vocab: int = 0


TARGETS = (
    [Target("varlen_attention_forward", f"bf16_d{d}", "attention_forward", head_dim=d)
     for d in (64, 128)]
    + [Target("varlen_attention_backward", f"bf16_d{d}", "attention_backward", head_dim=d)
       for d in (64, 128)]
    + [Target("token_logprobs", "block1024", "token_logprobs", vocab=8192),
       Target("token_logprobs", "block4096", "token_logprobs", vocab=151936)])


def default_config(target: Target) -> dict:
    from agentrl_fast.kernels import token_logprobs, varlen_attention

    if target.kind == "attention_forward":
        return varlen_attention.default_forward_config("bf16", target.head_dim)
    if target.kind == "attention_backward":
        return varlen_attention.default_backward_config("bf16", target.head_dim)
    block_v, num_warps = next((b, w) for limit, b, w in token_logprobs.BLOCK_CONFIGS
                              if limit is None or target.vocab < limit)
    return {"BLOCK_V": block_v, "num_warps": num_warps}


def extra_configs(op: str, key: str, default: dict) -> list[dict]:
    """``EXTRA``'s configurations of a launch merged into ``default`` (those naming a parameter
    the default lacks are dropped: the kernel changed)."""
    return [{**default, **extra} for extra in EXTRA.get((op, key), ())
            if set(extra) <= set(default)]


def candidates(default: dict, limit: int | None = None,
               target: Target | None = None) -> list[dict]:
    """The default, then each configuration that moves one parameter to another value (but the
    target's ``SKIPPED`` moves), then the target's ``EXTRA`` configurations; once each."""
    where = (target.op, target.key) if target else None
    skipped = SKIPPED.get(where, ())
    out = [dict(default)]
    for name, value in default.items():
        for other in VALUES.get(name, ()):
            if other != value and {name: other} not in skipped:
                out.append({**default, name: other})
    for config in extra_configs(*where, default) if target else ():
        if config not in out:
            out.append(config)
    return out[:limit] if limit else out


def make_run(target: Target, device: str, tiny: bool):
    """``run()``: one launch of ``target`` (forward, or forward + backward) on fixed inputs."""
    import torch

    dev = torch.device(device)
    if target.kind.startswith("attention"):
        import bench_varlen_attention as b
        from agentrl_fast.ops.varlen_attention import varlen_attention

        sizes = dataclasses.replace(b.SIZES["tiny" if tiny else "cuda"], head_dim=target.head_dim)
        total = 128 if tiny else 65536
        lengths = b.mix_lengths("long-tail", total, sizes, seed=0)
        inst = b.make_instance("tune", lengths, sizes, dev, torch.bfloat16, True, 0)
        q, k, v, cu = inst["q"], inst["k"], inst["v"], inst["cu_seqlens"]
        if target.kind == "attention_forward":
            def run():
                with torch.no_grad():
                    varlen_attention(q, k, v, cu, inst["max_len"], causal=True, backend="triton")
        else:
            def run():
                q.grad = k.grad = v.grad = None
                out = varlen_attention(q, k, v, cu, inst["max_len"], causal=True,
                                       backend="triton")
                out.backward(inst["dout"])
        return run
    import bench_token_logprobs as b

    rows = 8 if tiny else 4096
    vocab = 64 if tiny else target.vocab
    inputs = b.make_inputs(rows, vocab, 0, dev, torch.bfloat16, 0, linear=False)
    return lambda: b.step(b.ours, inputs)


def launch(target: Target, config: dict, run) -> None:
    from agentrl_fast.kernels.tuned import forced

    with forced(target.op, target.key, config):
        run()


def _compile(job: tuple) -> str:
    """In a worker process: launch one candidate once (Triton compiles it into its disk cache)."""
    target, config, device, tiny = job
    try:
        launch(target, config, make_run(target, device, tiny))
        return "ok"
    except Exception as error:  # noqa: BLE001 - recorded; the timing loop reports it again
        return f"{type(error).__name__}: {str(error)[:200]}"


def time_ms(target: Target, config: dict, run, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(lambda: launch(target, config, run), warmup=10,
                                             rep=40, return_mode="median"))
    start = time.perf_counter()  # the dry run: one launch, wall clock
    launch(target, config, run)
    return (time.perf_counter() - start) * 1e3


def precompile(jobs: list[tuple], seconds: float) -> None:
    """Compile the candidates in parallel processes within ``seconds`` (what is left compiles at
    its first timed launch)."""
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 2, 14))
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        results = [pool.apply_async(_compile, (job,)) for job in jobs]
        deadline = time.monotonic() + seconds
        for result in results:
            result.wait(max(0.0, deadline - time.monotonic()))
    finally:
        pool.terminate()


def sweep(args) -> tuple[list, dict]:
    """``(rows, choices)``: a row per candidate timed, the chosen configuration per launch."""
    import common
    import torch

    start = time.monotonic()
    limit = 2 if args.tiny else None
    plans = [(t, candidates(default_config(t), limit, t)) for t in TARGETS
             if not args.tiny or t.head_dim == 64]
    if args.device == "cuda":
        jobs = [(t, c, args.device, args.tiny) for t, cs in plans for c in cs]
        precompile(jobs, seconds=0.6 * args.budget)
    rows, choices = [], {}
    dev = torch.device(args.device)
    for target, configs in plans:
        run = make_run(target, args.device, args.tiny)
        timed = []
        for config in configs:
            if time.monotonic() - start > args.budget:
                print(f"budget spent: {target.op} {target.key} {config} not timed", flush=True)
                break
            try:
                ms = time_ms(target, config, run, args.device)
            except Exception as error:  # noqa: BLE001 - a candidate that cannot run is a row
                print(f"{target.op} {target.key} {config}: {type(error).__name__}: "
                      f"{str(error)[:200]}", flush=True)
                continue
            timed.append((ms, config))
            print(f"{target.op} {target.key} {config}: {ms:.3f} ms", flush=True)
        if not timed or timed[0][1] != configs[0]:
            continue  # the default itself did not run: nothing to compare against
        default_ms = timed[0][0]
        best_ms, best = min(timed, key=lambda item: item[0])
        chosen = best if default_ms / best_ms >= KEEP_MARGIN else configs[0]
        choices[(target.op, target.key)] = chosen
        for ms, config in timed:
            rows.append(common.Row(op="tune", provider=f"{target.op} {target.key}",
                                   shape=json.dumps(config, sort_keys=True), dtype="bfloat16",
                                   device=common.device_name(dev), time_ms=ms,
                                   ratio=default_ms / ms,
                                   commit=common.git_commit(),
                                   date=time.strftime("%Y-%m-%d")))
    return rows, choices


def write_markdown(path: Path, rows: list, choices: dict, command: str) -> None:
    lines = ["# Tuning sweep (`bench/tune_kernels.py`)", "", f"Command: `{command}`", "",
             "| launch | configuration | ms | default / this |", "| --- | --- | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row.provider} | `{row.shape}` | {row.time_ms:.3f} | "
                     f"{row.ratio:.2f}x |")
    lines += ["", "Chosen (written to the tuned configurations):", ""]
    for (op, key), config in choices.items():
        lines.append(f"- {op} {key}: `{json.dumps(config, sort_keys=True)}`")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds")
    parser.add_argument("--out-dir", default=None, help="default bench/results")
    parser.add_argument("--write", default=None,
                        help="tuned configurations file (default: the repository's on CUDA, "
                             "<out-dir>/tuned_configs.json on the CPU)")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before agentrl_fast.kernels is imported
    import common
    from agentrl_fast.kernels import tuned

    out_dir = Path(args.out_dir) if args.out_dir else common.RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, choices = sweep(args)
    common.write_rows(rows, "tune", out_dir)
    if args.device == "cuda":
        import torch

        device, target = torch.cuda.get_device_name(), Path(args.write or tuned.DEFAULT_PATH)
    else:
        device, target = "cpu (dry run)", Path(args.write or out_dir / "tuned_configs.json")
    for (op, key), config in choices.items():
        tuned.write(device, op, key, config, path=target)
    command = "python bench/tune_kernels.py " + " ".join(sys.argv[1:])
    write_markdown(out_dir / "tune.md", rows, choices, command)
    print(f"{len(rows)} rows; choices for {len(choices)} launches written to {target}")
    return 0 if choices else 1


if __name__ == "__main__":
    sys.exit(main())
