"""The long-horizon vault variant (issue 46): more vaults a task, a context that compacts each
rollout a variable number of times, and a careless expert, so that the warm-start leaves RL real
work. Opt-in: ``agentrl-fast train --config configs/long_horizon.yaml`` (that file is
:func:`long_horizon_config`), the main job is unchanged.

The context rule (:func:`horizon_rollout`): the main job's rollout limits at 3 vaults, plus a
fixed amount per further vault. Why per vault: the task prompt lists every vault (2 tokens
each: the name and a comma), and the compaction summary lists every saved key and must still
hold the latest tool result, often a ``submit_code`` answer listing the vaults left (about 8
characters each). With a fixed budget the key list crowds that result out of the summary; the
expert then loses track of what it handed in and loops (20 and 30 vaults failed in a
200-token context). Measured: ``bench/results/vault_horizons.md``.
"""

from __future__ import annotations

import dataclasses

from agentrl_fast.config import RunConfig
from agentrl_fast.config.rollout import RolloutConfig

BASE_VAULTS = 3  # the main job's vaults: the rule gives its limits unchanged
TOKENS_PER_VAULT = 6  # the prompt's name and comma, the summary's key and its "left:" entry
SUMMARY_CHARS_PER_VAULT = 16  # "name, " in the key list and again in a "left:" list
TURNS_PER_VAULT = 8  # the expert needs about 4.4 (open, save, read, submit, some jams)
SUB_TRACES_PER_VAULT = 3  # the expert needs about 1.3 at this budget
# 4-5 vaults: the main job's tiny model learns to copy the next vault's name for up to 5 in a
# few hundred supervised steps, not for 6 in 800 (docs/experiments.md, issue 46).
MIN_VAULTS, MAX_VAULTS = 4, 5
EXPERT_SAVE_PROBABILITY = 0.3  # the main job's habit, about fewer names (it loses more codes
EXPERT_CARELESS_VAULTS = 0.3   # over 4-5 vaults): the warm-start 0.40, RL to 0.95 (seed 5)


def horizon_rollout(vaults: int) -> RolloutConfig:
    """The main job's rollout limits with ``context_budget``, ``summary_chars``,
    ``max_turns`` and ``max_sub_traces`` grown for tasks of up to ``vaults`` vaults (the module
    doc's rule; at 3 vaults the main job's values)."""
    if isinstance(vaults, bool) or not isinstance(vaults, int) or vaults < BASE_VAULTS:
        raise ValueError(f"horizon_rollout: vaults must be an int >= {BASE_VAULTS}, "
                         f"got {vaults!r}")
    base = RunConfig().train.rollout
    extra = vaults - BASE_VAULTS
    return dataclasses.replace(
        base,
        context_budget=base.context_budget + TOKENS_PER_VAULT * extra,
        summary_chars=base.summary_chars + SUMMARY_CHARS_PER_VAULT * extra,
        max_turns=base.max_turns + TURNS_PER_VAULT * extra,
        max_sub_traces=base.max_sub_traces + SUB_TRACES_PER_VAULT * extra)


def long_horizon_config(min_vaults: int = MIN_VAULTS, max_vaults: int = MAX_VAULTS,
                        expert_save_probability: float = EXPERT_SAVE_PROBABILITY,
                        expert_careless_vaults: float = EXPERT_CARELESS_VAULTS) -> RunConfig:
    """The main job on ``min_vaults``-``max_vaults``-vault tasks under :func:`horizon_rollout`
    of ``max_vaults``, warm-started on an expert careless about ``expert_careless_vaults`` of
    the vault names, saving their codes with ``expert_save_probability`` (its failures are
    imitated too)."""
    config = RunConfig()
    return dataclasses.replace(
        config, run_dir="runs/long_horizon",
        env=dataclasses.replace(config.env, min_vaults=min_vaults, max_vaults=max_vaults),
        warmstart=dataclasses.replace(config.warmstart,
                                      expert_save_probability=expert_save_probability,
                                      expert_careless_vaults=expert_careless_vaults),
        train=dataclasses.replace(config.train,
                                  rollout=horizon_rollout(max_vaults)))
