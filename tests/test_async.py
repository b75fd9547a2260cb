"""Asynchronous training (``TrainConfig.max_staleness > 0``): rollouts produced beside the
learner, per-token versions, the staleness bound, partial rollouts across a weight update,
decoupled PPO against a float64 reference, and resume with no group lost or repeated."""

import copy
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.generators import TorchGenerator
from agentrl_fast.envs import VaultEnvironment
from agentrl_fast.models.attention import use_packed_attention
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.ops import ppo_loss
from agentrl_fast.train import TrainConfig, Trainer
from agentrl_fast.train.data import task_at
from agentrl_fast.train.producer import consume, rank_share
from test_train import chat, policy_for  # noqa: F401  (chat: a fixture)

ROOT = Path(__file__).resolve().parent.parent


def config(**overrides):
    base = dict(steps=3, tasks_per_step=3, micro_batch_tokens=512, mini_batches=2,
                policy_lr=1e-3, critic_lr=1e-2, kl_coef=0.0, recompute_logprobs=True,
                tis_cap=2.0, max_staleness=1,
                rollout=RolloutConfig(samples_per_task=2, context_budget=240, max_turns=6,
                                      summary_chars=100,
                                      sampling=SamplingParams(temperature=1.0,
                                                              max_new_tokens=20)))
    base.update(overrides)
    return TrainConfig(**base)


def test_max_staleness_zero_is_the_synchronous_trainer(chat):
    runs = []
    for fields in ({}, {"max_staleness": 0}):
        trainer = Trainer(policy_for(chat), chat, VaultEnvironment(),
                          config(steps=2, **{"max_staleness": 0, **fields}))
        assert trainer.producer is None
        runs.append(trainer.train())
    for a, b in zip(*runs):
        assert {k: v for k, v in a.items() if "second" not in k} == \
               {k: v for k, v in b.items() if "second" not in k}


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_trained_token_is_older_than_max_staleness(chat, max_staleness):
    trainer = Trainer(policy_for(chat), chat, VaultEnvironment(),
                      config(steps=4, max_staleness=max_staleness))
    seen = []
    learn = trainer._learn

    def checked(trajectories):
        lags = [trainer.step_index - v for t in trajectories for s in t.sub_traces
                for v in s.action_versions()]
        seen.append(max(lags))
        assert min(lags) >= 0 and max(lags) <= max_staleness
        return learn(trajectories)
    trainer._learn = checked
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert len(seen) == 4 and len(history) == 4
    for metrics in history:
        assert metrics["staleness_max"] <= max_staleness
        assert sum(metrics[f"staleness_lag_{k}"] for k in range(max_staleness + 1)) > 0
        assert 0.0 < metrics["is_weight_mean"] and metrics["is_weight_capped"] <= 1.0
        assert metrics["policy_version"] == metrics["step"] - 1
    assert max(seen) >= 1, "the producer never ran ahead of the learner"


class _Switching:
    """A TorchGenerator whose second call publishes new weights to the producer (a forced
    weight change in the middle of every episode of the first group)."""

    def __init__(self, inner, trainer, moved):
        self.inner, self.trainer, self.moved, self.calls = inner, trainer, moved, 0

    def generate(self, prompts, sampling, seeds=None):
        self.calls += 1
        if self.calls == 2:
            self.trainer.producer.publish(self.moved, version=1)
        return self.inner.generate(prompts, sampling, seeds)

    def update_weights(self, model):
        self.inner.update_weights(model)


