"""The training loop: token-level PPO with a critic on packed sub-traces (GAE bootstrapped
across them), and GRPO as the baseline. Reads top to bottom in :meth:`Trainer.step`:

rollouts -> old log-probs, values, reference log-probs on packed micro-batches
(:mod:`~agentrl_fast.train.scoring`) -> advantages (:mod:`~agentrl_fast.train.advantages`) ->
K epochs x mini-batches of ``ppo_loss`` / ``value_loss`` with ``loss_weights`` of the
mini-batch, gradient clipping, AdamW (:mod:`~agentrl_fast.train.update`) -> warmup/decay -> KL
controller -> metrics. Checkpoints and exports: :mod:`~agentrl_fast.train.state`; the ranks'
collectives: :mod:`~agentrl_fast.train.distributed`.

Determinism on the CPU: episode seeds derive from (seed, task id, sample index) in the rollout
engine, the task order and mini-batch order from ``seed``, micro-batching is a function of the
lengths; nothing reads the clock except the throughput metrics.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from agentrl_fast.config.train import TrainConfig
from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.environment import Environment
from agentrl_fast.harness.generation import TorchGenerator
from agentrl_fast.harness.memory import MemoryStore
from agentrl_fast.harness.rollout import RolloutEngine, rollout_metrics
from agentrl_fast.harness.trajectory import SubTrace, Trajectory
from agentrl_fast.models.attention import use_packed_attention
from agentrl_fast.models.critic import ValueHead, make_critic
from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.seeds import derive_seed
from agentrl_fast.train.advantages import gae_advantages, grpo_advantages, whiten_per_sub_trace
from agentrl_fast.train.distributed import World, full_state_dict, local_plan
from agentrl_fast.train.packing import rollout_index_map
from agentrl_fast.train.scoring import Models, policy_scores, score
from agentrl_fast.train.state import (export_models, load_trainer_state, resume,
                                      save_trainer_checkpoint, trainer_state)
from agentrl_fast.train.update import (UpdateContext, adapted_kl_coef, critic_update,
                                       policy_update)



def _lr_lambda(config: TrainConfig):
    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(config.steps - config.warmup_steps, 1)
        progress = min(max(step - config.warmup_steps, 0) / span, 1.0)
        if config.lr_schedule == "linear":
            return 1.0 - progress
        if config.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0
    return factor


class Trainer:
    """PPO (with a critic) or GRPO for ``policy`` (an HF causal LM) on ``environment``.

    ``critic``: default :func:`~agentrl_fast.models.critic.make_critic` of the policy (PPO,
    ``config.critic == "separate"``); with ``"shared"`` a :class:`ValueHead` on the policy's
    backbone, trained with the policy in one backward (``pg + value_coef * value loss``).
    ``reference``: default a frozen copy of the policy at the start, when ``kl_coef > 0``.
    The policy samples rollouts through :class:`TorchGenerator` and trains on packed batches.

    ``world``: this rank of a ``torchrun`` job (:func:`~agentrl_fast.train.distributed.
    init_world`); the models are then made data-parallel (``config.distributed``) and each step
    is shared by the ranks as :mod:`agentrl_fast.train.distributed` describes. The models given
    must be the same on every rank (rank 0's are broadcast to be sure).
    """

    def __init__(self, policy: torch.nn.Module, chat_format: ChatFormat,
                 environment: Environment, config: TrainConfig,
                 critic: torch.nn.Module | None = None, reference: torch.nn.Module | None = None,
                 memory: MemoryStore | None = None, log=print, world: World | None = None):
        self.config, self.chat_format = config, chat_format
        self.environment, self.log = environment, log
        if config.checkpoint_every and not config.checkpoint_dir:
            # Checked here, not in TrainConfig: a run config leaves the folder to the run.
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self.world = world
        if world is not None:
            policy.to(world.device)  # this rank's GPU (NCCL), or the CPU (gloo)
        self.policy = use_packed_attention(policy)  # training forwards are packed
        torch.manual_seed(config.seed)
        use_ppo = config.algo == "ppo"
        shared = use_ppo and config.critic == "shared"
        if world is not None:
            if shared:
                raise ValueError("critic='shared' runs on one process only; use critic='separate' "
                                 "under torchrun")
            if config.rollout.memory_scope != "rollout":
                raise ValueError(f"rollout.memory_scope={config.rollout.memory_scope!r} keeps "
                                 "memory across rollouts in one process; under torchrun each rank "
                                 "has its own, so use memory_scope='rollout'")
        self.value_head = None
        if shared:
            parameter = next(policy.parameters())
            self.value_head = ValueHead(policy.config.hidden_size).to(parameter.device,
                                                                      parameter.dtype)
        self.critic = None
        if use_ppo and not shared:
            self.critic = critic if critic is not None else make_critic(policy)
        if self.critic is not None:
            use_packed_attention(self.critic)
        self.reference = reference
        if self.reference is None and config.kl_coef > 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        if self.reference is not None:
            use_packed_attention(self.reference).eval().requires_grad_(False)
        # Rollouts run on a whole, unsharded policy: the policy itself, or under FSDP a copy
        # refreshed from the shards after each update (generation never waits on other ranks).
        self.rollout_policy = policy
        if world is not None:
            for model in (policy, self.critic, self.reference):
                if model is not None:
                    world.broadcast_parameters(model)
            if config.distributed.strategy == "fsdp":
                self.rollout_policy = copy.deepcopy(policy).eval().requires_grad_(False)
            self.policy = world.wrap(policy, trainable=True)
            if self.critic is not None:
                self.critic = world.wrap(self.critic, trainable=True)
            if self.reference is not None:
                self.reference = world.wrap(self.reference, trainable=False)
        self.device = next(unwrap(self.policy).parameters()).device
        self.memory = memory if memory is not None else MemoryStore()
        pad_id = chat_format.tokenizer.pad_token_id
        self.engine = RolloutEngine(TorchGenerator(self.rollout_policy,
                                                   pad_id=0 if pad_id is None else pad_id),
                                    chat_format, environment, config.rollout, memory=self.memory)
        self.temperature = config.rollout.sampling.temperature or 1.0
        groups = [{"params": list(self.policy.parameters()), "lr": config.policy_lr}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": config.critic_lr})
        self.policy_optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)
        self.policy_scheduler = torch.optim.lr_scheduler.LambdaLR(self.policy_optimizer,
                                                                  _lr_lambda(config))
        self.critic_optimizer = self.critic_scheduler = None
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=config.critic_lr,
                                                      weight_decay=config.weight_decay)
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer,
                                                                      _lr_lambda(config))
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # see _beside
        self.kl_coef = config.kl_coef
        self.step_index = 0
        self.data_position = 0
        self.tasks = list(environment.tasks("train"))
        if config.tasks_per_step > len(self.tasks):
            raise ValueError(f"tasks_per_step ({config.tasks_per_step}) exceeds the "
                             f"{len(self.tasks)} train tasks of {environment.name!r}")
        if config.checkpoint_dir:
            resume(self)

    # -- data -----------------------------------------------------------------------------------

    def _next_tasks(self):
        """The next ``tasks_per_step`` distinct tasks of a seeded order of the train split (a new
        order each pass; a task already in this step is skipped at a pass boundary)."""
        count, chosen = len(self.tasks), []
        while len(chosen) < self.config.tasks_per_step:
            epoch, offset = divmod(self.data_position, count)
            order = torch.randperm(count, generator=torch.Generator().manual_seed(
                derive_seed(self.config.seed, "tasks", epoch)))
            task = self.tasks[int(order[offset])]
            self.data_position += 1
            if all(task.id != other.id for other in chosen):
                chosen.append(task)
        return chosen

    # -- packed forward passes ------------------------------------------------------------------

    def _local_plan(self, sub_traces, indices) -> list[list[int] | None]:
        """This rank's micro-batches of ``indices`` (:func:`~agentrl_fast.train.distributed.
        local_plan`)."""
        return local_plan([len(s) for s in sub_traces], indices, self.config.micro_batch_tokens,
                          self.world)

    def _context(self) -> UpdateContext:
        return UpdateContext(self.config, self.device, self.temperature, self.kl_coef, self.world,
                             lambda sub_traces, indices: self._local_plan(sub_traces, indices))

    def _score(self, sub_traces, rollout_index):
        """(old, ref, values, last) of the batch (:func:`~agentrl_fast.train.scoring.score`),
        the critic beside the policy."""
        overlap = self.critic is not None and policy_scores(self.models, self.config)
        with self._beside(overlap) as beside:
            return score(self.models, sub_traces, rollout_index,
                         self._local_plan(sub_traces, range(len(sub_traces))), device=self.device,
                         temperature=self.temperature,
                         recompute_logprobs=self.config.recompute_logprobs, world=self.world,
                         beside=beside)

    @property
    def models(self) -> Models:
        return Models(self.policy, self.critic, self.reference, self.value_head)

    # -- one step -------------------------------------------------------------------------------

    def _rollouts(self, round_index: int) -> list[Trajectory]:
        """One batch of rollouts: ``tasks_per_step`` new tasks x ``samples_per_task``, in task
        order (under torchrun each rank runs its share and every rank gets the whole batch)."""
        config = self.config
        tasks = self._next_tasks()
        seed = derive_seed(config.seed, "step", self.step_index, *((round_index,) if round_index
                                                                   else ()))
        if self.world is None:
            return self.engine.run(tasks, seed=seed)
        mine = self.engine.run(self.world.tasks(tasks), seed=seed)
        return self.world.in_task_order(self.world.all_gather(mine), len(tasks),
                                        config.rollout.samples_per_task)

    def _collect(self) -> tuple[list[Trajectory], list[Trajectory], int]:
        """``(all rollouts of the step, those trained on, rounds)``. Without ``filter_groups``
        one round, all trained on; with it, rounds until ``tasks_per_step`` groups whose rewards
        differ are found (or ``max_rollout_rounds``), the first ``tasks_per_step`` kept."""
        config = self.config
        if not config.filter_groups:
            batch = self._rollouts(0)
            return batch, batch, 1
        every, kept = [], []
        for round_index in range(config.max_rollout_rounds):
            batch = self._rollouts(round_index)
            every += batch
            groups: dict[Any, list[Trajectory]] = {}
            for t in batch:
                groups.setdefault(t.task_id, []).append(t)
            kept += [g for g in groups.values() if len({t.reward for t in g}) > 1]
            if len(kept) >= config.tasks_per_step:
                break
        return every, [t for g in kept[:config.tasks_per_step] for t in g], round_index + 1

    def _learn(self, trajectories: list[Trajectory], sub_traces: list[SubTrace]
               ) -> dict[str, float]:
        """Score, advantages, update and KL control on one batch of whole rollouts."""
        config, metrics = self.config, {}
        rollout_index = rollout_index_map(sub_traces)
        old, ref, values, last = self._score(sub_traces, rollout_index)
        if self.world is not None:
            metrics.update(self._rank_tokens(sub_traces))
        if config.recompute_logprobs:
            metrics.update(self._mismatch(sub_traces, old))
        rewards = [torch.tensor(s.rewards) for s in sub_traces]
        if self.reference is not None:
            kl = [torch.where(torch.tensor(s.action_mask, dtype=torch.bool), o - r,
                              torch.zeros(()))  # k1 per action token, 0 elsewhere
                  for s, o, r in zip(sub_traces, old, ref)]
            action_tokens = max(sum(s.num_action_tokens for s in sub_traces), 1)
            metrics["kl_ref"] = float(sum(k.sum() for k in kl)) / action_tokens
            if config.kl_mode == "reward":
                rewards = [r - self.kl_coef * k for r, k in zip(rewards, kl)]
        if config.algo == "ppo":
            gae_kwargs = dict(gamma=config.gamma, rewards=rewards,
                              bootstrap_truncated=config.bootstrap_truncated,
                              restart_at_compaction=config.gae_restart_at_compaction)
            advantages, returns = gae_advantages(sub_traces, values, last, lam=config.lam,
                                                 **gae_kwargs)
            if config.critic_lam is not None and config.critic_lam != config.lam:
                _, returns = gae_advantages(sub_traces, values, last, lam=config.critic_lam,
                                            **gae_kwargs)
            if config.whiten_advantages:
                advantages = whiten_per_sub_trace(advantages, sub_traces)
        else:
            advantages, returns = grpo_advantages(trajectories,
                                                  normalize_std=config.grpo_normalize_std), None
        metrics.update(self._update(sub_traces, rollout_index, old, ref, values, advantages,
                                    returns))
        if self.step_index >= config.critic_warmup_steps:  # the policy moved
            self.kl_coef = adapted_kl_coef(self.kl_coef, metrics.get("kl_ref"),
                                           len(trajectories), config)
        return metrics

    def step(self) -> dict[str, float]:
        config, start = self.config, time.perf_counter()
        self.policy.eval()
        self.rollout_policy.eval()
        every, trajectories, rounds = self._collect()
        rollout_seconds = time.perf_counter() - start
        metrics = dict(rollout_metrics(every))
        if config.filter_groups:
            metrics.update(rollout_rounds=rounds, kept_groups=len(trajectories)
                           // config.rollout.samples_per_task)
        sub_traces = [s for t in trajectories for s in t.sub_traces]
        learned = bool(sub_traces)  # filter_groups may keep no group: nothing to learn from
        if learned:
            metrics.update(self._learn(trajectories, sub_traces))
        policy_lr = self.policy_scheduler.get_last_lr()[0]  # the rate this step used
        # A schedule moves when its optimizer stepped (policy, or the shared head).
        if learned and (self.step_index >= config.critic_warmup_steps
                        or self.value_head is not None):
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

    def refresh_rollout_policy(self) -> None:
        """Under FSDP: copy the updated shards into the whole policy rollouts run on."""
        if self.rollout_policy is not unwrap(self.policy):
            self.rollout_policy.load_state_dict(full_state_dict(self.policy, self.world))

    def _rank_tokens(self, sub_traces) -> dict[str, float]:
        """Tokens per rank in the scoring split (the same split rule as every mini-batch)."""
        lengths = [len(s) for s in sub_traces]
        mine = sum(lengths[i] for i in self.world.share(range(len(sub_traces)), lengths))
        loads = self.world.all_gather(mine)
        return {"rank_tokens_min": float(min(loads)), "rank_tokens_max": float(max(loads)),
                "sub_trace_tokens_max": float(max(lengths, default=0))}

    def _mismatch(self, sub_traces, old) -> dict[str, float]:
        """Rollout vs trainer log-probs on action tokens (measured every step)."""
        diffs = [(torch.tensor(s.logprobs) - o)[torch.tensor(s.action_mask, dtype=torch.bool)]
                 for s, o in zip(sub_traces, old)]
        diff = torch.cat(diffs) if diffs else torch.zeros(0)
        if diff.numel() == 0:
            return {"logprob_mismatch_mean": 0.0, "logprob_mismatch_max": 0.0}
        return {"logprob_mismatch_mean": float(diff.abs().mean()),
                "logprob_mismatch_max": float(diff.abs().max())}

    def _mini_batches(self, num_rollouts: int, epoch: int) -> list[list[int]]:
        order = torch.randperm(num_rollouts, generator=torch.Generator().manual_seed(
            derive_seed(self.config.seed, "minibatch", self.step_index, epoch))).tolist()
        size = math.ceil(num_rollouts / self.config.mini_batches)
        return [order[i:i + size] for i in range(0, num_rollouts, size)]

    def _update(self, sub_traces, rollout_index, old, ref, values, advantages, returns):
        config = self.config
        by_rollout: dict[int, list[int]] = {}
        for i, s in enumerate(sub_traces):
            by_rollout.setdefault(rollout_index[s.rollout_id], []).append(i)
        rollouts = sorted(by_rollout)
        train_policy = self.step_index >= config.critic_warmup_steps
        critic_epochs = config.critic_epochs if config.critic_epochs is not None else config.epochs
        policy_totals: Counter = Counter()
        critic_totals: Counter = Counter()
        policy_updates, critic_updates, ratio_max = 0, 0, None
        for epoch in range(max(config.epochs, critic_epochs if self.critic is not None else 0)):
            for group in self._mini_batches(len(rollouts), epoch):
                indices = sorted(i for r in group for i in by_rollout[rollouts[r]])
                if not any(sub_traces[i].num_action_tokens for i in indices):
                    continue
                run_policy = epoch < config.epochs
                run_critic = self.critic is not None and epoch < critic_epochs
                with self._beside(run_policy and run_critic) as beside:
                    critic_job = beside(critic_update, self.critic, self.critic_optimizer,
                                        self._context(), sub_traces, indices, rollout_index,
                                        values, returns) if run_critic else None
                    policy_metrics = None
                    if run_policy and self.value_head is not None:  # one backward for both
                        policy_metrics = policy_update(
                            self.models, self.policy_optimizer, self._context(), sub_traces,
                            indices, rollout_index, old, ref, advantages, values, returns,
                            train_policy)
                    elif run_policy and train_policy:
                        policy_metrics = policy_update(
                            self.models, self.policy_optimizer, self._context(), sub_traces,
                            indices, rollout_index, old, ref, advantages)
                    critic_metrics = critic_job() if critic_job is not None else None
                policy_updates += run_policy
                if policy_metrics is not None:
                    ratio = policy_metrics.pop("ratio_max")
                    ratio_max = ratio if ratio_max is None else max(ratio_max, ratio)
                    policy_totals.update(policy_metrics)
                if critic_metrics is not None:
                    critic_totals.update(critic_metrics)
                    critic_updates += 1
        out = {key: value / max(policy_updates, 1) for key, value in policy_totals.items()}
        out.update({key: value / max(critic_updates, 1) for key, value in critic_totals.items()})
        if ratio_max is not None:
            out["ratio_max"] = ratio_max
        return out

    @contextlib.contextmanager
    def _beside(self, both: bool):
        """Yields ``submit(fn, *args) -> result()``. With ``both`` (a policy and a critic update
        of the same mini-batch), ``config.overlap_critic``, one process and the models on the
        CPU with 2+ intra-op threads, ``fn`` runs in a worker thread beside the caller, each on
        half the threads (models this small gain little from a second thread per op, and the
        two updates share nothing); otherwise it runs when its result is asked for."""
        threads = torch.get_num_threads()
        if not (both and self.config.overlap_critic and self.world is None and threads >= 2
                and self.device.type == "cpu"):
            yield lambda fn, *args: (lambda: fn(*args))
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="agentrl_fast-critic")

        def run(fn, *args):
            torch.set_num_threads(threads // 2)  # per thread under OpenMP
            return fn(*args)

        jobs = []

        def submit(fn, *args):
            jobs.append(self._worker.submit(run, fn, *args))
            return jobs[-1].result

        torch.set_num_threads(threads - threads // 2)
        try:
            yield submit
        finally:
            concurrent.futures.wait(jobs)  # never leave a job running on a model (on errors too)
            torch.set_num_threads(threads)

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

    def train(self, steps: int | None = None, callback=None) -> list[dict[str, float]]:
        """Run until ``steps`` (default ``config.steps``) steps are done; returns the metrics of
        the steps run now."""
        history = []
        while self.step_index < (steps if steps is not None else self.config.steps):
            metrics = self.step()
            history.append(metrics)
            if callback is not None:
                callback(metrics)
        return history
