"""Shared-prefix (tree) packing in the trainer (issue 47, ``train.share_prefixes``): on a fixed
batch of real rollouts the scoring pass and one step with sharing equal the plain packing's
(policy, separate critic, shared value head, reference; PPO and GRPO) within float32 rounding;
a model that cannot read shared prefixes falls back to the plain packing, said once;
``torch.compile`` runs the shared rows; FSDP2 on 2 ranks with sharing equals one unshared
process; ``mini_batch_order="task"`` keeps a task's samples in one micro-batch and saves more.

This file is also the 2-rank worker (``torchrun -m test_train_shared_prefixes OUT``), started in
the background when the session starts (tests/background.py)."""

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from agentrl_fast.config import DistributedConfig
from agentrl_fast.models.attention import packed_attention_forward, packed_attention_mask
from agentrl_fast.models.critic import critic_values
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.train import Trainer
from agentrl_fast.train.distributed import World, _grouped_plan
from agentrl_fast.train.packing import shared_layout
from agentrl_fast.train.scoring import score
from agentrl_fast.train.step_batch import StepBatch
from agentrl_fast.train.update import mini_batch_units, mini_batches

from background import Command
from test_train import (ParityVaultEnvironment, chat, chat_format, policy_for,  # noqa: F401
                        train_config)

ROOT = Path(__file__).resolve().parent.parent
# One step of the test trainer: two mini-batches of one micro-batch each, a reference
# (kl_coef), recomputed old log-probs.
STEP = dict(steps=1, epochs=1, mini_batches=2, kl_coef=0.05, critic_lr=1e-3,
            micro_batch_tokens=1024)


def quiet(*args):
    pass


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these tiny models gain nothing from two, and on 2 shared cores two
    OpenMP threads can wait on each other for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trainer_for(chat, share: bool, log=quiet, **overrides) -> Trainer:
    """A trainer on the tiny policy, its value heads random (zero ones would make every value,
    and the critic backbone's first gradient, 0 whatever the packing)."""
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(**{**STEP, "share_prefixes": share, **overrides}), log=log)
    for critic in (trainer.critic, trainer.value_head):
        if critic is not None:
            weight = critic.score.weight
            with torch.no_grad():
                weight.copy_(0.3 * torch.randn(weight.shape,
                                               generator=torch.Generator().manual_seed(1)))
    return trainer


@pytest.fixture(scope="module")
def rollouts(chat):
    """One step's rollouts of the tiny policy (3 tasks x 3 samples), every test's batch."""
    trajectories = trainer_for(chat, False)._collect()[1]
    assert sum(len(t.sub_traces) for t in trajectories) > len(trajectories)  # compactions
    return trajectories


def close(got: torch.Tensor, want: torch.Tensor, atol: float) -> float:
    """The largest difference, asserted at most ``atol`` plus float32 rounding of ``want``."""
    if want.numel() == 0:
        return 0.0
    diff = float((got - want).abs().max())
    assert diff <= atol + 1e-6 * float(want.abs().max()), diff
    return diff


# ---------------------------------------------------------------------------------------------
# Scoring and one step, sharing on vs off.


def scored(chat, rollouts, share: bool, critic: str) -> tuple[StepBatch, dict]:
    trainer = trainer_for(chat, share, critic=critic)
    batch = StepBatch.of(rollouts)
    with trainer.overlap.beside(True) as beside:
        metrics = score(trainer.models, batch, trainer._context(), beside)
    return batch, metrics


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_scoring_with_shared_prefixes_equals_the_plain_packing(chat, rollouts, critic):
    (on, metrics), (off, plain) = (scored(chat, rollouts, share, critic)
                                   for share in (True, False))
    assert plain == {} and 0.1 < metrics["scoring_shared_token_fraction"] < 1
    for name in ("old_logprobs", "ref_logprobs", "values", "last_values"):
        assert getattr(off, name).abs().max() > 0, name  # a real comparison
        close(getattr(on, name), getattr(off, name), atol=2e-5)  # seen: 0 (bit-identical)


STEP_KEYS = ("policy_loss", "value_loss", "approx_kl", "entropy", "clipfrac", "kl_ref",
             "policy_grad_norm", "critic_grad_norm")


def stepped(chat, rollouts, share: bool, **overrides) -> tuple[dict, Trainer]:
    trainer = trainer_for(chat, share, **overrides)
    return trainer.train_on(rollouts), trainer


def trained(trainer: Trainer) -> list[torch.nn.Module]:
    return [m for m in (trainer.policy, trainer.critic, trainer.value_head) if m is not None]


@pytest.mark.parametrize("algo, critic", [("ppo", "separate"), ("ppo", "shared"),
                                           ("grpo", "separate")])