def switched_group(chat, partial_rollouts: bool):
    """``(kept group, trainer, policy, moved)``: the first group of a producer whose generator
    publishes new weights (``moved``, version 1) at its second call, in the middle of every
    episode of that group."""
    from agentrl_fast.harness import RolloutEngine
    from agentrl_fast.train.producer import RolloutProducer
    policy = policy_for(chat)
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    trainer = Trainer(policy, chat, VaultEnvironment(),
                      config(max_staleness=2, steps=1, partial_rollouts=partial_rollouts))
    trainer.producer.close()  # restart it on a generator that switches weights mid-episode
    model = copy.deepcopy(policy).eval()
    generator = _Switching(TorchGenerator(model, pad_id=chat.tokenizer.pad_token_id or 0),
                           trainer, moved)
    engine = RolloutEngine(generator, chat, trainer.environment, trainer.config.rollout,
                           memory=trainer.memory)
    trainer.producer = RolloutProducer(engine, model, trainer.tasks, seed=0, start=0,
                                       version=0, capacity=1, partial_rollouts=partial_rollouts)
    try:
        kept, _, _ = trainer.producer.take(1, max_lag=2, learner_version=1)
        restarted = trainer.producer.restarted_groups
    finally:
        trainer.close()
    return kept[0], restarted, policy, moved


def test_a_rollout_across_a_weight_update_keeps_both_versions_and_log_probs(chat):
    group, _, policy, moved = switched_group(chat, partial_rollouts=True)
    both = [s for t in group.trajectories for s in t.sub_traces
            if set(s.action_versions()) == {0, 1}]
    assert both, "no sub-trace spans the weight update"
    packed = {0: use_packed_attention(copy.deepcopy(policy)),
              1: use_packed_attention(copy.deepcopy(moved))}
    for s in both:
        ids = torch.tensor(s.ids)
        cu = torch.tensor([0, len(ids)], dtype=torch.int32)
        for version, model in packed.items():
            with torch.no_grad():
                logp = policy_logprobs(model, ids[None], torch.arange(len(ids))[None], cu,
                                       len(ids), temperature=1.0)
            mine = [i for i, v in enumerate(s.versions) if v == version and s.action_mask[i]]
            torch.testing.assert_close(logp[mine], torch.tensor(s.logprobs)[mine],
                                       atol=1e-4, rtol=0)


def test_abort_and_restart_trains_every_rollout_on_one_version(chat):
    """partial_rollouts=False: a group whose weights change mid-episode starts again from its
    first turn, so every kept rollout was sampled by one version (the new one), and the restart
    is counted."""
    group, restarted, _, _ = switched_group(chat, partial_rollouts=False)
    assert restarted >= 1
    for t in group.trajectories:
        assert {v for s in t.sub_traces for v in s.action_versions()} == {1}, t.rollout_id
        assert t.rollout_id.endswith("/restart1")
    with pytest.raises(ValueError, match="partial_rollouts=False"):
        config(max_staleness=0, partial_rollouts=False)


def test_decoupled_ppo_loss_equals_a_float64_reference():
    """AReaL's decoupled PPO: r = exp(l - p) in the clipped objective, each token's loss
    times w = min(exp(p - b), cap): ppo_loss with old = proximal p, rollout = behaviour b."""
    gen = torch.Generator().manual_seed(0)
    n = 37
    current = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    proximal = current + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    behaviour = proximal + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = torch.rand(n, generator=gen) > 0.2
    low, high, cap = 0.2, 0.28, 2.0
    logp = current.clone().requires_grad_(True)
    loss, _ = ppo_loss(logp, proximal, advantages, mask, clip_low=low, clip_high=high,
                       rollout_logprobs=behaviour, tis_cap=cap)
    loss.backward()
    want = 0.0
    for i in range(n):
        if not mask[i]:
            continue
        r = math.exp(current[i] - proximal[i])
        a = float(advantages[i])
        pg = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
        want += min(math.exp(proximal[i] - behaviour[i]), cap) * pg
    want /= int(mask.sum())  # token-mean
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12, abs=1e-12)
    # d/dl of w * max(-a r, -a clip(r)): w * -a * r where the unclipped term is taken
    ref = current.clone().requires_grad_(True)
    r = torch.exp(ref - proximal)
    pg = torch.maximum(-advantages * r, -advantages * torch.clamp(r, 1 - low, 1 + high))
    w = torch.clamp(torch.exp(proximal - behaviour), max=cap)
    (torch.where(mask, w * pg, 0).sum() / mask.sum()).backward()
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_consumed_positions_compact_and_the_stream_is_seeded():
    consumed: set[int] = set()
    assert consume(0, consumed, [1, 3]) == 0 and consumed == {1, 3}
    assert consume(0, consumed, [0]) == 2 and consumed == {3}
    assert consume(2, consumed, [2]) == 4 and consumed == set()
    tasks = list(range(10))
    assert [task_at(tasks, p, 0) for p in range(10)] == [task_at(tasks, p, 0) for p in range(10)]
    assert sorted(task_at(tasks, p, 0) for p in range(10)) == tasks  # a permutation per pass


