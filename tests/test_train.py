"""The trainer on the tiny default model: rollout and trainer see identical tokens (ratio starts
at 1), GAE chained across sub-traces against a float64 reference, PPO and GRPO steps that
learn, and kill -9 + resume reproducing an uninterrupted run."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from agentrl_fast.harness import ChatFormat, SubTrace
from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.models.tiny import tiny_qwen3, with_token_bias
from agentrl_fast.models.critic import make_critic
from agentrl_fast.train import TrainConfig, Trainer, bootstrap_values, gae_advantages
from agentrl_fast.train import ppo as ppo_module
from agentrl_fast.train.scoring import score
from agentrl_fast.train.step_batch import StepBatch

ROOT = Path(__file__).resolve().parent.parent


class ParityVaultEnvironment(VaultEnvironment):
    """The vault environment with a reward a random policy gets half the time (the parity of its
    final answer's length), so advantages are not all zero from the first step."""

    def start(self, task, memory, seed):
        episode = super().start(task, memory, seed)
        finish = episode.finish

        def parity_finish(answer):
            finish(answer)
            episode.reward = float(len(answer or "x") % 2)
            return episode.reward
        episode.finish = parity_finish
        return episode


@pytest.fixture(scope="module")
def chat():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


def policy_for(chat, seed=0):
    """The tiny Qwen3, LM head biased to the stop tokens so turns are short and varied."""
    model = tiny_qwen3(len(chat.tokenizer), seed=seed)
    return with_token_bias(model, {chat.tool_call_close_id: 4.0, chat.im_end_id: 3.0})


def train_config(**overrides):
    base = dict(steps=2, tasks_per_step=3, micro_batch_tokens=512, mini_batches=2, epochs=2,
                policy_lr=1e-3, critic_lr=1e-2, kl_coef=0.05,
                rollout=RolloutConfig(samples_per_task=3, context_budget=240, max_turns=6,
                                      summary_chars=100,
                                      sampling=SamplingParams(temperature=0.9, top_p=0.95,
                                                              max_new_tokens=20)))
    base.update(overrides)
    return TrainConfig(**base)


def test_first_step_ratio_is_one_rollout_and_trainer_see_the_same_tokens(chat):
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), train_config(steps=1))
    metrics = trainer.step()
    assert metrics["logprob_mismatch_max"] < 1e-4
    assert metrics["sub_traces"] >= 1 and metrics["turns"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_training_raises_a_learnable_reward(chat, algo):
    """The updates point the right way: on the parity reward (half of random answers earn it)
    the batch reward climbs towards 1 within 16 steps; a sign error or a broken
    advantage would leave it at chance or drive it down."""
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(algo=algo, steps=16, kl_coef=0.0, tasks_per_step=4,
                                   policy_lr=3e-3),
                      log=lambda *args: None)
    rewards = [metrics["reward"] for metrics in trainer.train()]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert first < 0.9, rewards  # not solved from the start
    assert last >= 0.8 and last > first, rewards


@pytest.mark.parametrize("algo, critic", [("ppo", "separate"), ("ppo", "shared"),
                                           ("grpo", "separate")])
def test_a_few_steps_learn(chat, algo, critic):
    policy = policy_for(chat)
    trainer = Trainer(policy, chat, ParityVaultEnvironment(), train_config(algo=algo,
                                                                           critic=critic))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    history = trainer.train()
    assert len(history) == 2
    for metrics in history:
        for key in ("policy_loss", "approx_kl", "clipfrac", "kl_ref", "entropy"):
            assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
        if algo == "ppo":
            assert torch.isfinite(torch.tensor(metrics["value_loss"]))
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no parameter changed"
    assert history[-1]["kl_ref"] != 0.0  # the policy moved away from the reference
    assert (trainer.critic is None) == (algo == "grpo" or critic == "shared")
    assert (trainer.value_head is not None) == (algo == "ppo" and critic == "shared")
    if trainer.value_head is not None:
        assert trainer.value_head.score.weight.abs().sum() > 0  # the shared head learned


def warmup_config(**overrides):
    """Two tasks x two samples, gamma = lam_critic = 1 without a bootstrap: each action token's
    value target is its rollout's reward-to-go; the policy's own lam (0.5) differs."""
    base = dict(steps=1, critic_warmup_steps=2, tasks_per_step=2, kl_coef=0.0, lam=0.5,
                critic_lam=1.0, bootstrap_truncated=False,
                rollout=dataclasses.replace(train_config().rollout, samples_per_task=2))
    base.update(overrides)
    return train_config(**base)


def capture_batches(trainer, monkeypatch) -> list:
    """The (batch, context) of every update_epochs call of ``trainer``."""
    seen, update = [], ppo_module.update_epochs

    def spy(models, optimizers, ctx, batch):
        seen.append((batch, ctx))
        return update(models, optimizers, ctx, batch)
    monkeypatch.setattr(ppo_module, "update_epochs", spy)
    return seen


