"""A trainer's state: what its checkpoints hold (one process: every tensor; a torchrun job:
the models and optimizers as ``torch.distributed.checkpoint`` shards plus rank 0's plain
state), how it resumes, and the exports HF tools load. ``load_policy_weights`` reads a
checkpoint's policy into a model (``agentrl-fast eval``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.train.checkpoint import (latest_checkpoint, rng_state, save_checkpoint,
                                           save_distributed_checkpoint, set_rng_state)
from agentrl_fast.train.distributed import full_state_dict
from agentrl_fast.train.export import export_pretrained


def progress_state(trainer) -> dict[str, Any]:
    """Where the run is: RL steps and critic warm-up steps done, the data position, the KL
    coefficient."""
    return {"step": trainer.step_index, "critic_warmup_step": trainer.critic_warmup_index,
            "data_position": trainer.data_position,
            "consumed_ahead": sorted(trainer.consumed_ahead), "kl_coef": trainer.kl_coef}


def trainer_state(trainer) -> dict[str, Any]:
    state = {"policy": trainer.policy.state_dict(),
             "policy_optimizer": trainer.policy_optimizer.state_dict(),
             "policy_scheduler": trainer.policy_scheduler.state_dict(),
             "trainer": progress_state(trainer),
             "rng": rng_state(),
             "memory": trainer.memory.snapshot()}
    if trainer.value_head is not None:
        state["value_head"] = trainer.value_head.state_dict()
    if trainer.critic is not None:
        state.update(critic=trainer.critic.state_dict(),
                     critic_optimizer=trainer.critic_optimizer.state_dict(),
                     critic_scheduler=trainer.critic_scheduler.state_dict())
    if trainer.reference is not None:
        state["reference"] = trainer.reference.state_dict()
    return state


def sharded_state(trainer) -> dict[str, Any]:
    """Models and optimizers as ``torch.distributed.checkpoint`` state dicts (keyed by
    parameter name; DTensor shards under FSDP) — what a torchrun job's checkpoint holds."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    policy = unwrap(trainer.policy)
    state = {"policy": get_model_state_dict(policy),
             "policy_optimizer": get_optimizer_state_dict(policy, trainer.policy_optimizer)}
    if trainer.critic is not None:
        critic = unwrap(trainer.critic)
        state.update(critic=get_model_state_dict(critic),
                     critic_optimizer=get_optimizer_state_dict(critic, trainer.critic_optimizer))
    if trainer.reference is not None:
        state["reference"] = get_model_state_dict(unwrap(trainer.reference))
    return state


def plain_state(trainer) -> dict[str, Any]:
    """Everything else (rank 0's): schedulers, progress, random streams."""
    state = {"policy_scheduler": trainer.policy_scheduler.state_dict(),
             "trainer": {**progress_state(trainer),
                         "world_size": trainer.world.size if trainer.world is not None else 1},
             "rng": rng_state()}
    if trainer.critic_scheduler is not None:
        state["critic_scheduler"] = trainer.critic_scheduler.state_dict()
    return state


