"""``agentrl-fast``: ``train`` (the main job, ``RunConfig()``, with no arguments), ``config`` (the
configuration ``train`` would run, as YAML), ``eval`` (a run's or a checkpoint's success on the
held-out split), ``bench`` (the benchmark scripts).

    agentrl-fast train                                   # warm-start + PPO, ~minutes on a CPU
    agentrl-fast train --algo grpo --steps 50 --seed 1
    agentrl-fast train --config configs/grpo.yaml --set train.kl_coef=0.01
    agentrl-fast config > configs/default.yaml           # the main job's YAML
    agentrl-fast eval --run-dir runs/default
    agentrl-fast bench rollout --tiny

Also ``python -m agentrl_fast.cli ...``, which is what ``torchrun`` launches on N ranks:

    torchrun --nproc-per-node 2 -m agentrl_fast.cli train --run-dir runs/two
    torchrun --nproc-per-node 2 -m agentrl_fast.cli train --run-dir runs/two --resume
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("gae", "varlen_attention", "token_logprobs", "ppo_loss", "fused_layers", "rollout")


def _train_config(args):
    from agentrl_fast.config import (apply_overrides, library_defaults, load_config,
                                     names_own_agent, overrides_to_dict)
    overrides = list(args.set or [])
    # --set naming a model or environment of one's own starts from the library's defaults, as
    # a file naming them does (load_config).
    own = names_own_agent(overrides_to_dict(overrides))
    config = load_config(args.config, base=library_defaults() if own else None)
    for flag, key in (("algo", "train.algo"), ("steps", "train.steps"), ("seed", "seed"),
                      ("run_dir", "run_dir")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return apply_overrides(config, overrides)


def _cmd_config(args) -> int:
    from agentrl_fast.config import to_yaml, validate
    config = _train_config(args)
    validate(config)
    print(to_yaml(config), end="")
    return 0


def _cmd_train(args) -> int:
    from agentrl_fast.config import validate
    from agentrl_fast.train.run import train_run
    config = _train_config(args)
    validate(config)
    if args.resume:
        from agentrl_fast.train.checkpoint import latest_checkpoint
        directory = Path(config.run_dir) / "checkpoints"
        if latest_checkpoint(directory, log=lambda message: None) is None:
            print(f"agentrl-fast train --resume: no complete checkpoint in {directory}",
                  file=sys.stderr)
            return 2
    train_run(config, progress=not args.no_progress, resume=args.resume)
    return 0


def _cmd_eval(args) -> int:
    import dataclasses

    from agentrl_fast.config import load_config
    from agentrl_fast.train.checkpoint import latest_checkpoint, load_checkpoint
    from agentrl_fast.train.run import build, evaluate
    from agentrl_fast.train.state import load_policy_weights

    run_dir = Path(args.run_dir)
    config = load_config(run_dir / "config.yaml")
    if args.tasks is not None:
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval,
                                                                      tasks=args.tasks))
    environment, chat, policy = build(config)
    if args.checkpoint:
        path = Path(args.checkpoint)
        _, state = load_checkpoint(path)
    else:
        found = latest_checkpoint(run_dir / "checkpoints", log=lambda m: print(m, file=sys.stderr))
        if found is None:
            print(f"agentrl-fast eval: no checkpoint in {run_dir / 'checkpoints'}", file=sys.stderr)
            return 2
        path, _, state = found
    load_policy_weights(policy, state)  # (a torchrun job's: from its shards)
    m = evaluate(policy, chat, environment, config, seed=config.seed)
    print("| checkpoint | held-out tasks | success | mean reward | sub-traces | turns |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {path.name} | {config.eval.tasks} | {m['success']:.3f} | {m['reward']:.3f} | "
          f"{m['sub_traces']:.2f} | {m['turns']:.2f} |")
    return 0


def _cmd_bench(args) -> int:
    root = Path(__file__).resolve().parent.parent / "bench"
    if not root.is_dir():
        print("agentrl-fast bench: the benchmark scripts live in the repository checkout "
              f"(bench/), not found at {root}", file=sys.stderr)
        return 2
    names = args.names or list(BENCHMARKS)
    for name in names:
        if name not in BENCHMARKS:
            print(f"agentrl-fast bench: unknown benchmark {name!r} (known: "
                  f"{', '.join(BENCHMARKS)})", file=sys.stderr)
            return 2
    status = 0
    for name in names:
        command = [sys.executable, str(root / f"bench_{name}.py"), "--device", args.device]
        if args.tiny:
            command.append("--tiny")
        print(f"=== bench_{name} ===", flush=True)
        status |= subprocess.run(command, cwd=root.parent).returncode
    return status


def _add_config_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--config", help="a YAML file over the main job (configs/)")
    command.add_argument("--algo", choices=("ppo", "grpo"))
    command.add_argument("--steps", type=int)
    command.add_argument("--seed", type=int)
    command.add_argument("--run-dir", dest="run_dir")
    command.add_argument("--set", action="append", metavar="FIELD=VALUE",
                         help="override any field, e.g. train.rollout.context_budget=256")


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="agentrl-fast", description=__doc__.split("\n\n")[0])
    commands = main.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train (no arguments: the main job)")
    _add_config_arguments(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--resume", action="store_true",
                       help="continue from the run folder's last complete checkpoint (an error "
                            "when it has none; without the flag a run folder with checkpoints "
                            "is an error)")
    train.set_defaults(run=_cmd_train)
    show = commands.add_parser("config", help="print the configuration train would run, as YAML "
                                              "(no arguments: the main job, configs/default.yaml)")
    _add_config_arguments(show)
    show.set_defaults(run=_cmd_config)
    evaluate = commands.add_parser("eval", help="success and mean reward on the held-out split")
    evaluate.add_argument("--run-dir", default="runs/default")
    evaluate.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    evaluate.add_argument("--tasks", type=int, help="held-out tasks (default: the run's eval.tasks)")
    evaluate.set_defaults(run=_cmd_eval)
    bench = commands.add_parser("bench", help="run the benchmark scripts")
    bench.add_argument("names", nargs="*", help=f"some of {', '.join(BENCHMARKS)} (default all)")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--tiny", action="store_true", help="quick, small shapes")
    bench.set_defaults(run=_cmd_bench)
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from agentrl_fast.config import ConfigError
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"agentrl-fast: bad configuration: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