def test_one_step_with_shared_prefixes_equals_the_plain_packing(chat, rollouts, algo, critic):
    """The same losses, gradients (the last mini-batch's) and parameters after the step.
    Largest differences seen: losses 2.4e-7, gradients 1.5e-7 (largest entries 0.06-0.09),
    parameters 6.7e-6 (Adam's first step divides each gradient entry by its own size, so an
    entry near 0 turns rounding into up to a few thousandths of the learning rate, 1e-3)."""
    (on, sharing), (off, plain) = (stepped(chat, rollouts, share, algo=algo, critic=critic)
                                   for share in (True, False))
    assert "shared_token_fraction" not in off and 0.1 < on["shared_token_fraction"] < 1
    for key in STEP_KEYS:
        if key in off:
            assert on[key] == pytest.approx(off[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(trained(sharing), trained(plain), strict=True):
        for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
            if y.grad is not None:
                close(x.grad, y.grad, atol=1e-5)
            close(x.detach(), y.detach(), atol=5e-5)


def test_the_warm_start_with_shared_prefixes_equals_the_plain_packing(chat):
    from agentrl_fast.config import RolloutConfig, SamplingParams
    from agentrl_fast.envs import VaultEnvironment, expert_action
    from agentrl_fast.models.tiny import tiny_qwen3
    from agentrl_fast.train.sft import demonstrations, sft

    env = VaultEnvironment()
    rollout = RolloutConfig(samples_per_task=1, context_budget=200, max_turns=24,
                            summary_chars=200, sampling=SamplingParams(max_new_tokens=24))
    demos = demonstrations(expert_action, chat, env, env.tasks("train")[:6], rollout)
    sub_traces = [s for d in demos for s in d.sub_traces]
    runs = {share: sft(tiny_qwen3(len(chat.tokenizer)), sub_traces, steps=3, batch_sequences=12,
                       share_prefixes=share) for share in (True, False)}
    assert runs[True] == pytest.approx(runs[False], rel=1e-5)  # seen: 1.4e-6 apart (of 6.4)
    assert shared_layout(sub_traces).saved_tokens > 0.1 * sum(len(s) for s in sub_traces)


# ---------------------------------------------------------------------------------------------
# The fallback: a model whose attention would ignore prefix_of.

PLAIN_ATTENTION = "test_plain_packed_attention"


def plain_attention(*args, prefix_of=None, **kwargs):
    """Packed attention that drops shared prefixes, as transformers' flash attention would."""
    return packed_attention_forward(*args, **kwargs)


def test_a_model_that_cannot_share_falls_back_to_the_plain_packing_once(chat, rollouts):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PLAIN_ATTENTION, plain_attention)
    AttentionMaskInterface.register(PLAIN_ATTENTION, packed_attention_mask)
    logs = []
    fallback = trainer_for(chat, True, log=logs.append)
    fallback.critic.set_attn_implementation(PLAIN_ATTENTION)  # e.g. flash_attention_2 on a GPU
    got = fallback.train_on(rollouts)
    want, _ = stepped(chat, rollouts, False)
    assert "shared_token_fraction" not in got and "scoring_shared_token_fraction" not in got
    assert {k: got[k] for k in STEP_KEYS} == {k: want[k] for k in STEP_KEYS}  # bit for bit
    fallback.train_on(rollouts)
    assert logs == [f"train.share_prefixes: the critic runs attention {PLAIN_ATTENTION!r}, which "
                    "would ignore shared prefixes; training on the plain packing (call "
                    "agentrl_fast.models.use_packed_attention on it to share)"]  # once


# ---------------------------------------------------------------------------------------------
# torch.compile of the models on shared rows.


def test_compiled_models_run_shared_prefixes(chat, rollouts):
    """The policy's backbone and the critic compiled (aot_eager: the traced graph, without
    inductor's compile time): log-probs, values and gradients on the shared rows equal the eager
    plain packing's."""
    trainer = trainer_for(chat, True)
    batch = StepBatch.of(rollouts)
    micro = batch.micro(range(min(6, batch.num_sequences)), share_prefixes=True)
    assert micro.layout.saved_tokens > 0

    def run(layout):
        policy, critic = trainer.policy, trainer.critic
        for model in (policy, critic):
            model.zero_grad(set_to_none=True)
        logp = policy_logprobs(policy, *micro.model_inputs(), token_mask=micro.action_mask,
                               layout=layout)
        values, last = critic_values(critic, *micro.model_inputs(), layout=layout)
        (logp.sum() + values.sum() + last.sum()).backward()
        grads = [p.grad.clone() for m in (policy, critic) for p in m.parameters()
                 if p.grad is not None]
        return [logp.detach(), values.detach(), last.detach(), *grads]

    want = run(None)
    trainer.policy.model.compile(backend="aot_eager")
    trainer.critic.compile(backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    try:
        got = run(micro.layout)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    finally:
        torch._dynamo.reset()
    for a, b in zip(got, want, strict=True):
        close(a, b, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Mini-batches by task.


def saved_fraction(batch: StepBatch, trainer: Trainer, order: str) -> float:
    """Saved / plain tokens over one epoch's micro-batches with ``mini_batch_order=order``;
    asserts that with ``"task"`` each task's sub-traces share a micro-batch."""
    ctx, units = trainer._context(), mini_batch_units(batch, order)
    ctx = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, mini_batch_order=order))
    saved = plain = 0
    for group in mini_batches(len(units), ctx.config.mini_batches, 0, 0, 0):
        indices = sorted(i for u in group for i in units[u])
        plan = ctx.plan(batch, indices)
        for task in (units[u] for u in group if order == "task"):
            assert any(set(task) <= set(micro) for micro in plan), (task, plan)
        for micro in plan:
            layout = shared_layout([batch.sub_traces[i] for i in micro])
            saved, plain = saved + layout.saved_tokens, plain + layout.num_tokens
    return saved / plain


def test_task_order_keeps_a_tasks_samples_in_one_micro_batch_and_saves_more(chat, rollouts):
    trainer = trainer_for(chat, True, mini_batches=3, micro_batch_tokens=1024)
    batch = StepBatch.of(rollouts)
    assert [len(g) for g in mini_batch_units(batch, "task")] == [
        sum(len(t.sub_traces) for t in rollouts if t.task_id == task)
        for task in dict.fromkeys(t.task_id for t in rollouts)]
    shuffled, grouped = (saved_fraction(batch, trainer, order) for order in ("shuffle", "task"))
    assert grouped > shuffled, (shuffled, grouped)
    # Ranks split by whole tasks (a task over the budget by its sub-traces).
    lengths, groups = batch.lengths, mini_batch_units(batch, "task")
    shares = [_grouped_plan(lengths, groups, 1024, World(DistributedConfig(), rank, 2,
                                                        torch.device("cpu")))
              for rank in range(2)]
    for group in groups:
        assert sum(any(set(group) <= set(m) for m in share) for share in shares) == 1
    assert sorted(i for share in shares for m in share for i in m) == list(range(len(lengths)))


def test_config_checks_the_order():
    from agentrl_fast.config import ConfigError, RunConfig, apply_overrides

    with pytest.raises(ConfigError, match="mini_batch_order must be one of shuffle, task"):
        apply_overrides(RunConfig(), ["train.mini_batch_order=tasks"])
    assert RunConfig().train.share_prefixes and RunConfig().train.mini_batch_order == "shuffle"


def test_a_gpu_backend_without_prefix_kernels_trains_on_the_plain_packing(chat):
    """On a GPU, shared prefixes through the generic merge path ran slower than the plain
    packing: the trainer falls back there, and only there."""
    from agentrl_fast.train.models import _training_backend, slow_prefix_reason

    for backend in ("torch", "flash_attn", "reference"):
        assert "slower than the plain packing" in slow_prefix_reason("policy", (backend, "cuda"))
    assert slow_prefix_reason("policy", ("triton", "cuda")) is None  # its own prefix kernels
    for backend in ("native", "cpu_flash", "reference"):  # the CPU's generic path pays
        assert slow_prefix_reason("policy", (backend, "cpu")) is None
    policy = policy_for(chat)
    assert _training_backend(policy) == ("native", "cpu")


# ---------------------------------------------------------------------------------------------
# FSDP2 on 2 ranks (torchrun, gloo) with sharing = one process without.

FSDP_OUT = Path(tempfile.gettempdir()) / f"agentrl-shared-prefixes-{os.getpid()}.pt"
FSDP_STEP = dict(steps=1, tasks_per_step=3, micro_batch_tokens=1024, mini_batch_order="task",
                 critic_lr=1e-3)


def fsdp_command() -> Command:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    return Command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "-m", "test_train_shared_prefixes", str(FSDP_OUT)],
                   cwd=str(ROOT), env=env, timeout=240, nice=5)