def reward_to_go(batch) -> torch.Tensor:
    """float64, by hand: per rollout (its sub-traces in order) the sum of its rewards from each
    token on; 0 off the action tokens."""
    out = torch.zeros(batch.packed.num_tokens, dtype=torch.float64)
    rewards, starts = batch.rewards.double(), [0]
    for length in batch.lengths:
        starts.append(starts[-1] + length)
    for rollout in batch.rollout_index.unique().tolist():
        spans = [range(starts[i], starts[i + 1]) for i in range(batch.num_sequences)
                 if batch.rollout_index[i] == rollout]
        positions = torch.tensor([t for span in spans for t in span])
        out[positions] = rewards[positions].flip(0).cumsum(0).flip(0)
    return torch.where(batch.action_mask, out, torch.zeros((), dtype=torch.float64))


def test_critic_warmup_pretrains_only_the_critic_before_the_rl_steps(chat, monkeypatch):
    """critic_warmup_steps=2: two extra steps before RL step 1, each on a fresh batch, train
    the critic alone on the value targets gae_advantages gives with critic_lam (checked against
    a float64 reward-to-go); the policy, its optimizer and schedule, the KL coefficient and the
    step count stay; then `steps` RL steps run as without a warm-up."""
    policy = policy_for(chat)
    trainer = Trainer(policy, chat, ParityVaultEnvironment(), warmup_config(kl_coef=0.01),
                      log=lambda *args: None)
    seen = capture_batches(trainer, monkeypatch)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    critic_before = {k: v.clone() for k, v in trainer.critic.state_dict().items()}
    rows = trainer.warm_up_critic()
    assert [r["step"] for r in rows] == [1, 2] and all(r["value_loss"] > 0 for r in rows)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    assert any(not torch.equal(v, critic_before[k])
               for k, v in trainer.critic.state_dict().items())
    assert trainer.policy_optimizer.state_dict()["state"] == {}
    assert trainer.policy_scheduler.last_epoch == 0 and trainer.critic_scheduler.last_epoch == 0
    assert trainer.kl_coef == 0.01 and trainer.step_index == 0
    assert trainer.critic_warmup_index == 2 and trainer.data_position == 4  # fresh tasks each
    (first, ctx), (second, _) = seen
    assert ctx.critic_only and first.sub_traces[0].rollout_id != second.sub_traces[0].rollout_id
    _, returns = gae_advantages(first.sub_traces, first.split(first.values), first.last_values,
                                gamma=1.0, lam=1.0, bootstrap_truncated=False)
    assert torch.equal(first.returns, torch.cat(returns))
    assert torch.allclose(first.returns.double(), reward_to_go(first), atol=1e-6)
    assert trainer.warm_up_critic() == []  # done: nothing more
    history = trainer.train()
    assert len(history) == 1 and trainer.step_index == 1 and history[0]["step"] == 1
    assert not seen[-1][1].critic_only
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_critic_warmup_of_a_shared_critic_trains_its_value_head_alone(chat):
    policy = policy_for(chat)
    trainer = Trainer(policy, chat, ParityVaultEnvironment(),
                      warmup_config(critic="shared", critic_warmup_steps=1))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    [row] = trainer.warm_up_critic()
    assert row["value_loss"] > 0 and row["critic_grad_norm"] > 0
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    assert trainer.value_head.score.weight.abs().sum() > 0
    state = trainer.policy_optimizer.state
    assert not any(p in state for p in policy.parameters())  # the policy's moments untouched
    assert all(p in state for p in trainer.value_head.parameters())


def test_train_on_refuses_a_pending_critic_warmup(chat):
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), warmup_config())
    with pytest.raises(ValueError, match="critic_warmup_steps > 0 pre-trains the critic"):
        trainer.train_on([])


def test_a_checkpoint_during_the_critic_warmup_resumes_it(tmp_path, chat):
    """checkpoint_every=1: a checkpoint after warm-up step 1 (at RL step 0); a warm-up stopped
    there and resumed ends where an uninterrupted one does (resuming after it: test_cli)."""
    config = warmup_config(checkpoint_dir=str(tmp_path / "a"), checkpoint_every=1)

    class Stop(Exception):
        pass

    def stop_at_2(metrics):
        if metrics["step"] == 2:
            raise Stop

    first = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config)
    with pytest.raises(Stop):
        first.train(warmup_callback=stop_at_2)
    resumed = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config, resume=True)
    assert (resumed.critic_warmup_index, resumed.step_index) == (1, 0)
    rows = []
    resumed.train(steps=0, warmup_callback=rows.append)
    assert [r["step"] for r in rows] == [2] and resumed.step_index == 0
    whole = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                    dataclasses.replace(config, checkpoint_dir=str(tmp_path / "b")))
    whole.train(steps=0)
    assert resumed.data_position == whole.data_position == 4
    for x, y in zip(resumed.critic.state_dict().values(), whole.critic.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6)


