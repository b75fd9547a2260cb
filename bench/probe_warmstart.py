"""Probe of the warm-start: the supervised curve of one seed with every validation check, never
stopped by the target, and the policy saved at each check, so that stopping rules can be
replayed on the curve and RL started from any check (``bench_learning.py --load-warm``). The
SFT trajectory does not depend on the checks (greedy rollouts draw no training randomness), so
the curve is the one a run with any stopping rule follows up to its stop.

Usage (from the repository root)::

    python bench/probe_warmstart.py --seed 5 --out DIR [--steps 700] [--threads N]
        [--set warmstart.fine_check_from=0.2]

Output: ``DIR/checks.jsonl`` (one line per check: step, success, reward, tool error rate) and
``DIR/step-<N>.pt`` for each check from the first fine check on.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from agentrl_fast.config import RunConfig, apply_overrides  # noqa: E402
from agentrl_fast.train.run import build, expert_demonstrations, warm_start  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = apply_overrides(RunConfig(), [f"seed={args.seed}", *args.set])
    # never confirmed: the curve runs to --steps with the run's check schedule
    config = dataclasses.replace(config, warmstart=dataclasses.replace(
        config.warmstart, steps=args.steps, confirm_checks=10**6))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    environment, chat, policy = build(config)
    demos = expert_demonstrations(config, chat, environment)
    rows = open(out / "checks.jsonl", "w")
    fine = []  # the first fine check's step, once reached

    def log(row: dict) -> None:
        if "check_success" not in row:
            return
        rows.write(json.dumps(row) + "\n")
        rows.flush()
        if not fine and row["check_success"] >= config.warmstart.fine_check_from:
            fine.append(row["sft_step"])
        if fine:
            torch.save(policy.state_dict(), out / f"step-{row['sft_step']}.pt")

    warm_start(config, policy, chat, environment, demos, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