@pytest.mark.parametrize("count,size", [(3, 2), (4, 2), (1, 3), (5, 4), (6, 3)])
def test_rank_shares_add_up_and_rotate(count, size):
    shares = [[rank_share(count, step, rank, size) for rank in range(size)]
              for step in range(2 * size)]
    assert all(sum(step) == count for step in shares)
    assert all(max(step) - min(step) <= 1 for step in shares)
    totals = [sum(step[rank] for step in shares) for rank in range(size)]  # over `size` steps
    assert max(totals) - min(totals) == 0  # every rank's positions advance at the same rate


def consumed_positions(trainer) -> list[int]:
    """The stream positions ``trainer``'s learner consumes from now on (filled as it runs)."""
    positions, take = [], trainer.producer.take

    def recording(*args, **kwargs):
        kept, dropped, waited = take(*args, **kwargs)
        positions.extend(g.position for g in kept + dropped)
        return kept, dropped, waited
    trainer.producer.take = recording
    return positions


def test_resume_loses_and_repeats_no_group(chat, tmp_path):
    """Two steps, a checkpoint each, then the trainer is dropped with groups buffered and in
    flight (as by SIGKILL); a new trainer resumes: every position is consumed exactly once."""
    cfg = config(steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1, max_staleness=2)
    first = Trainer(policy_for(chat), chat, VaultEnvironment(), cfg)
    taken = consumed_positions(first)
    first.train()
    first.close()  # groups buffered or in flight are lost with the process
    second = Trainer(policy_for(chat), chat, VaultEnvironment(),
                     config(steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=1,
                            max_staleness=2), resume=True)
    assert second.step_index == 2
    assert second.data_position + len(second.consumed_ahead) == len(taken)
    later = consumed_positions(second)
    try:
        history = second.train()
    finally:
        second.close()
    assert not set(taken) & set(later), "a consumed group was trained on again"
    assert len(later) == len(set(later))
    # Nothing lost: every position below the first unconsumed one was consumed by one of them
    # (groups in flight at the "crash", skipped by the first trainer, by the second).
    consumed = set(range(second.data_position)) | second.consumed_ahead
    assert set(taken) | set(later) == consumed
    assert history[-1]["groups_consumed"] == len(consumed)  # the count the metrics report


CHILD = """
import json, sys
sys.path.insert(0, "tests")
from test_async import config, consumed_positions, policy_for
from agentrl_fast.harness import ChatFormat
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.train import Trainer
env = VaultEnvironment()
chat = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
trainer = Trainer(policy_for(chat), chat, env, config(steps=50, checkpoint_dir=sys.argv[1],
                                                      checkpoint_every=1, max_staleness=2),
                  resume=True)
positions = consumed_positions(trainer)
with open(sys.argv[2], "a") as log:
    def logged(metrics):
        log.write(json.dumps({"step": metrics["step"], "positions": positions}) + "\\n")
        log.flush()
        positions.clear()
    trainer.train(callback=logged)
"""