def test_ppo_learns_from_one_rollout_per_task_and_grpo_refuses_it(chat):
    """samples_per_task=1: PPO's critic is the baseline, so a step learns (the advantages are
    not all 0); GRPO's group of one has none and is refused, as is filter_groups."""
    one = dataclasses.replace(train_config().rollout, samples_per_task=1)
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(steps=1, rollout=one, tasks_per_step=4, kl_coef=0.0))
    seen = []
    trainer.train(callback=seen.append)
    assert seen[0]["policy_grad_norm"] > 0 and seen[0]["value_loss"] > 0
    grpo = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                   train_config(algo="grpo", steps=1, rollout=one, kl_coef=0.0))
    with pytest.raises(ValueError, match="samples_per_task must be >= 2 for GRPO"):
        grpo.step()
    with pytest.raises(ValueError, match="filter_groups needs rollout.samples_per_task >= 2"):
        train_config(filter_groups=True, rollout=one)


@pytest.mark.parametrize("critic_epochs,critic_steps", [(None, 4), (1, 2), (3, 6)])
def test_critic_epochs_count_the_critics_passes_over_the_batch(chat, critic_epochs, critic_steps):
    """epochs=2 x mini_batches=2: four policy updates; the critic makes ``critic_epochs`` passes
    over the same mini-batches (None: the policy's epochs)."""
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(steps=1, critic_epochs=critic_epochs, kl_coef=0.0))
    metrics = trainer.step()

    def steps(optimizer):
        return {int(optimizer.state[p]["step"]) for group in optimizer.param_groups
                for p in group["params"] if p in optimizer.state}

    assert steps(trainer.policy_optimizer) == {4}
    assert steps(trainer.critic_optimizer) == {critic_steps}
    assert metrics["value_loss"] > 0 and 0 <= metrics["value_clipfrac"] <= 1


def test_overlapped_critic_update_matches_the_sequential_one(chat):
    """With 2 threads the critic's scoring and updates run in a worker thread beside the
    policy's, one thread each: the same step as one after the other, up to float rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {}
        for overlap in (True, False):
            trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                              train_config(steps=1, critic_epochs=3, kl_coef=0.0,
                                           overlap_critic=overlap))
            metrics = trainer.step()
            assert (trainer.overlap.worker is not None) == overlap
            assert torch.get_num_threads() == 2  # restored
            runs[overlap] = metrics, trainer
    finally:
        torch.set_num_threads(threads)
    (got, overlapped), (want, sequential) = runs[True], runs[False]
    for key in ("value_loss", "policy_loss", "critic_grad_norm", "policy_grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    # Each tensor's update equal within 1e-3 of its size: Adam's first step divides by the
    # gradient's own magnitude, so a near-zero gradient element that the policy's thread
    # count rounds differently moves by up to the learning rate (elementwise tolerances on
    # the weights then fail on rounding alone).
    start = policy_for(chat)
    for a, b in ((overlapped.policy, sequential.policy), (overlapped.critic, sequential.critic)):
        initial = make_critic(start) if b is sequential.critic else start
        for (name, x), y, x0 in zip(a.named_parameters(), b.parameters(), initial.parameters()):
            update = (y.detach() - x0.detach()).norm()
            assert (x.detach() - y.detach()).norm() <= 1e-3 * update + 1e-7, name


def test_rollout_logprobs_stand_in_for_the_recomputed_ones(chat):
    """recompute_logprobs=False: the old log-probs are the rollout's sampling log-probs, with no
    scoring forward of the policy; they equal the recomputed ones up to float rounding, so the
    step is the recomputing step's."""
    runs = {}
    for recompute in (True, False):
        trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                          train_config(steps=1, kl_coef=0.0, recompute_logprobs=recompute))
        trajectories = trainer._collect()[1]
        sub_traces = [s for t in trajectories for s in t.sub_traces]
        calls = []  # forwards of the policy's decoder stack while scoring
        handle = trainer.policy.model.register_forward_hook(lambda *_: calls.append(1))
        batch = StepBatch.of(trajectories)
        with trainer.overlap.beside(False) as beside:
            score(trainer.models, batch, trainer._context(), beside)
        old = batch.split(batch.old_logprobs)
        handle.remove()
        runs[recompute] = old, sub_traces, calls
    (recomputed, sub_traces, calls), (from_rollout, rollout_sub_traces, no_calls) = runs[True], runs[False]
    assert calls and not no_calls, "recompute_logprobs=False must not run the policy to score"
    for s, a, b, r in zip(sub_traces, recomputed, from_rollout, rollout_sub_traces):
        assert s.ids == r.ids  # the same rollouts (same seeds)
        mask = torch.tensor(s.action_mask, dtype=torch.bool)
        assert mask.any()
        torch.testing.assert_close(b, torch.tensor(r.logprobs, dtype=torch.float32), rtol=0, atol=0)
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-4)
    metrics = {}
    for recompute in (True, False):
        trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                          train_config(steps=1, kl_coef=0.0, recompute_logprobs=recompute))
        metrics[recompute] = trainer.step()
    assert "logprob_mismatch_max" in metrics[True] and "logprob_mismatch_max" not in metrics[False]
    for key in ("policy_loss", "value_loss", "policy_grad_norm", "clipfrac"):
        assert metrics[False][key] == pytest.approx(metrics[True][key], rel=1e-3, abs=1e-5), key


