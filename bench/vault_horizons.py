"""The scripted vault expert, perfect and careless, at growing horizons under the long-horizon
variant's context rule (``agentrl_fast/config/long_horizon.py``), through the real rollout
engine as the warm-start collects its demonstrations (``train.sft.demonstrations``).

    python bench/vault_horizons.py --out bench/results/vault_horizons.md

Per horizon (every task has that many vaults; the rollout limits are ``horizon_rollout`` of it,
the main job's at 3) and per expert: success rate, turns, sub-traces per rollout (mean,
min-max, the distribution) and tokens, then the same for the variant itself
(``long_horizon_config()``), and for contrast some horizons in the main job's
fixed context (186 tokens, 200 summary characters; limits that do not bind). No model, no GPU: seconds on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's agentrl_fast, and bench/common.py

from common import write_record  # noqa: E402

from agentrl_fast.config import RunConfig  # noqa: E402
from agentrl_fast.config.long_horizon import (horizon_rollout,  # noqa: E402
                                              long_horizon_config)
from agentrl_fast.envs import VaultEnvironment, build_tokenizer, expert_action  # noqa: E402
from agentrl_fast.harness.chat_format import ChatFormat  # noqa: E402
from agentrl_fast.train.sft import demonstrations  # noqa: E402

HORIZONS = (3, 6, 10, 20, 30)


def measure(config: RunConfig, save_probability: float, tasks: int, seed: int,
            careless_vaults: float = 1.0) -> dict:
    """The expert's rollouts on the first ``tasks`` train tasks of ``config``'s vault task,
    with ``config``'s rollout limits, summarised (careless about ``careless_vaults`` of the
    vault names)."""
    e = config.env
    env = VaultEnvironment(min_vaults=e.min_vaults, max_vaults=e.max_vaults,
                           jam_probability=e.jam_probability, train_size=tasks, eval_size=1)
    chat = ChatFormat(build_tokenizer(env.corpus(), vocab_size=config.model.vocab_size,
                                      words=env.words()))  # as the run builds it
    policy = functools.partial(expert_action, save_probability=save_probability,
                               careless_vaults=careless_vaults)
    start = time.perf_counter()
    rollouts = demonstrations(policy, chat, env, env.tasks("train"), config.train.rollout,
                              seed=seed, successful_only=False)
    seconds = time.perf_counter() - start
    subs = [len(t.sub_traces) for t in rollouts]
    turns = [t.metrics["turns"] for t in rollouts]
    return {"success": statistics.mean(t.metrics["success"] for t in rollouts),
            "turns": statistics.mean(turns), "turns_range": (min(turns), max(turns)),
            "subs": statistics.mean(subs), "subs_range": (min(subs), max(subs)),
            "subs_hist": sorted(Counter(subs).items()),
            "tokens": statistics.mean(t.num_tokens for t in rollouts), "seconds": seconds}


def horizon_config(vaults: int, fixed_context: bool = False) -> RunConfig:
    """The main job on ``vaults``-vault tasks under the context rule; ``fixed_context``: with
    the main job's context budget and summary characters instead, and limits that do not bind
    (15 turns a vault, 1000 sub-traces), as issue 46 measured it."""
    config = RunConfig()
    rollout = horizon_rollout(vaults)
    if fixed_context:
        rollout = dataclasses.replace(rollout, context_budget=config.train.rollout.context_budget,
                                      summary_chars=config.train.rollout.summary_chars,
                                      max_turns=15 * vaults, max_sub_traces=1000)
    return dataclasses.replace(
        config, env=dataclasses.replace(config.env, min_vaults=vaults, max_vaults=vaults),
        train=dataclasses.replace(config.train, rollout=rollout))


def row(label: str, config: RunConfig, expert: str, m: dict) -> str:
    r = config.train.rollout
    hist = " ".join(f"{n}:{c}" for n, c in m["subs_hist"])
    return (f"| {label} | {r.context_budget} / {r.summary_chars} / {r.max_turns} | {expert} | "
            f"{m['success']:.2f} | {m['turns']:.1f} ({m['turns_range'][0]}-{m['turns_range'][1]})"
            f" | {m['subs']:.1f} ({m['subs_range'][0]}-{m['subs_range'][1]}) | {hist} | "
            f"{m['tokens']:.0f} | {m['seconds']:.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100, help="train tasks per row")
    parser.add_argument("--vaults", type=int, nargs="+", default=list(HORIZONS))
    parser.add_argument("--careless", type=float, default=long_horizon_config()
                        .warmstart.expert_save_probability,
                        help="the careless expert's save probability (default: the variant's)")
    parser.add_argument("--careless-vaults", type=float, default=long_horizon_config()
                        .warmstart.expert_careless_vaults,
                        help="the share of vault names it is careless about (default: the "
                             "variant's)")
    parser.add_argument("--fixed", type=int, nargs="*", default=[10, 20],
                        help="horizons also measured with the main job's fixed context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the markdown record here")
    args = parser.parse_args(argv)
    assert horizon_rollout(3) == RunConfig().train.rollout, "the rule must keep the main job"
    experts = (("perfect", 1.0, 1.0),
               (f"careless (save {args.careless} for {args.careless_vaults} of the names)",
                args.careless, args.careless_vaults))
    configs = [(f"{k} vaults", horizon_config(k)) for k in args.vaults]
    configs += [(f"{k} vaults, fixed context", horizon_config(k, fixed_context=True))
                for k in args.fixed]
    variant = long_horizon_config()
    configs.append((f"variant ({variant.env.min_vaults}-{variant.env.max_vaults})", variant))
    lines = ["| tasks | context / summary chars / max turns | expert | success | turns "
             "(min-max) | sub-traces (min-max) | sub-traces: rollouts | tokens | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, config in configs:
        for expert, probability, careless_vaults in experts:
            lines.append(row(label, config, expert, measure(config, probability, args.tasks,
                                                            args.seed, careless_vaults)))
            print(lines[-1], flush=True)
    if args.out:
        write_record(args.out, "\n".join([
            "# The vault expert at growing horizons under the long-horizon context rule", "",
            f"Machine: 2 shared CPU cores, no model. {args.tasks} train tasks per row, seed "
            f"{args.seed}; the rule (`horizon_rollout`): the main job's limits at 3 vaults "
            "plus 6 tokens, 16 summary characters, 8 turns and 3 sub-traces per further vault.",
            "", "## Results", "", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