def test_kill_9_and_resume_repeat_and_lose_no_group(chat, tmp_path):
    """A real process killed with SIGKILL mid-run (steps past its last checkpoint logged);
    the resumed trainer consumes no group the checkpoint had counted, and every position below
    its first unconsumed one is consumed exactly once."""
    checkpoints, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(checkpoints), str(log)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 4):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = Trainer(policy_for(chat), chat, VaultEnvironment(),
                      config(steps=50, checkpoint_dir=str(checkpoints), checkpoint_every=1,
                             max_staleness=2), resume=True)
    # What the checkpoint counted; the log agrees for the steps it has (the kill may fall
    # between a step's checkpoint and its log line).
    counted = set(range(resumed.data_position)) | resumed.consumed_ahead
    logged = [p for s in steps if s["step"] <= resumed.step_index for p in s["positions"]]
    assert resumed.step_index >= 3 and len(logged) == len(set(logged))
    assert set(logged) <= counted and len(counted) - len(logged) <= 2 * 3  # one step's groups
    later = consumed_positions(resumed)
    try:
        history = resumed.train(steps=resumed.step_index + 2)
    finally:
        resumed.close()
    assert not set(counted) & set(later), "a group counted before the kill was consumed again"
    consumed = set(range(resumed.data_position)) | resumed.consumed_ahead
    assert set(counted) | set(later) == consumed
    assert history[-1]["groups_consumed"] == len(consumed)


# Under torchrun (2 real ranks, gloo): a producer per rank over disjoint positions, one batch.

WORKER = """
import json, sys
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
from test_async import config, consumed_positions, policy_for
from agentrl_fast.harness import ChatFormat
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.train import Trainer
from agentrl_fast.train.distributed import DistributedConfig, World, init_world, shutdown
group = init_world(DistributedConfig(strategy="ddp"))
world = World(DistributedConfig(strategy="ddp"), group.rank, group.size, group.device)
env = VaultEnvironment()
chat = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
trainer = Trainer(policy_for(chat), chat, env,
                  config(steps=3, checkpoint_dir=sys.argv[1], checkpoint_every=1,
                         max_staleness=1, distributed=DistributedConfig(strategy="ddp")),
                  log=lambda *args: None, world=world, resume=True)
positions = consumed_positions(trainer)
rows = trainer.train()
trainer.close()
with open(f"{sys.argv[2]}.{world.rank}.json", "w") as out:
    json.dump({"positions": positions, "rows": rows, "data_position": trainer.data_position,
               "consumed_ahead": sorted(trainer.consumed_ahead)}, out)
shutdown()
"""


@pytest.mark.slow
def test_two_ranks_produce_disjoint_positions_train_one_batch_and_resume_on_one(chat,
                                                                                 tmp_path):
    """Each rank's producer takes only its own positions (p % 2 == rank), the ranks train on
    the same gathered batch within the staleness bound, and the 2-rank checkpoint resumes on
    one process with no consumed group repeated and none lost."""
    from test_distributed import torchrun
    script, out, checkpoints = tmp_path / "worker.py", tmp_path / "out", tmp_path / "ckpt"
    script.write_text(WORKER)
    result = torchrun(2, str(script), str(checkpoints), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    for rank, part in enumerate(ranks):
        assert part["positions"] and all(p % 2 == rank for p in part["positions"])
    same = ("groups_consumed", "tokens", "sub_traces", "policy_loss", "value_loss",
            "staleness_max", "stale_groups_dropped", "learner_wait_seconds")
    for a, b in zip(ranks[0]["rows"], ranks[1]["rows"], strict=True):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}  # one gathered batch
        assert a["staleness_max"] <= 1
    taken = ranks[0]["positions"] + ranks[1]["positions"]
    assert len(taken) == len(set(taken))
    counted = set(range(ranks[0]["data_position"])) | set(ranks[0]["consumed_ahead"])
    assert set(taken) == counted and ranks[0]["rows"][-1]["groups_consumed"] == len(counted)
    resumed = Trainer(policy_for(chat), chat, VaultEnvironment(),
                      config(steps=4, checkpoint_dir=str(checkpoints), max_staleness=1),
                      resume=True)
    assert resumed.step_index == 3
    later = consumed_positions(resumed)
    try:
        history = resumed.train()
    finally:
        resumed.close()
    assert not counted & set(later), "a group consumed on two ranks was consumed again"
    consumed = set(range(resumed.data_position)) | resumed.consumed_ahead
    assert counted | set(later) == consumed
    assert history[-1]["groups_consumed"] == len(consumed)