# ---------------------------------------------------------------------------------------------
# GAE chained across sub-traces.

def make_sub_trace(rollout_id, index, mask, rewards, end):
    s = SubTrace(rollout_id, index=index)
    s.append_context([1])
    for m, r in zip(mask, rewards):
        if m:
            s.append_action([2], [-0.5])
            s.rewards[-1] = r
        else:
            s.append_context([3])
    s.close(end)
    return s


def reference_chained_gae(rollout_subs, values, last_values, gamma, lam, bootstrap_truncated=True,
                          restart_at_compaction=False):
    """Float64, over the unsplit trajectory (all action tokens of the rollout in order) with the
    same compaction points: at the last action token of a continued sub-trace, the next value is
    V at the next sub-trace's first action token, and the GAE sum goes on (A_next: the next
    sub-trace's first advantage) or, with ``restart_at_compaction``, restarts (A_next = 0)."""
    steps = []  # (sub-trace, position, reward, value)
    for k, s in enumerate(rollout_subs):
        for t, m in enumerate(s.action_mask):
            if m:
                steps.append((k, t, float(s.rewards[t]), float(values[k][t])))
    advantages = {}
    next_value, next_advantage = None, 0.0
    for i in range(len(steps) - 1, -1, -1):
        k, t, r, v = steps[i]
        last_of_sub = i == len(steps) - 1 or steps[i + 1][0] != k
        if last_of_sub:
            s = rollout_subs[k]
            if s.end == "terminal":
                bootstrap = 0.0
            elif s.end == "truncated":
                bootstrap = float(last_values[k]) if bootstrap_truncated else 0.0
            else:
                bootstrap = steps[i + 1][3]
            next_value = bootstrap
            if s.end != "continued" or restart_at_compaction:
                next_advantage = 0.0
        delta = r + gamma * next_value - v
        advantages[(k, t)] = delta + gamma * lam * next_advantage
        next_value, next_advantage = v, advantages[(k, t)]
    return advantages


@pytest.mark.parametrize("restart_at_compaction", [False, True])
@pytest.mark.parametrize("last_end,bootstrap_truncated",
                         [("terminal", True), ("truncated", True), ("truncated", False)])
def test_gae_chains_across_sub_traces(last_end, bootstrap_truncated, restart_at_compaction):
    generator = torch.Generator().manual_seed(5)
    masks = [[1, 0, 1, 1], [0, 0], [1, 1, 0, 1, 0], [0, 1]]  # the second has no action token
    ends = ["continued", "continued", "continued", last_end]
    subs = []
    for k, (mask, end) in enumerate(zip(masks, ends)):
        rewards = [float(torch.rand(1, generator=generator)) if m else 0.0 for m in mask]
        subs.append(make_sub_trace("r", k, mask, rewards, end))
    other = make_sub_trace("q", 0, [1, 1], [1.0, 0.0], "terminal")  # another rollout in between
    # Out of order: the batch need not hold a rollout's sub-traces together or in order.
    batch = [subs[2], subs[0], other, subs[3], subs[1]]
    values = [torch.randn(len(s), generator=generator) for s in batch]
    last = torch.randn(len(batch), generator=generator)
    gamma, lam = 0.97, 0.9
    advantages, returns = gae_advantages(batch, values, last, gamma=gamma, lam=lam,
                                         bootstrap_truncated=bootstrap_truncated,
                                         restart_at_compaction=restart_at_compaction)
    rollout_positions = [1, 4, 0, 3]  # sub-traces 0, 1, 2, 3 of rollout "r"
    expected = reference_chained_gae([batch[i] for i in rollout_positions],
                                     [values[i] for i in rollout_positions],
                                     last[rollout_positions], gamma, lam, bootstrap_truncated,
                                     restart_at_compaction)
    other_expected = reference_chained_gae([other], [values[2]], last[[2]], gamma, lam)
    for t in range(len(other)):
        assert advantages[2][t].item() == pytest.approx(other_expected.get((0, t), 0.0), abs=1e-5)
    for k, i in enumerate(rollout_positions):
        for t, m in enumerate(batch[i].action_mask):
            if m:
                assert advantages[i][t].item() == pytest.approx(expected[(k, t)], abs=1e-5)
                assert returns[i][t].item() == pytest.approx(expected[(k, t)] + float(values[i][t]),
                                                              abs=1e-5)
            else:
                assert advantages[i][t].item() == 0.0
    bootstrap = bootstrap_values(batch, values, last, bootstrap_truncated=bootstrap_truncated)
    # continued -> V at the first action token of the next sub-trace with one (skipping index 1)
    assert bootstrap[1].item() == pytest.approx(values[0][1].item())
    assert bootstrap[4].item() == pytest.approx(values[0][1].item())
    cut_by_limit = last_end == "truncated" and bootstrap_truncated
    assert bootstrap[3].item() == pytest.approx(last[3].item() if cut_by_limit else 0.0)