def load_sharded(trainer, folder) -> None:
    """Models and optimizers from a torchrun job's checkpoint folder, resharded to this
    job's ranks (or one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)
    target = sharded_state(trainer)  # this job's layout, filled in place by the load
    dcp.load(target, checkpoint_id=str(folder))
    pairs = [(trainer.policy, "policy", trainer.policy_optimizer)]
    if trainer.critic is not None:
        pairs.append((trainer.critic, "critic", trainer.critic_optimizer))
    for model, name, optimizer in pairs:
        set_model_state_dict(unwrap(model), target[name])
        set_optimizer_state_dict(unwrap(model), optimizer, target[f"{name}_optimizer"])
    if trainer.reference is not None:
        set_model_state_dict(unwrap(trainer.reference), target["reference"])


def load_trainer_state(trainer, state: dict[str, Any]) -> None:
    if "dcp" in state:  # written by a torchrun job
        load_sharded(trainer, state["dcp"])
        trainer.policy_scheduler.load_state_dict(state["policy_scheduler"])
        if trainer.critic_scheduler is not None:
            trainer.critic_scheduler.load_state_dict(state["critic_scheduler"])
        _restore_progress(trainer, state["trainer"])
        set_rng_state(state["rng"])
        trainer.refresh_rollout_policy()
        return
    if trainer.world is not None:
        raise ValueError("this checkpoint was written by one process (no dcp/ folder); a "
                         "torchrun job resumes from its own checkpoints — resume this one "
                         "with one process")
    trainer.policy.load_state_dict(state["policy"])
    trainer.policy_optimizer.load_state_dict(state["policy_optimizer"])
    trainer.policy_scheduler.load_state_dict(state["policy_scheduler"])
    if trainer.value_head is not None:
        trainer.value_head.load_state_dict(state["value_head"])
    if trainer.critic is not None:
        trainer.critic.load_state_dict(state["critic"])
        trainer.critic_optimizer.load_state_dict(state["critic_optimizer"])
        trainer.critic_scheduler.load_state_dict(state["critic_scheduler"])
    if trainer.reference is not None and "reference" in state:
        trainer.reference.load_state_dict(state["reference"])
    _restore_progress(trainer, state["trainer"])
    trainer.memory.restore(state["memory"])
    set_rng_state(state["rng"])
    trainer.engine.generator.update_weights(trainer.rollout_policy)  # an inference server's


def _restore_progress(trainer, progress: dict[str, Any]) -> None:
    trainer.step_index, trainer.data_position = progress["step"], progress["data_position"]
    # Checkpoints from before the warm-up's own count: one past step 0 had its warm-up.
    warmed = trainer.config.critic_warmup_steps if progress["step"] else 0
    trainer.critic_warmup_index = progress.get("critic_warmup_step", warmed)
    trainer.kl_coef = progress["kl_coef"]
    # Asynchronous runs: groups consumed past data_position (absent in older checkpoints).
    trainer.consumed_ahead = set(progress.get("consumed_ahead", ()))


def export_models(trainer, directory: str | Path) -> Path:
    """``save_pretrained`` exports HF tools can load: ``directory/policy`` (with the
    tokenizer) and ``directory/critic`` (a token-classification model with one label), or
    ``directory/value_head.pt`` for a shared-backbone critic."""
    directory = Path(directory)
    if trainer.world is not None:
        return _export_distributed(trainer, directory)
    export_pretrained(trainer.policy, directory / "policy", tokenizer=trainer.chat_format.tokenizer)
    if trainer.critic is not None:
        export_pretrained(trainer.critic, directory / "critic")
    if trainer.value_head is not None:
        torch.save(trainer.value_head.state_dict(), directory / "value_head.pt")
    return directory


def _export_distributed(trainer, directory: Path) -> Path:
    """:func:`export_models` on every rank of a torchrun job; rank 0 writes."""
    critic = None
    if trainer.critic is not None:
        whole = full_state_dict(trainer.critic, trainer.world)  # a collective under FSDP
        if trainer.world.is_main:
            from transformers import AutoModelForTokenClassification
            critic = AutoModelForTokenClassification.from_config(unwrap(trainer.critic).config)
            critic.load_state_dict(whole)
    error = None
    if trainer.world.is_main:
        try:
            export_pretrained(trainer.rollout_policy, directory / "policy",
                              tokenizer=trainer.chat_format.tokenizer)
            if critic is not None:
                export_pretrained(critic, directory / "critic")
        except Exception as failure:
            error = failure
    trainer.world.check(error, "the export")
    return directory


def save_trainer_checkpoint(trainer) -> Path:
    if trainer.world is not None:
        return save_distributed_checkpoint(
            trainer.config.checkpoint_dir, trainer.step_index, trainer.world,
            sharded_state(trainer),
            plain_state(trainer), keep=trainer.config.keep_checkpoints)
    return save_checkpoint(trainer.config.checkpoint_dir, trainer.step_index, trainer.state(),
                           keep=trainer.config.keep_checkpoints)


def resume_checkpoint(trainer, asked: bool) -> None:
    """Load the newest good checkpoint of ``trainer.config.checkpoint_dir`` when ``asked``;
    one there when not asked is an error naming both choices."""
    quiet = trainer.world is not None and not trainer.world.is_main
    directory = trainer.config.checkpoint_dir
    found = latest_checkpoint(directory, log=(lambda message: None) if quiet else trainer.log)
    if found is None:
        return
    path, step, state = found
    if not asked:
        raise ValueError(f"checkpoint_dir {directory} holds a checkpoint (step {step}, {path}): "
                         "pass resume=True (agentrl-fast train --resume) to continue from it, "
                         "or give an empty checkpoint_dir to start over")
    load_trainer_state(trainer, state)
    trainer.log(f"resumed from {path} (step {step})")


def load_policy_weights(policy: torch.nn.Module, state: dict[str, Any]) -> None:
    """The policy's weights of a checkpoint's ``state`` (one process's, or a torchrun job's:
    read from its shards) into ``policy``, a whole model."""
    if "dcp" in state:
        import torch.distributed.checkpoint as dcp
        target = {"policy": policy.state_dict()}
        dcp.load(target, checkpoint_id=str(state["dcp"]))
        policy.load_state_dict(target["policy"])
    else:
        policy.load_state_dict(state["policy"])
