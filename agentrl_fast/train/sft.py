"""Supervised warm-start on expert demonstrations: the expert's rollouts through the real engine
(token in, token out), then the policy's negative log-likelihood of the expert's action tokens,
on the same packed micro-batches as RL."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.environment import Environment, Task
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.harness.rollout import RolloutEngine
from agentrl_fast.harness.trajectory import SubTrace, Trajectory
from agentrl_fast.models.attention import use_packed_attention
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.seeds import derive_seed
from agentrl_fast.train.packing import micro_batches, pack_sub_traces


def demonstrations(policy_text: Callable[[str], str], chat_format: ChatFormat,
                   environment: Environment, tasks: Sequence[Task], config: RolloutConfig,
                   *, seed: int = 0, successful_only: bool = True) -> list[Trajectory]:
    """Rollouts of a scripted text policy (``context -> output``) on ``tasks`` through the
    engine, with ``config``'s budget and compaction (one sample per task); with
    ``successful_only`` the failed ones are dropped."""
    import dataclasses
    engine = RolloutEngine(ScriptedGenerator(policy_text, chat_format), chat_format, environment,
                           dataclasses.replace(config, samples_per_task=1, schedule="lockstep"))
    trajectories = engine.run(tasks, seed=seed)
    return [t for t in trajectories if t.metrics["success"] or not successful_only]


def sft(policy: torch.nn.Module, sub_traces: Sequence[SubTrace], *, steps: int,
        lr: float = 3e-3, batch_sequences: int = 16, micro_batch_tokens: int = 4096,
        weight_decay: float = 0.0, max_grad_norm: float = 1.0, seed: int = 0,
        stop: Callable[[int, list[float]], bool] | None = None,
        log: Callable[[dict], None] | None = None, share_prefixes: bool = True) -> list[float]:
    """Up to ``steps`` AdamW steps of token-mean negative log-likelihood of the action tokens of
    ``sub_traces`` (batches of ``batch_sequences`` sub-traces drawn in a seeded order, packed
    under ``micro_batch_tokens``; linear warm-up over the first tenth, then constant); returns
    the loss of each step run. ``stop(steps_run, losses)``, called after every step, ends the
    warm-start early by returning True (e.g. once the policy solves enough validation tasks).
    ``share_prefixes``: each micro-batch's shared prefixes run once (``train.share_prefixes``;
    exact: the policy is put on packed attention, which reads them)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not sub_traces and steps:
        raise ValueError("sft needs at least one sub-trace with action tokens")
    use_packed_attention(policy)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(steps // 10, 1)))
    losses, order, cursor, epoch = [], [], 0, 0
    for step in range(steps):
        batch = []
        while len(batch) < min(batch_sequences, len(sub_traces)):
            if cursor == len(order):
                order = torch.randperm(len(sub_traces), generator=torch.Generator().manual_seed(
                    derive_seed(seed, "sft", epoch))).tolist()
                cursor, epoch = 0, epoch + 1
            if order[cursor] not in batch:  # an epoch boundary may repeat an index
                batch.append(order[cursor])
            cursor += 1
        tokens = sum(sub_traces[i].num_action_tokens for i in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for group in micro_batches([len(sub_traces[i]) for i in batch], micro_batch_tokens):
            packed = pack_sub_traces(sub_traces, [batch[j] for j in group],
                                     share_prefixes=share_prefixes)
            logp = policy_logprobs(policy, packed.input_ids, packed.position_ids,
                                   packed.cu_seqlens, packed.max_seqlen,
                                   token_mask=packed.action_mask, layout=packed.shared)
            loss = -(logp * packed.action_mask).sum() / max(tokens, 1)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(total)
        if log is not None:
            log({"sft_step": step + 1, "sft_loss": total})
        if stop is not None and stop(step + 1, losses):
            break
    return losses