@pytest.mark.parametrize("restart_at_compaction", [False, True])
def test_length_adaptive_lambda_per_rollout(restart_at_compaction):
    """``lam_alpha``: each rollout's lambda is ``clamp(1 - 1 / (alpha * l), 0, 1)`` with ``l``
    its action tokens over all its sub-traces (7 and 2 here), in one packed GAE call; equal to
    the float64 chained reference run per rollout with that lambda."""
    generator = torch.Generator().manual_seed(6)
    masks, ends = [[1, 0, 1, 1], [0, 0], [1, 1, 0, 1, 0], [0, 1]], ["continued"] * 3 + ["terminal"]
    subs = [make_sub_trace("r", k, m, [float(torch.rand(1, generator=generator)) * x for x in m],
                           e) for k, (m, e) in enumerate(zip(masks, ends))]
    other = make_sub_trace("q", 0, [1, 0, 1], [0.0, 0.0, 1.0], "terminal")
    batch = [subs[1], other, subs[0], subs[3], subs[2]]
    values = [torch.randn(len(s), generator=generator) for s in batch]
    last = torch.zeros(len(batch))
    alpha = 0.25
    lam_r, lam_q = 1 - 1 / (alpha * 7), 0.0  # 2 action tokens: 1 - 1 / 0.5 < 0, clamped
    advantages, _ = gae_advantages(batch, values, last, gamma=0.99, lam=0.5, lam_alpha=alpha,
                                   restart_at_compaction=restart_at_compaction)
    positions = [2, 0, 4, 3]
    expected = reference_chained_gae([batch[i] for i in positions], [values[i] for i in positions],
                                     last[positions], 0.99, lam_r,
                                     restart_at_compaction=restart_at_compaction)
    for k, i in enumerate(positions):
        for t, m in enumerate(batch[i].action_mask):
            if m:
                assert advantages[i][t].item() == pytest.approx(expected[(k, t)], abs=1e-5)
    expected_q = reference_chained_gae([other], [values[1]], last[[1]], 0.99, lam_q)
    for t in (1, 3):  # the action tokens (after the context token make_sub_trace opens with)
        assert advantages[1][t].item() == pytest.approx(expected_q[(0, t)], abs=1e-5)


def test_lam_alpha_and_critic_lam_in_the_estimator():
    """Through the ``gae`` estimator: the policy's advantages use the adaptive lambda (3 action
    tokens, alpha 1: 2/3), the critic's targets keep ``critic_lam`` 1 (the plain returns)."""
    from agentrl_fast.harness import Trajectory
    from agentrl_fast.train.advantages import gae_estimator
    trajectory = Trajectory("r", task_id="t")
    trajectory.sub_traces = [make_sub_trace("r", 0, [1, 1, 0, 1], [0.0, 0.0, 0.0, 1.0],
                                            "terminal")]
    batch = StepBatch.of([trajectory])
    batch.values = torch.tensor([0.0, 0.25, 0.5, 0.0, 0.75])
    batch.last_values = torch.zeros(1)
    config = TrainConfig(lam=0.5, lam_alpha=1.0, critic_lam=1.0, whiten_advantages=False)
    advantages, returns = gae_estimator(batch, config)
    want, _ = gae_advantages(batch.sub_traces, [batch.values], batch.last_values, gamma=1.0,
                             lam=2 / 3)
    assert torch.allclose(advantages, want[0], atol=1e-6)
    assert returns.tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, 1.0])
    plain, _ = gae_estimator(batch, TrainConfig(lam=0.5, whiten_advantages=False))
    assert not torch.allclose(plain, advantages)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "0.05"])
def test_lam_alpha_must_be_positive(value):
    with pytest.raises(ValueError, match="lam_alpha must be a number > 0"):
        TrainConfig(lam_alpha=value)


