"""A trainer's models: the policy, the critic (a separate model, or a value head on the
policy's backbone), the frozen reference, made data-parallel under torchrun; the whole policy
rollouts run on; and their optimizers with the warmup/decay schedule."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from agentrl_fast.config.train import TrainConfig
from agentrl_fast.models.attention import packed_attention_forward, use_packed_attention
from agentrl_fast.models.critic import ValueHead, make_critic
from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.ops._varlen_attention_prefix import generic_prefix_forward
from agentrl_fast.ops.varlen_attention import BACKENDS, resolve_backend
from agentrl_fast.train.distributed import World


@dataclass
class Models:
    """A trainer's models; None where absent (GRPO has no critic, a shared head replaces it,
    no reference without a KL term)."""

    policy: torch.nn.Module
    critic: torch.nn.Module | None = None
    reference: torch.nn.Module | None = None
    value_head: torch.nn.Module | None = None


def plain_packing_reason(models: Models) -> str | None:
    """Why the models cannot run shared prefixes (``prefix_of``), or None when every one runs
    agentrl_fast's packed attention, as :func:`build_models` sets up (transformers'
    flash-attention implementations read the sequence bounds but would ignore ``prefix_of``)."""
    from transformers import AttentionInterface

    for name in ("policy", "critic", "reference"):
        model = getattr(models, name)
        if model is None:
            continue
        implementation = getattr(unwrap(model).config, "_attn_implementation", None)
        if AttentionInterface._global_mapping.get(implementation) is not packed_attention_forward:
            return (f"train.share_prefixes: the {name} runs attention {implementation!r}, which "
                    "would ignore shared prefixes; training on the plain packing (call "
                    "agentrl_fast.models.use_packed_attention on it to share)")
        reason = slow_prefix_reason(name, _training_backend(unwrap(model)))
        if reason is not None:
            return reason
    return None


def _training_backend(model: torch.nn.Module) -> tuple[str, str]:
    """``(backend, device type)``: what ``varlen_attention``'s ``auto`` picks to train
    ``model``'s attention (its dtype, heads and head dim, a gradient needed)."""
    config = model.config
    parameter = next(model.parameters())
    heads_q = config.num_attention_heads
    heads_k = getattr(config, "num_key_value_heads", None) or heads_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads_q
    q, k = (torch.empty(1, heads, head_dim, dtype=parameter.dtype, device=parameter.device,
                        requires_grad=True) for heads in (heads_q, heads_k))
    return resolve_backend("auto", parameter.device, q, k), parameter.device.type


def slow_prefix_reason(name: str, backend: tuple[str, str]) -> str | None:
    """Why shared prefixes would train slower than the plain packing: on a GPU, a ``backend``
    whose prefix-shared mode is the generic LSE-merge path (two passes and a merge) ran at 0.4x
    the plain packing on an H200 (bench/results/gpu_2026-12-04/). None where it pays."""
    backend_name, device_type = backend
    forward = BACKENDS[backend_name].prefix_forward
    generic = forward is None or getattr(forward, "func", None) is generic_prefix_forward
    if device_type != "cuda" or not generic:
        return None
    return (f"train.share_prefixes: the {name}'s attention trains on backend {backend_name!r}, "
            "whose prefix-shared mode (the generic merge of two passes) is slower than the "
            "plain packing on a GPU; training on the plain packing")


def check_world(config: TrainConfig, world: World | None) -> None:
    """The settings a torchrun job cannot run (they depend on the launch, not the config)."""
    if world is None:
        return
    if config.algo == "ppo" and config.critic == "shared":
        raise ValueError("critic='shared' runs on one process only; use critic='separate' "
                         "under torchrun")
    if config.rollout.memory_scope != "rollout":
        raise ValueError(f"rollout.memory_scope={config.rollout.memory_scope!r} keeps "
                         "memory across rollouts in one process; under torchrun each rank "
                         "has its own, so use memory_scope='rollout'")


def build_models(policy: torch.nn.Module, config: TrainConfig, world: World | None,
                 critic: torch.nn.Module | None = None,
                 reference: torch.nn.Module | None = None) -> tuple[Models, torch.nn.Module]:
    """``(models, rollout_policy)``. The critic defaults to :func:`make_critic` of the policy
    (PPO, ``critic="separate"``), the reference to a frozen copy of the policy when
    ``kl_coef > 0``. Training forwards are packed. Under torchrun rank 0's weights are
    broadcast and the models wrapped (``config.distributed``); rollouts run on a whole,
    unsharded policy: the policy itself, or under FSDP a copy refreshed after each update
    (generation never waits on other ranks)."""
    if world is not None:
        policy.to(world.device)  # this rank's GPU (NCCL), or the CPU (gloo)
    use_packed_attention(policy)
    torch.manual_seed(config.seed)
    models = Models(policy)
    use_ppo = config.algo == "ppo"
    if use_ppo and config.critic == "shared":
        parameter = next(policy.parameters())
        models.value_head = ValueHead(policy.config.hidden_size).to(parameter.device,
                                                                    parameter.dtype)
    elif use_ppo:
        models.critic = use_packed_attention(critic if critic is not None
                                             else make_critic(policy))
    if reference is None and config.kl_coef > 0:
        reference = copy.deepcopy(policy)
    if reference is not None:
        models.reference = use_packed_attention(reference).eval().requires_grad_(False)
    if world is None:
        return models, policy
    return _distributed(models, config, world)


def _distributed(models: Models, config: TrainConfig, world: World
                 ) -> tuple[Models, torch.nn.Module]:
    for model in (models.policy, models.critic, models.reference):
        if model is not None:
            world.broadcast_parameters(model)
    rollout_policy = models.policy
    if config.distributed.strategy == "fsdp":
        rollout_policy = copy.deepcopy(models.policy).eval().requires_grad_(False)
    models.policy = world.wrap(models.policy, trainable=True)
    if models.critic is not None:
        models.critic = world.wrap(models.critic, trainable=True)
    if models.reference is not None:
        models.reference = world.wrap(models.reference, trainable=False)
    return models, rollout_policy


def lr_factor(config: TrainConfig):
    """``step -> factor`` of the learning rate: linear warmup, then constant, linear or
    cosine decay to 0 at ``config.steps``."""
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


def build_optimizers(models: Models, config: TrainConfig) -> tuple:
    """``(policy_optimizer, policy_scheduler, critic_optimizer, critic_scheduler)``: AdamW;
    a shared value head trains in the policy's optimizer at ``critic_lr``; the critic's are
    None without a separate critic."""
    groups = [{"params": list(models.policy.parameters()), "lr": config.policy_lr}]
    if models.value_head is not None:
        groups.append({"params": list(models.value_head.parameters()), "lr": config.critic_lr})
    policy_optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)
    policy_scheduler = torch.optim.lr_scheduler.LambdaLR(policy_optimizer, lr_factor(config))
    if models.critic is None:
        return policy_optimizer, policy_scheduler, None, None
    critic_optimizer = torch.optim.AdamW(models.critic.parameters(), lr=config.critic_lr,
                                         weight_decay=config.weight_decay)
    return (policy_optimizer, policy_scheduler, critic_optimizer,
            torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lr_factor(config)))
