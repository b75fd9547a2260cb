"""A user's advantage estimator and policy loss, chosen by name in the config (issue 43): the
built-ins are entries of the same registries, a registered function trains a step of the main
job, an import path works as a name, and bad names fail when the trainer starts."""

import dataclasses

import pytest
import torch

from agentrl_fast.config import RunConfig, apply_overrides
from agentrl_fast.train.advantages import ADVANTAGE_ESTIMATORS, register_advantage
from agentrl_fast.train.losses import POLICY_LOSSES, ppo_policy_loss, register_policy_loss
from agentrl_fast.train.ppo import Trainer
from agentrl_fast.train.run import build

CALLS = {"advantage": 0, "loss": 0}


@register_advantage("reinforce_pp_test")
def reinforce_plus_plus(batch, config):
    """REINFORCE++: each action token's discounted reward-to-go within its rollout, whitened
    over the batch's action tokens; no critic."""
    CALLS["advantage"] += 1
    mask = batch.action_mask
    returns = torch.zeros_like(batch.rewards)
    # Reward-to-go over each rollout's tokens (its sub-traces in order, compactions included).
    for members in _rollouts(batch):
        running = 0.0
        for i in reversed(members):
            piece = slice(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]))
            for t in reversed(range(piece.start, piece.stop)):
                if mask[t]:
                    running = float(batch.rewards[t]) + config.gamma * running
                    returns[t] = running
    picked = returns[mask]
    advantages = torch.zeros_like(returns)
    advantages[mask] = (picked - picked.mean()) / (picked.std() + 1e-6)
    CALLS["batch"], CALLS["advantages"] = batch, advantages
    return advantages, None


def _rollouts(batch):
    members = {}
    for i, rollout in enumerate(batch.rollout_index.tolist()):
        members.setdefault(rollout, []).append(i)
    return list(members.values())


@register_policy_loss("counted_ppo_test")
def counted_ppo(logprobs, entropy, micro, ctx):
    """PPO's loss, recording the advantages it was given."""
    CALLS["loss"] += 1
    CALLS.setdefault("seen", []).append((micro.packed.indices, micro.advantages.cpu()))
    return ppo_policy_loss(logprobs, entropy, micro, ctx)


def _main_job(**train):
    config = apply_overrides(RunConfig(), ["warmstart.steps=0", "train.tasks_per_step=4",
                                           "train.rollout.samples_per_task=2"])
    train = {"checkpoint_every": 0, **train}
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **train))


def _trainer(config):
    environment, chat, policy = build(config)
    return Trainer(policy, chat, environment, config.train, log=lambda *_: None)


def test_the_built_ins_are_registry_entries():
    assert {"gae", "grpo"} <= set(ADVANTAGE_ESTIMATORS.names())
    assert "ppo" in POLICY_LOSSES.names()
    assert RunConfig().train.advantage == "gae"
    assert dataclasses.replace(RunConfig().train, algo="grpo").advantage == "grpo"


def test_a_registered_advantage_and_loss_train_a_step_of_the_main_job():
    config = _main_job(algo="grpo", advantage_estimator="reinforce_pp_test",
                       policy_loss="counted_ppo_test", entropy_coef=0.01)
    trainer = _trainer(config)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.step()
    assert CALLS["advantage"] == 1 and CALLS["loss"] >= 1
    batch = CALLS["batch"]
    assert torch.equal(batch.advantages, CALLS["advantages"]) and batch.returns is None
    assert torch.isfinite(torch.tensor(metrics["policy_loss"]))
    moved = sum(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    assert moved > 0  # the optimizer stepped


@register_advantage("random_test")
def random_advantages(batch, config):
    """Seeded noise on action tokens: advantages no built-in gives, to follow to the loss."""
    noise = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(0))
    CALLS["batch"], CALLS["advantages"] = batch, noise * batch.action_mask
    return CALLS["advantages"], None


def test_the_loss_sees_the_estimators_advantages_token_for_token():
    CALLS["seen"] = []
    trainer = _trainer(_main_job(algo="grpo", advantage_estimator="random_test",
                                 policy_loss="counted_ppo_test", mini_batches=2))
    trainer.step()
    batch, seen = CALLS["batch"], CALLS["seen"]
    assert CALLS["advantages"].abs().sum() > 0 and len(seen) >= 2
    for indices, advantages in seen:
        assert torch.equal(advantages, CALLS["advantages"][batch.token_index(indices)])
    assert sorted(i for indices, _ in seen for i in indices) == list(range(batch.num_sequences))


def test_an_import_path_names_a_function():
    config = _main_job(advantage_estimator="test_plug_points:reinforce_plus_plus", algo="grpo")
    assert ADVANTAGE_ESTIMATORS.get(config.train.advantage) is reinforce_plus_plus


@pytest.mark.parametrize("field, value, message", [
    ("advantage_estimator", "nope", r"train.advantage_estimator: unknown 'nope'; registered: .*gae"),
    ("policy_loss", "nope", r"train.policy_loss: unknown 'nope'; registered: .*ppo"),
    ("policy_loss", "no_such_module:f", r"train.policy_loss: cannot import 'no_such_module:f'"),
])
def test_a_bad_name_fails_when_the_trainer_starts(field, value, message):
    with pytest.raises(ValueError, match=message):
        _trainer(_main_job(**{field: value}))


def test_ppo_needs_value_targets_from_its_estimator():
    config = _main_job(advantage_estimator="reinforce_pp_test")  # algo ppo: a critic to train
    with pytest.raises(ValueError, match="returned no value targets"):
        _trainer(config).step()