def test_gae_with_lambda_one_gives_every_token_its_rollouts_return():
    """gamma = lam = 1, terminal: through any number of compactions, each action token's return
    is the rollout's reward-to-go (what GRPO broadcasts), whatever the critic says; restarting
    at compactions leaves the early sub-traces' returns to the critic."""
    generator = torch.Generator().manual_seed(7)
    masks = [[1, 0, 1], [0, 1, 1, 0], [1, 0, 1]]
    rewards = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    subs = [make_sub_trace("r", k, m, r, "continued" if k < 2 else "terminal")
            for k, (m, r) in enumerate(zip(masks, rewards))]
    values = [torch.rand(len(s), generator=generator) for s in subs]
    last = torch.zeros(len(subs))
    _, returns = gae_advantages(subs, values, last, gamma=1.0, lam=1.0)
    for s, r in zip(subs, returns):
        torch.testing.assert_close(r, torch.tensor(s.action_mask, dtype=torch.float32))
    _, cut = gae_advantages(subs, values, last, gamma=1.0, lam=1.0, restart_at_compaction=True)
    first_of_next = values[1][[i for i, m in enumerate(subs[1].action_mask) if m][0]]
    assert cut[0][1].item() == pytest.approx(first_of_next.item())  # the critic's, not 1.0
    assert gae_advantages([], [], torch.zeros(0), gamma=1.0, lam=1.0) == ([], [])


def test_gae_needs_whole_rollouts():
    subs = [make_sub_trace("r", 0, [1], [1.0], "continued")]
    with pytest.raises(ValueError, match="lacks sub-trace #1 of its rollout"):
        bootstrap_values(subs, [torch.zeros(2)], torch.zeros(1))


def test_config_errors():
    for overrides, fragment in [({"algo": "dpo"}, "algo must be one of ppo, grpo"),
                                ({"micro_batch_tokens": 100}, "micro_batch_tokens (100) must be"),
                                ({"gamma": 1.5}, "gamma must be in [0, 1]"),
                                ({"epochs": 0}, "epochs must be an int >= 1"),
                                ({"critic_epochs": 0}, "critic_epochs must be an int >= 1"),
                                ({"algo": "grpo", "kl_mode": "reward"},
                                 "kl_mode='reward' needs algo='ppo'"),
                                ({"loss_agg_mode": "seq-mean-token-sum-norm"},
                                 "needs loss_norm_constant"),
                                ({"critic": "tied"}, "critic must be one of separate, shared")]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            train_config(**overrides)


# ---------------------------------------------------------------------------------------------
# Kill -9 and resume.

TRAIN_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from test_train import ParityVaultEnvironment, chat_format, policy_for, train_config
    from agentrl_fast.train import Trainer
    chat = chat_format()
    steps, checkpoint_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=1),
                      resume=True)
    with open(out, "a") as log:  # a line per step as it ends (train() returns only at the end)
        trainer.train(callback=lambda metrics: (log.write(json.dumps(metrics) + "\\n"),
                                                log.flush()))
    torch.save(trainer.policy.state_dict(), out + ".policy.pt")
    torch.save(trainer.critic.state_dict(), out + ".critic.pt")
