"""The training loop: token-level PPO with a critic on packed sub-traces (GAE bootstrapped
across them), and GRPO as the baseline. Reads top to bottom in :meth:`Trainer.step`:

rollouts of the next tasks (:mod:`~agentrl_fast.train.data`) -> old log-probs, values,
reference log-probs on packed micro-batches (:mod:`~agentrl_fast.train.scoring`) -> advantages
(:mod:`~agentrl_fast.train.advantages`) -> K epochs x mini-batches of ``ppo_loss`` /
``value_loss`` with ``loss_weights`` of the mini-batch, gradient clipping, AdamW
(:mod:`~agentrl_fast.train.update`, the critic beside the policy by
:mod:`~agentrl_fast.train.overlap`) -> warmup/decay -> KL controller -> metrics. The models and
optimizers: :mod:`~agentrl_fast.train.models`; checkpoints and exports:
:mod:`~agentrl_fast.train.state`; the ranks' collectives: :mod:`~agentrl_fast.train.distributed`.
Before RL step 1, ``critic_warmup_steps`` steps of the same kind train the critic alone
(:meth:`Trainer.warm_up_critic`).

Determinism on the CPU: episode seeds derive from (seed, task id, sample index) in the rollout
engine, the task order and mini-batch order from ``seed``, micro-batching is a function of the
lengths; nothing reads the clock except the throughput metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from agentrl_fast.config.train import TrainConfig
from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.environment import Environment
from agentrl_fast.generators.base import Generator
from agentrl_fast.generators.torch_generator import TorchGenerator
from agentrl_fast.harness.memory import MemoryStore
from agentrl_fast.harness.rollout import RolloutEngine, rollout_metrics
from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.seeds import derive_seed
from agentrl_fast.train.advantages import ADVANTAGE_ESTIMATORS, reference_kl, step_advantages
from agentrl_fast.train.context import StepContext
from agentrl_fast.train.data import groups_with_signal, next_tasks
from agentrl_fast.train.distributed import World, full_state_dict, rank_token_metrics
from agentrl_fast.train.losses import POLICY_LOSSES
from agentrl_fast.train.models import (Models, build_models, build_optimizers, check_world,
                                       plain_packing_reason)
from agentrl_fast.train.overlap import CriticOverlap
from agentrl_fast.train.producer import (consume, gather_groups, importance_metrics, rank_share,
                                         staleness_metrics, start_producer)
from agentrl_fast.train.scoring import logprob_mismatch, policy_scores, score
from agentrl_fast.train.state import (export_models, load_trainer_state, resume_checkpoint,
                                      save_trainer_checkpoint, trainer_state)
from agentrl_fast.train.step_batch import StepBatch
from agentrl_fast.train.update import Optimizers, adapted_kl_coef, update_epochs


class Trainer:
    """PPO (with a critic) or GRPO for ``policy`` (an HF causal LM) on ``environment``.

    ``critic``: default :func:`~agentrl_fast.models.critic.make_critic` of the policy (PPO,
    ``config.critic == "separate"``); with ``"shared"`` a :class:`ValueHead` on the policy's
    backbone, trained with the policy in one backward (``pg + value_coef * value loss``).
    ``reference``: default a frozen copy of the policy at the start, when ``kl_coef > 0``.
    The policy samples rollouts through :class:`TorchGenerator` and trains on packed batches.

    ``generator``: what rollouts sample with (default a :class:`TorchGenerator` on the policy;
    for example a :class:`~agentrl_fast.generators.vllm_generator.VLLMGenerator`): it gets the
    policy's weights at the start and after every step (``update_weights``). Rollouts it failed
    (``Trajectory.error``) are not trained on and are counted in ``failed_episodes``.

    ``world``: this rank of a ``torchrun`` job (:func:`~agentrl_fast.train.distributed.
    init_world`); the models are then made data-parallel (``config.distributed``) and each step
    is shared by the ranks as :mod:`agentrl_fast.train.distributed` describes. The models given
    must be the same on every rank (rank 0's are broadcast to be sure).

    ``resume``: continue from the newest good checkpoint in ``config.checkpoint_dir`` (none
    there: start fresh). Without it a ``checkpoint_dir`` that holds a checkpoint is an error:
    a script run again would otherwise resume at its last step and train nothing.
    """

    def __init__(self, policy: torch.nn.Module, chat_format: ChatFormat,
                 environment: Environment, config: TrainConfig,
                 critic: torch.nn.Module | None = None, reference: torch.nn.Module | None = None,
                 memory: MemoryStore | None = None, log=print, world: World | None = None,
                 generator: Generator | None = None, resume: bool = False):
        if config.checkpoint_every and not config.checkpoint_dir:
            # Checked here, not in TrainConfig: a run config leaves the folder to the run.
            raise ValueError("checkpoint_every needs checkpoint_dir")
        check_world(config, world)
        ADVANTAGE_ESTIMATORS.get(config.advantage)  # a bad name fails here, naming the field
        POLICY_LOSSES.get(config.policy_loss)
        self.config, self.chat_format, self.environment, self.log = (config, chat_format,
                                                                      environment, log)
        self.world = world  # None: one process
        models, self.rollout_policy = build_models(policy, config, world, critic, reference)
        self.policy, self.critic = models.policy, models.critic
        self.reference, self.value_head = models.reference, models.value_head
        self._plain_logged = False  # the fallback from share_prefixes was logged
        (self.policy_optimizer, self.policy_scheduler, self.critic_optimizer,
         self.critic_scheduler) = build_optimizers(models, config)
        self.device = next(unwrap(self.policy).parameters()).device
        self.overlap = CriticOverlap(config.overlap_critic and world is None
                                     and self.device.type == "cpu")
        self.memory = memory if memory is not None else MemoryStore()
        custom_generator = generator is not None
        if generator is None:
            pad_id = chat_format.tokenizer.pad_token_id
            generator = TorchGenerator(self.rollout_policy, pad_id=0 if pad_id is None else pad_id)
        else:  # an inference server: it samples from the policy as it is now
            if world is not None:
                raise ValueError("generator: a generator of its own runs on one process only; "
                                 "under torchrun each rank samples with its TorchGenerator")
            generator.update_weights(self.rollout_policy)
        self.engine = RolloutEngine(generator, chat_format, environment, config.rollout,
                                    memory=self.memory)
        self.temperature = config.rollout.sampling.temperature or 1.0
        self.kl_coef = config.kl_coef
        self.step_index = 0
        self.critic_warmup_index = 0  # critic warm-up steps done (outside step_index)
        self.data_position = 0
        self.tasks = list(environment.tasks("train"))
        if config.tasks_per_step > len(self.tasks):
            raise ValueError(f"tasks_per_step ({config.tasks_per_step}) exceeds the "
                             f"{len(self.tasks)} train tasks of {environment.name!r}")
        self.consumed_ahead: set[int] = set()  # asynchronous: consumed groups past data_position
        self.producer = None  # asynchronous: started after any resume, on the resumed weights
        if config.checkpoint_dir:
            resume_checkpoint(self, asked=resume)
        if config.max_staleness:
            self.producer = start_producer(self, custom_generator=custom_generator)
            self._last_take = (time.perf_counter(), 0)  # (time, producer tokens) at a take

    @property
    def models(self) -> Models:
        return Models(self.policy, self.critic, self.reference, self.value_head)

    # -- one step: rollouts -> scores -> advantages -> updates -> metrics ----------------------

    def step(self) -> dict[str, float]:
        """One RL step (after the critic's warm-up, run first if not done yet)."""
        self.warm_up_critic()
        start = time.perf_counter()
        self.policy.eval()
        self.rollout_policy.eval()
        every, trajectories, rounds = self._collect()
        return self._step_on(every, trajectories, rounds, start)

    def warm_up_critic(self, callback=None) -> list[dict[str, float]]:
        """The critic's warm-up steps not done yet (``critic_warmup_steps``, none once done):
        each rolls out a fresh batch with the unchanged policy and trains only the critic on
        its value targets; the policy, its optimizer, the schedules, the KL coefficient and
        ``step_index`` stay as they are. Returns their metrics (``step``: the warm-up step,
        1..N), each also passed to ``callback``; checkpointed (at RL step 0) every
        ``checkpoint_every`` warm-up steps and after the last."""
        history, config = [], self.config
        while self.critic_warmup_index < config.critic_warmup_steps:
            metrics = self._warm_up_step()
            history.append(metrics)
            if callback is not None:
                callback(metrics)
            done = self.critic_warmup_index
            if config.checkpoint_every and (done % config.checkpoint_every == 0
                                            or done == config.critic_warmup_steps):
                self.save_checkpoint()
        return history

    def _warm_up_step(self) -> dict[str, float]:
        start = time.perf_counter()
        self.policy.eval()
        self.rollout_policy.eval()
        every, trajectories, _ = self._collect(("critic_warmup", self.critic_warmup_index))
        metrics = dict(rollout_metrics(every))
        if any(t.sub_traces for t in trajectories):
            batch, scoring = self._scored_batch(trajectories)
            metrics.update(scoring)
            optimizers = Optimizers(self.policy_optimizer, self.critic_optimizer)
            metrics.update(update_epochs(self.models, optimizers,
                                         self._context(critic_only=True), batch))
        self.critic_warmup_index += 1
        metrics.update(step=self.critic_warmup_index,
                       seconds=time.perf_counter() - start)
        return metrics

    def train_on(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One step on whole rollouts collected elsewhere (the OpenAI proxy's finished sessions,
        :mod:`agentrl_fast.proxy.service`), as :meth:`step` trains on its own: scores,
        advantages, updates, schedules, the generator's weights refreshed. Rollouts with an
        ``error`` are counted, not trained on."""
        if self.producer is not None:
            raise ValueError("train_on: this trainer samples its own rollouts asynchronously "
                             "(max_staleness > 0); use max_staleness=0 with train_on")
        if self.critic_warmup_index < self.config.critic_warmup_steps:
            raise ValueError("train_on: critic_warmup_steps > 0 pre-trains the critic on the "
                             "trainer's own rollouts; call warm_up_critic() first, or use "
                             "critic_warmup_steps=0")
        start = time.perf_counter()
        self.policy.eval()
        self.rollout_policy.eval()
        every = list(trajectories)
        return self._step_on(every, [t for t in every if t.error is None], 1, start)

    def _step_on(self, every: list[Trajectory], trajectories: list[Trajectory], rounds: int,
                 start: float) -> dict[str, float]:
        """The rest of a step once its rollouts are in (``every``; ``trajectories`` trained on)."""
        config = self.config
        rollout_seconds = time.perf_counter() - start
        metrics = dict(rollout_metrics(every))
        failed = sum(t.error is not None for t in every)
        if failed:  # rollouts the generator failed (a server's timeouts), not trained on
            metrics["failed_episodes"] = failed
        if config.filter_groups:
            metrics.update(rollout_rounds=rounds, kept_groups=len(trajectories)
                           // config.rollout.samples_per_task)
        sub_traces = [s for t in trajectories for s in t.sub_traces]
        learned = bool(sub_traces)  # filter_groups may keep no group: nothing to learn from
        if learned:
            metrics.update(self._learn(trajectories))
        policy_lr = self.policy_scheduler.get_last_lr()[0]  # the rate this step used
        if learned:  # a schedule moves when its optimizer stepped
            self.policy_scheduler.step()
        if learned and self.critic_scheduler is not None:
            self.critic_scheduler.step()
        self.step_index += 1
        metrics.update(step=self.step_index, kl_coef=self.kl_coef,
                       policy_lr=policy_lr,
                       rollout_seconds=rollout_seconds,
                       tokens_per_second=sum(len(s) for s in sub_traces)
                       / max(time.perf_counter() - start, 1e-9))
        self.refresh_rollout_policy()
        if config.checkpoint_every and self.step_index % config.checkpoint_every == 0:
            self.save_checkpoint()
        return metrics

    def _collect(self, stream: tuple | None = None
                 ) -> tuple[list[Trajectory], list[Trajectory], int]:
        """``(all rollouts of the step, those trained on, rounds)``; ``stream`` names the step
        in its rollouts' seeds (default ``("step", step_index)``; a critic warm-up step's its
        own). Without ``filter_groups``
        one round, all trained on; with it, rounds until ``tasks_per_step`` groups whose rewards
        differ are found (or ``max_rollout_rounds``), the first ``tasks_per_step`` kept."""
        config = self.config
        if config.advantage == "grpo" and config.rollout.samples_per_task < 2:
            raise ValueError("rollout.samples_per_task must be >= 2 for GRPO's advantages: a "
                             "group of one rollout has no baseline (its advantage is 0)")
        if self.producer is not None:
            return self._take()
        stream = stream or ("step", self.step_index)
        if not config.filter_groups:
            batch = self._rollouts(stream, 0)
            return batch, [t for t in batch if t.error is None], 1
        every, kept = [], []
        for round_index in range(config.max_rollout_rounds):
            batch = self._rollouts(stream, round_index)
            every += batch
            kept += groups_with_signal([t for t in batch if t.error is None])
            if len(kept) >= config.tasks_per_step:
                break
        return every, [t for g in kept[:config.tasks_per_step] for t in g], round_index + 1

    def _take(self) -> tuple[list[Trajectory], list[Trajectory], int]:
        """Asynchronous: the next ``tasks_per_step`` finished groups from the producer (stale
        ones, and with ``filter_groups`` those whose rewards agree, dropped and counted; under
        torchrun each rank gives its share and every rank gets them all)."""
        config, world = self.config, self.world
        accept = None
        if config.filter_groups:
            accept = lambda g: bool(groups_with_signal(g.trajectories))  # noqa: E731
        count = (config.tasks_per_step if world is None else
                 rank_share(config.tasks_per_step, self.step_index, world.rank, world.size))
        try:
            kept, dropped, waited = self.producer.take(count, config.max_staleness,
                                                       self.step_index, accept)
        except RuntimeError as error:  # the producer failed: every rank raises, none waits
            if world is None:
                raise
            world.check(error, "the rollout producer")
        if world is not None:
            world.check(None, "the rollout producer")
        now, tokens = time.perf_counter(), self.producer.generated_tokens
        (since, before), self._last_take = self._last_take, (now, tokens)
        totals = {"rollout_tokens_per_second": (tokens - before) / max(now - since, 1e-9),
                  "buffer_groups": self.producer.fill(),
                  "restarted_groups": self.producer.restarted_groups}
        if world is not None:  # every rank's groups, in stream order; the ranks' totals
            kept, dropped, waited, totals = gather_groups(world, kept, dropped, waited, totals)
        self.data_position = consume(self.data_position, self.consumed_ahead,
                                     [g.position for g in kept + dropped])
        stale = sum(self.step_index - g.oldest_version() > config.max_staleness
                    for g in dropped)
        self._async_metrics = {**totals,
                               "learner_wait_seconds": waited, "stale_groups_dropped": stale,
                               "filtered_groups_dropped": len(dropped) - stale,
                               # every group consumed so far (each exactly once, resumes included)
                               "groups_consumed": self.data_position + len(self.consumed_ahead),
                               "policy_version": self.step_index}
        every = [t for g in kept + dropped for t in g.trajectories]
        return every, [t for g in kept for t in g.trajectories if t.error is None], 1

    def _rollouts(self, stream: tuple, round_index: int) -> list[Trajectory]:
        """One batch of rollouts: ``tasks_per_step`` new tasks x ``samples_per_task``, in task
        order (under torchrun each rank runs its share and every rank gets the whole batch)."""
        config = self.config
        tasks = self._next_tasks()
        seed = derive_seed(config.seed, *stream, *((round_index,) if round_index else ()))
        if self.world is None:
            return self.engine.run(tasks, seed=seed)
        mine = self.engine.run(self.world.tasks(tasks), seed=seed)
        return self.world.in_task_order(self.world.all_gather(mine), len(tasks),
                                        config.rollout.samples_per_task)

    def _next_tasks(self) -> list:
        tasks, self.data_position = next_tasks(self.tasks, self.data_position,
                                               self.config.tasks_per_step, self.config.seed)
        return tasks

    def _learn(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Score, advantages, update and KL control on one batch of whole rollouts."""
        batch, metrics = self._scored_batch(trajectories)
        optimizers = Optimizers(self.policy_optimizer, self.critic_optimizer)
        metrics.update(update_epochs(self.models, optimizers, self._context(), batch))
        self.kl_coef = adapted_kl_coef(self.kl_coef, metrics.get("kl_ref"), len(trajectories),
                                       self.config)
        return metrics

    def _scored_batch(self, trajectories: list[Trajectory]) -> tuple[StepBatch, dict]:
        """The batch of ``trajectories`` scored, with its advantages and value targets, and
        the metrics of the scoring."""
        config, metrics = self.config, {}
        batch = StepBatch.of(trajectories)
        context = self._context()
        overlap = self.critic is not None and policy_scores(self.models, config)
        with self.overlap.beside(overlap) as beside:
            metrics.update(score(self.models, batch, context, beside))
        if self.world is not None:
            metrics.update(rank_token_metrics(self.world, batch.lengths))
        if config.recomputes:
            metrics.update(logprob_mismatch(batch))
        if self.producer is not None:
            metrics.update(self._async_metrics)
            metrics.update(staleness_metrics(batch, self.step_index, config.max_staleness))
            metrics.update(importance_metrics(batch, config.tis_cap))
        if self.reference is not None:
            kl, metrics["kl_ref"] = reference_kl(batch)
            if config.kl_mode == "reward":
                batch.rewards = batch.rewards - self.kl_coef * kl
        step_advantages(batch, config)
        return batch, metrics

    def _context(self, critic_only: bool = False) -> StepContext:
        return StepContext(self.config, self.device, self.temperature, self.kl_coef,
                           self.step_index, self.world, self.overlap, critic_only,
                           self._shares_prefixes())

    def _shares_prefixes(self) -> bool:
        """``share_prefixes`` where every model reads shared prefixes, checked each step (a
        model's attention may be switched); the first fallback to the plain packing is logged."""
        if not self.config.share_prefixes:
            return False
        reason = plain_packing_reason(self.models)
        if reason is not None and not self._plain_logged:
            self.log(reason)
            self._plain_logged = True
        return reason is None

    def refresh_rollout_policy(self) -> None:
        """The generator samples from the updated policy: under FSDP the shards are first
        copied into the whole policy rollouts run on."""
        if self.rollout_policy is not unwrap(self.policy):
            self.rollout_policy.load_state_dict(full_state_dict(self.policy, self.world))
        if self.producer is not None:  # its next generate call swaps them in
            self.producer.publish(self.rollout_policy, self.step_index)
        else:
            self.engine.generator.update_weights(self.rollout_policy)

    def close(self) -> None:
        """Stop the asynchronous rollout producer (a no-op when synchronous)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    # -- checkpoints (agentrl_fast.train.state) ------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything a one-process checkpoint holds."""
        return trainer_state(self)

    def load_state(self, state: dict[str, Any]) -> None:
        load_trainer_state(self, state)

    def export(self, directory: str | Path) -> Path:
        """``save_pretrained`` exports (:func:`~agentrl_fast.train.state.export_models`)."""
        return export_models(self, directory)

    def save_checkpoint(self) -> Path:
        return save_trainer_checkpoint(self)

    def train(self, steps: int | None = None, callback=None,
              warmup_callback=None) -> list[dict[str, float]]:
        """Run until ``steps`` (default ``config.steps``) RL steps are done, after the critic's
        warm-up (:meth:`warm_up_critic`, its metrics to ``warmup_callback``); returns the
        metrics of the RL steps run now. With a ``checkpoint_dir`` and ``checkpoint_every=0``,
        the state at the end is checkpointed (only then)."""
        history = []
        self.warm_up_critic(warmup_callback)
        while self.step_index < (steps if steps is not None else self.config.steps):
            metrics = self.step()
            history.append(metrics)
            if callback is not None:
                callback(metrics)
        if history and self.config.checkpoint_dir and not self.config.checkpoint_every:
            self.save_checkpoint()
        return history