def background_command(params: dict) -> Command | None:
    """The 2-rank run starts with the session (tests/background.py)."""
    return fsdp_command() if params.get("launch") == "torchrun" else None


def fsdp_worker(out: str) -> None:
    from agentrl_fast.train.distributed import full_state_dict, init_world, shutdown

    torch.set_num_threads(1)
    world = init_world(DistributedConfig(strategy="fsdp"))
    chat = chat_format()
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(**FSDP_STEP, distributed=world.config), log=quiet,
                      world=world)
    rows = trainer.train()
    state = {name: full_state_dict(getattr(trainer, name), world)
             for name in ("policy", "critic", "reference")}
    if world.is_main:
        torch.save({"rows": rows, **state}, out)
    shutdown()


@pytest.mark.parametrize("launch", ["torchrun"])
def test_fsdp_two_ranks_with_shared_prefixes_equal_one_unshared_process(chat, launch,
                                                                         background_result):
    result = background_result(fsdp_command())
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.load(FSDP_OUT)
    FSDP_OUT.unlink()
    trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(),
                      train_config(**FSDP_STEP, share_prefixes=False), log=quiet)
    [want] = trainer.train()
    [row] = got["rows"]
    assert row["shared_token_fraction"] > 0.1 and "shared_token_fraction" not in want
    for key in ("reward", "tokens", "policy_loss", "value_loss", "kl_ref", "approx_kl",
                "policy_grad_norm", "critic_grad_norm"):
        assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name in ("policy", "critic", "reference"):  # largest difference seen: 1.1e-6
        for key, value in getattr(trainer, name).state_dict().items():
            close(got[name][key], value, atol=1e-5)


if __name__ == "__main__":  # the 2-rank worker
    fsdp_worker(sys.argv[1])