""")


def chat_format():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


DETERMINISTIC = ("reward", "policy_loss", "value_loss", "kl_ref", "approx_kl", "tokens",
                 "logprob_mismatch_max", "step")


def run_training(tmp, name, steps, kill_after_lines=None):
    script = tmp / "train.py"
    script.write_text(TRAIN_SCRIPT.format(tests=str(ROOT / "tests")))
    out = tmp / f"{name}.jsonl"
    args = [sys.executable, str(script), str(steps), str(tmp / f"{name}-ckpt"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kill_after_lines is None:
        result = subprocess.run(args, check=True, cwd=ROOT, env=env, timeout=300,
                                capture_output=True, text=True)
        (tmp / f"{name}.stdout").write_text(result.stdout)
        return out
    process = subprocess.Popen(args, cwd=ROOT, env=env)
    deadline = time.time() + 240
    while time.time() < deadline:
        lines = out.read_text().count("\n") if out.exists() else 0
        if lines >= kill_after_lines:
            time.sleep(0.3)  # into the next step
            break
        if process.poll() is not None:
            pytest.fail("training finished before it could be killed")
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    return out


@pytest.mark.slow
def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path):
    import json
    steps = 4
    straight = run_training(tmp_path, "straight", steps)
    killed = run_training(tmp_path, "killed", steps, kill_after_lines=2)
    assert killed.read_text().count("\n") < steps  # killed mid-run, not after it
    resumed = run_training(tmp_path, "killed", steps)  # same checkpoint dir and log: resumes
    rows = lambda path: {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
    expected, got = rows(straight), rows(resumed)
    # One line per step: the resumed process continued after the killed one, it did not redo
    # the run from the start.
    assert [json.loads(line)["step"] for line in resumed.read_text().splitlines()] == list(
        range(1, steps + 1))
    assert "resumed from" in (tmp_path / "killed.stdout").read_text()
    for step in range(1, steps + 1):
        for key in DETERMINISTIC:
            assert got[step][key] == expected[step][key], (step, key)
    for part in ("policy", "critic"):
        a = torch.load(f"{straight}.{part}.pt")
        b = torch.load(f"{resumed}.{part}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), part
    del killed


def test_checkpoint_every_needs_a_checkpoint_dir(chat):
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        Trainer(policy_for(chat), chat, ParityVaultEnvironment(), train_config(checkpoint_every=2))


def test_checkpoint_every_0_with_a_checkpoint_dir_writes_only_the_final_checkpoint(tmp_path,
                                                                                  chat):
    config = train_config(steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=0)
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config)
    trainer.train(steps=1)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000000001"]
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000001",
                                                               "step-000000002"]
    trainer.train()  # nothing left to run: nothing written
    assert len(list(tmp_path.glob("step-*"))) == 2


def test_damaged_latest_checkpoint_is_skipped_with_a_message(tmp_path, chat):
    config = train_config(steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config).train()
    newest = sorted(tmp_path.glob("step-*"))[-1]
    damaged = newest / "policy.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    messages = []
    resumed = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config,
                      log=messages.append, resume=True)
    assert resumed.step_index == 1
    assert any(str(newest) in m and "policy.pt" in m for m in messages), messages
    assert any("resumed from" in m and "step-000000001" in m for m in messages), messages


def test_sft_warm_start_fits_the_expert(chat):
    from agentrl_fast.envs import expert_action
    from agentrl_fast.models.tiny import tiny_qwen3
    from agentrl_fast.train.sft import demonstrations, sft
    env = VaultEnvironment()
    rollout = RolloutConfig(samples_per_task=1, context_budget=200, max_turns=24,
                            summary_chars=200, sampling=SamplingParams(max_new_tokens=24))
    demos = demonstrations(expert_action, chat, env, env.tasks("train")[:8], rollout)
    assert len(demos) == 8 and all(d.metrics["success"] for d in demos)
    sub_traces = [s for d in demos for s in d.sub_traces]
    policy = tiny_qwen3(len(chat.tokenizer), seed=0)
    losses = sft(policy, sub_traces, steps=30, batch_sequences=8)
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match="steps must be >= 0"):
        sft(policy, sub_traces, steps=-1)
    # stop(steps_run, losses) after every step; True ends it there.
    seen = []

    def stop(steps_run, so_far):
        seen.append((steps_run, len(so_far)))
        return steps_run == 3

    assert len(sft(policy, sub_traces, steps=50, batch_sequences=8, stop=stop)) == 3
    assert seen == [(1, 1), (2, 2), (3, 3)]
    assert len(sft(policy, sub_traces, steps=4, batch_sequences=8,
                   stop=lambda steps_run, so_far: False)) == 4


def test_each_step_draws_distinct_tasks_in_a_seeded_order(chat):
    env = ParityVaultEnvironment(train_size=5)
    trainer = Trainer(policy_for(chat), chat, env, train_config(tasks_per_step=3))
    steps = [[t.id for t in trainer._next_tasks()] for _ in range(6)]
    assert all(len(set(ids)) == 3 for ids in steps)
    again = Trainer(policy_for(chat), chat, env, train_config(tasks_per_step=3))
    assert steps == [[t.id for t in again._next_tasks()] for _ in range(6)]
    with pytest.raises(ValueError, match="tasks_per_step \\(6\\) exceeds the 5 train tasks"):
        Trainer(policy_for(chat), chat, env, train_config(tasks_per_step=6))


# ---------------------------------------------------------------------------------------------
# Dynamic sampling (filter_groups).

def fixed_reward(episode, reward):
    """``episode``, scoring ``reward`` whatever its answer."""
    finish = episode.finish

    def fixed_finish(answer):
        finish(answer)
        episode.reward = reward
        return reward
    episode.finish = fixed_finish
    return episode


class HalfConstantVaultEnvironment(ParityVaultEnvironment):
    """Parity reward on tasks whose id ends in an even digit; a constant 1 on the others, so
    their groups never vary."""

    def start(self, task, memory, seed):
        episode = super().start(task, memory, seed)
        return fixed_reward(episode, 1.0) if int(task.id[-1]) % 2 == 1 else episode


def test_filter_groups_trains_on_varying_groups_only(chat):
    config = train_config(steps=1, tasks_per_step=3, filter_groups=True, max_rollout_rounds=4,
                          kl_coef=0.0)
    trainer = Trainer(policy_for(chat), chat, HalfConstantVaultEnvironment(), config)
    every, kept, rounds = trainer._collect()
    assert 1 <= rounds <= 4 and len(every) == rounds * 3 * 3  # rounds x tasks x samples
    groups = {}
    for t in every:
        groups.setdefault(t.task_id, []).append(t)
    varying = [task for task, g in groups.items() if len({t.reward for t in g}) > 1]
    kept_tasks = list(dict.fromkeys(t.task_id for t in kept))
    assert kept_tasks == varying[:3]  # the first varying groups, in rollout order, whole
    assert all(len([t for t in kept if t.task_id == task]) == 3 for task in kept_tasks)
    assert all(int(task[-1]) % 2 == 0 for task in kept_tasks)
    assert rounds == 4 or len(kept_tasks) == 3  # it stops as soon as the batch is full
    policy_before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    metrics = trainer.step()
    assert 1 <= metrics["rollout_rounds"] <= 4 and 0 < metrics["kept_groups"] <= 3
    assert "policy_loss" in metrics
    assert any(not torch.equal(v, policy_before[k]) for k, v in trainer.policy.state_dict().items())


class ConstantVaultEnvironment(VaultEnvironment):
    def start(self, task, memory, seed):
        return fixed_reward(super().start(task, memory, seed), 0.5)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_filter_groups_without_a_varying_group_skips_the_update(chat, algo):
    config = train_config(steps=1, tasks_per_step=2, filter_groups=True, max_rollout_rounds=2,
                          kl_coef=0.0, algo=algo)
    trainer = Trainer(policy_for(chat), chat, ConstantVaultEnvironment(), config)
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    metrics = trainer.step()
    assert metrics["rollout_rounds"] == 2 and metrics["kept_groups"] == 0
    assert metrics["reward"] == 0.5 and "policy_loss" not in metrics
    assert all(torch.equal(v, before[k]) for k, v in trainer.policy.state_dict().items())
    assert trainer.step_index == 1 and trainer.data_position == 4  # both rounds drew new tasks


def test_filter_groups_config_errors():
    with pytest.raises(ValueError, match="filter_groups needs rollout.samples_per_task >= 2"):
        train_config(filter_groups=True, rollout=RolloutConfig(samples_per_task=1,
                                                               context_budget=240))
    with pytest.raises(ValueError, match="max_rollout_rounds=3 needs filter_groups"):
        train_config(max_rollout_rounds=3)
    with pytest.raises(ValueError, match="max_rollout_rounds must be an int >= 1"):
        train_config(filter_groups=True, max_rollout_rounds=0)


@pytest.mark.parametrize("critic_lam", [None, 0.5])
def test_critic_lam_decouples_the_critic_targets(chat, critic_lam, monkeypatch):
    """The policy's advantages use lam, the critic's value targets critic_lam (default: lam),
    each the GAE of the same rewards and values."""
    config = train_config(steps=1, kl_coef=0.0, lam=1.0, critic_lam=critic_lam,
                          whiten_advantages=False, bootstrap_truncated=False)
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config)
    seen = {}
    update = ppo_module.update_epochs

    def capture(models, optimizers, context, batch):
        seen.update(sub_traces=batch.sub_traces, values=batch.split(batch.values),
                    advantages=batch.split(batch.advantages), returns=batch.split(batch.returns))
        return update(models, optimizers, context, batch)
    monkeypatch.setattr(ppo_module, "update_epochs", capture)
    trainer.step()
    subs, values = seen["sub_traces"], seen["values"]
    assert any(s.end == "continued" for s in subs)  # bootstraps across sub-traces are exercised
    zeros = torch.zeros(len(subs))  # no truncated bootstrap is read (bootstrap_truncated=False)
    want_adv, want_ret_1 = gae_advantages(subs, values, zeros, gamma=1.0, lam=1.0,
                                          bootstrap_truncated=False)
    _, want_ret_half = gae_advantages(subs, values, zeros, gamma=1.0, lam=0.5,
                                      bootstrap_truncated=False)
    want_ret = want_ret_1 if critic_lam is None else want_ret_half
    for got, want in zip(seen["advantages"], want_adv):
        torch.testing.assert_close(got, want)
    for got, want in zip(seen["returns"], want_ret):
        torch.testing.assert_close(got, want)
    differs = any(not torch.allclose(a, b) for a, b in zip(want_ret_1, want_ret_half))
    assert differs  # the two lambdas give different targets on this batch


def test_critic_lam_range():
    with pytest.raises(ValueError, match=r"critic_lam must be in \[0, 1\]"):
        train_config(critic_lam=1.5)


def test_a_checkpoint_dir_with_checkpoints_resumes_only_when_asked(tmp_path, chat):
    """Running a script again on the same folder used to resume at its last step and train
    nothing, silently; now it is an error naming both choices, and resume=True continues."""
    config = train_config(steps=1, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config).train()
    with pytest.raises(ValueError, match=r"holds a checkpoint \(step 1.*resume=True.*empty "
                                         r"checkpoint_dir"):
        Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config)
    resumed = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config, resume=True)
    assert resumed.step_index == 1
    fresh = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                    train_config(steps=1, checkpoint_dir=str(tmp_path / "new"),
                                 checkpoint_every=1), resume=True)  # nothing there: a fresh start
    assert fresh.step_index == 0


def test_a_metrics_logger_writes_jsonl_and_tensorboard_from_the_api(tmp_path, chat):
    import json

    from agentrl_fast.train import MetricsLogger

    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), train_config(steps=2))
    with MetricsLogger(tmp_path / "run") as logger:
        history = trainer.train(callback=logger)
        logger.write("eval", trainer.step_index, {"success": 0.5, "note": "not a number"})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 1), ("train", 2), ("eval", 2)]
    assert rows[0]["policy_loss"] == history[0]["policy_loss"] and "note" not in rows[2]
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
