"""The long-horizon vault variant (agentrl_fast/config/long_horizon.py, configs/long_horizon.yaml):
its config, and the scripted expert through the real engine under its context rule."""

import dataclasses
import re
from pathlib import Path

import pytest

from agentrl_fast.config import RunConfig, load_config, validate
from agentrl_fast.config.long_horizon import horizon_rollout, long_horizon_config
from agentrl_fast.envs import VaultEnvironment, build_tokenizer, expert_action
from agentrl_fast.harness.chat_format import IM_END, ChatFormat
from agentrl_fast.train.run import expert_demonstrations
from agentrl_fast.train.sft import demonstrations

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chat():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), vocab_size=1024, words=env.words()))


def _expert_rollouts(chat, vaults: int, tasks: int, rollout=None):
    env = VaultEnvironment(min_vaults=vaults, max_vaults=vaults, train_size=tasks, eval_size=1)
    return demonstrations(expert_action, chat, env, env.tasks("train"),
                          rollout or horizon_rollout(vaults), successful_only=False)


def _summaries(chat, trajectory) -> list[str]:
    """The compaction summary opening each sub-trace after the first."""
    texts = [chat.decode(s.ids) for s in trajectory.sub_traces[1:]]
    return [re.search(r"Collect the codes of vaults [a-z ,]+\.\n\n(.*?)" + re.escape(IM_END),
                      text, flags=re.S).group(1) for text in texts]


def test_the_yaml_is_the_preset_and_validates():
    config = load_config(ROOT / "configs" / "long_horizon.yaml")
    validate(config)
    assert dataclasses.replace(config, base_dir=None) == long_horizon_config()
    assert (config.env.min_vaults, config.env.max_vaults) == (4, 5)
    assert config.warmstart.expert_save_probability < 1


def test_the_rule_keeps_the_main_job_at_3_vaults_and_grows_after():
    assert horizon_rollout(3) == RunConfig().train.rollout
    small, large = horizon_rollout(10), horizon_rollout(20)
    for name in ("context_budget", "summary_chars", "max_turns", "max_sub_traces"):
        assert getattr(small, name) < getattr(large, name), name
    with pytest.raises(ValueError, match="vaults must be an int >= 3"):
        horizon_rollout(2)


@pytest.mark.parametrize("vaults", [10, 20])
def test_the_perfect_expert_solves_long_horizons_with_bounded_summaries(chat, vaults):
    rule = horizon_rollout(vaults)
    rollouts = _expert_rollouts(chat, vaults, 5)
    assert all(t.metrics["success"] for t in rollouts)
    counts = {len(t.sub_traces) for t in rollouts}
    assert min(counts) > vaults // 2 and len(counts) > 1  # it compacts, a variable number of times
    for trajectory in rollouts:
        assert all(len(s.ids) <= rule.context_budget for s in trajectory.sub_traces)
        for summary in _summaries(chat, trajectory):
            # Within its bound, and the key list leaves room for the latest result.
            assert len(summary) <= rule.summary_chars, summary
            assert "Latest tool results:" in summary, summary


def test_without_the_rule_20_vaults_fail(chat):
    fixed = dataclasses.replace(horizon_rollout(20), context_budget=186, summary_chars=200)
    assert not any(t.metrics["success"] for t in _expert_rollouts(chat, 20, 2, fixed))


def test_the_careless_experts_demonstrations_fail_sometimes(chat):
    config = long_horizon_config()
    config = dataclasses.replace(config, warmstart=dataclasses.replace(config.warmstart,
                                                                       demos=40))
    e = config.env
    env = VaultEnvironment(min_vaults=e.min_vaults, max_vaults=e.max_vaults, train_size=40,
                           eval_size=1)
    demos = expert_demonstrations(config, chat, env)
    assert len(demos) == 40  # a careless expert's failures are kept
    successes = sum(t.metrics["success"] for t in demos)
    assert 0 < successes < 40
