"""Benchmark: does RL improve the default run's policy, and how fast? Learning curves of the
RL stage of ``agentrl-fast train`` under configuration variants, all from one warm-start.

The warm-start is the default run's (``warmstart`` section of the config: expert demonstrations
through the real engine, then supervised steps up to its validation target; ``--demos`` /
``--warmstart-steps`` (the most steps) override it), done once (``--save-warm FILE`` keeps its
weights, ``--load-warm FILE`` starts from them; ``--save-policies PREFIX`` keeps each variant's
final policy). ``--set field=value`` changes the base config
of everything (environment, warm-start, RL). Then, for each ``--variant`` (``--set``-style overrides, comma-separated, e.g.
``train.policy_lr=3e-4,train.lam=1.0``; the empty variant is the default), a copy of the
warm-started policy trains for ``--steps`` steps and is evaluated greedily on the first
``--eval-tasks`` held-out tasks every ``--eval-every`` steps. Before RL, ``--pass-k`` samples
per held-out task at the training temperature measure how often the policy finds a solution at
all (pass@1, pass@k): policy-gradient methods sharpen what the policy already samples, so a
low pass@k bounds what RL can reach quickly.

Output: one JSON line per evaluation and per step (``--out``), a table on stdout. What its runs
decided: ``docs/experiments.md``.

Usage (from the repository root; about 6 s per step and variant on 2 CPU cores)::

    python bench/bench_learning.py [--steps 60] [--eval-every 20] [--eval-tasks 100]
        [--demos N] [--warmstart-steps N] [--pass-k 8] [--threads N] [--seed 0]  (--steps 0: SFT only)
        [--set env.max_vaults=2] [--save-warm FILE | --load-warm FILE] [--save-policies PREFIX]
        [--variant "train.policy_lr=3e-4"] [--variant ""] [--out bench/results/learning.jsonl]
"""

import argparse
import collections
import copy
import dataclasses
import json
import sys
import time

import torch

from agentrl_fast.config import RunConfig, apply_overrides  # noqa: E402
from agentrl_fast.harness import RolloutEngine  # noqa: E402
from agentrl_fast.generators import TorchGenerator
from agentrl_fast.train.ppo import Trainer  # noqa: E402
from agentrl_fast.train.run import build, evaluate, expert_demonstrations, warm_start  # noqa: E402


def pass_at_k(policy, chat, environment, config, k: int, tasks: int, seed: int) -> dict:
    """pass@1 and pass@k at the training temperature on the first ``tasks`` held-out tasks."""
    rollout = dataclasses.replace(config.train.rollout, samples_per_task=k, schedule="lockstep")
    engine = RolloutEngine(TorchGenerator(policy, pad_id=chat.tokenizer.pad_token_id or 0), chat,
                           environment, rollout)
    trajectories = engine.run(environment.tasks("eval")[:tasks], seed=seed)
    by_task = collections.defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(bool(t.metrics["success"]))
    return {"pass@1": sum(map(sum, by_task.values())) / len(trajectories),
            f"pass@{k}": sum(any(v) for v in by_task.values()) / len(by_task),
            "never_solved": sum(not any(v) for v in by_task.values()) / len(by_task)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-tasks", type=int, default=100)
    parser.add_argument("--demos", type=int, default=None)
    parser.add_argument("--warmstart-steps", type=int, default=None)
    parser.add_argument("--pass-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--save-warm", default=None)
    parser.add_argument("--load-warm", default=None)
    parser.add_argument("--save-policies", default=None, metavar="PREFIX",
                        help="save each variant's final policy to PREFIX-<variant number>.pt")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = apply_overrides(RunConfig(), [f"seed={args.seed}", *args.set])
    if args.demos is not None:
        base = dataclasses.replace(base, warmstart=dataclasses.replace(base.warmstart,
                                                                       demos=args.demos))
    if args.warmstart_steps is not None:
        base = dataclasses.replace(base, warmstart=dataclasses.replace(
            base.warmstart, steps=args.warmstart_steps))
    base = dataclasses.replace(base, eval=dataclasses.replace(base.eval, tasks=args.eval_tasks))
    out = open(args.out, "a") if args.out else None

    def record(row):
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()

    environment, chat, policy = build(base)
    start = time.perf_counter()
    sft_steps, checks = None, []  # unknown for a loaded warm-start
    if args.load_warm:
        policy.load_state_dict(torch.load(args.load_warm))
    else:
        demos = expert_demonstrations(base, chat, environment)
        losses, checks = warm_start(base, policy, chat, environment, demos)
        sft_steps = len(losses)
    if args.save_warm:
        torch.save(policy.state_dict(), args.save_warm)
    warm = evaluate(policy, chat, environment, base, seed=base.seed)
    explore = pass_at_k(policy, chat, environment, base, args.pass_k, min(args.eval_tasks, 50),
                        seed=base.seed) if args.pass_k else {}
    head = {"kind": "warmstart", "demos": base.warmstart.demos, "steps": sft_steps,
            "seconds": time.perf_counter() - start, "success": warm["success"],
            "reward": warm["reward"], **explore,
            "checks": [(c["sft_step"], c["check_success"]) for c in checks]}
    record(head)
    print(f"warm-start ({base.warmstart.demos} demos, {'loaded' if sft_steps is None else sft_steps} steps, "
          f"{head['seconds']:.0f} s): eval success {warm['success']:.3f}, reward "
          f"{warm['reward']:.3f}; " + ", ".join(f"{k} {v:.2f}" for k, v in explore.items())
          + "; validation checks " + " ".join(f"{s}:{v:.2f}" for s, v in head["checks"]),
          flush=True)
    variants = (args.variant or [""]) if args.steps else []  # --steps 0: warm-start only
    for number, variant in enumerate(variants):
        config = apply_overrides(base, [v for v in variant.split(",") if v])
        trainer = Trainer(copy.deepcopy(policy), chat, environment,
                          # no checkpoints here (the main job's train config makes them)
                          dataclasses.replace(config.train, steps=args.steps,
                                              checkpoint_every=0),
                          log=lambda *a: None)
        start, curve = time.perf_counter(), []
        while trainer.step_index < args.steps:
            m = trainer.step()
            record({"kind": "train", "variant": variant, **{k: v for k, v in m.items()
                                                            if isinstance(v, (int, float))}})
            if trainer.step_index % args.eval_every == 0 or trainer.step_index == args.steps:
                e = evaluate(trainer.policy, chat, environment, config, seed=config.seed)
                curve.append((trainer.step_index, e["success"]))
                record({"kind": "eval", "variant": variant, "step": trainer.step_index,
                        "success": e["success"], "reward": e["reward"],
                        "seconds": time.perf_counter() - start})
        print(f"{variant or '(default)':60s} eval success by step: "
              + " ".join(f"{s}:{v:.2f}" for s, v in curve)
              + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
        if args.save_policies:
            torch.save(trainer.policy.state_dict(), f"{args.save_policies}-{number}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
