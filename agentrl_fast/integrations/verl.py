"""Our ops inside verl (0.9.1), through verl's own extension points.

- ``register()`` adds ``"agentrl_gae"`` to verl's advantage-estimator registry and
  ``"agentrl_ppo"`` to its policy-loss registry (``algorithm.adv_estimator=agentrl_gae``,
  ``actor.policy_loss.loss_mode=agentrl_ppo``), and registers the ``agentrl_varlen`` attention
  with transformers (``model.override_config.attn_implementation=agentrl_varlen``).
- ``register(override=True)`` also replaces verl's ``"gae"`` and ``"vanilla"`` entries and
  ``core_algos.compute_gae_advantage_return``, which ``ray_trainer.compute_advantage`` calls
  directly for ``"gae"`` (the only estimator verl runs with a critic, and the only one it passes
  values to). Every loaded verl module that imported the function by name is patched too.
- ``patch_logprobs()`` routes the log-probs and entropy of verl's FSDP actor through
  ``token_logprobs`` (its remove-padding path) and, with ``use_fused_kernels`` and
  ``impl_backend=torch``, through ``linear_token_logprobs`` (no ``[T, V]`` logits), as Liger's
  ``apply_liger_kernel_to_*`` functions patch a model family.
- ``unregister()`` restores everything verl had, exactly (the same objects).

In a Ray job the workers are other processes: name :mod:`agentrl_fast.integrations.verl_plugin`
in ``VERL_USE_EXTERNAL_MODULES`` (verl imports it in every process) to apply all of it there.
The padded-to-packed adapters are in :mod:`agentrl_fast.integrations._padded`.
"""

from __future__ import annotations

import sys

import torch

from agentrl_fast.integrations._padded import gae_like_verl, policy_loss_like_verl
from agentrl_fast.integrations._require import require

__all__ = ["ADV_ESTIMATOR", "POLICY_LOSS", "agentrl_gae", "agentrl_ppo",
           "compute_gae_advantage_return", "patch_logprobs", "register", "unregister"]

ADV_ESTIMATOR = "agentrl_gae"
POLICY_LOSS = "agentrl_ppo"
_MISSING = object()
# (owner, key, original): a dict entry or a module attribute that register/patch replaced.
_saved: list[tuple[object, str, object]] = []


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """Drop-in for verl's function of that name (same arguments, ``[B, L]`` tensors; same
    results on every position): our GAE kernel. See ``_padded.gae_like_verl``."""
    return gae_like_verl(token_level_rewards, values, response_mask, gamma, lam)


def agentrl_gae(token_level_rewards, response_mask, values=None, gamma=None, lam=None,
                config=None, **_unused):
    """The ``"agentrl_gae"`` estimator. verl's trainer calls registered estimators with
    ``token_level_rewards``, ``response_mask`` and its ``AlgoConfig`` (``gamma``, ``lam``) but no
    values: without ``values`` the critic's values are taken as 0 (discounted reward-to-go).
    For PPO with a critic use ``register(override=True)`` and ``adv_estimator=gae``."""
    gamma = gamma if gamma is not None else _config_value(config, "gamma", 1.0)
    lam = lam if lam is not None else _config_value(config, "lam", 1.0)
    if values is None:
        values = torch.zeros_like(token_level_rewards)
    return gae_like_verl(token_level_rewards, values, response_mask, gamma, lam)


def agentrl_ppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None):
    """The ``"agentrl_ppo"`` policy loss: verl's ``"vanilla"`` on our ``ppo_loss`` (same
    arguments, loss, gradient and metric keys). See ``_padded.policy_loss_like_verl``."""
    return policy_loss_like_verl(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode=loss_agg_mode, config=config,
                                 rollout_is_weights=rollout_is_weights)


def _config_value(config, name, default):
    value = None if config is None else getattr(config, name, None)
    if value is None and config is not None and hasattr(config, "get"):
        value = config.get(name, None)
    return default if value is None else value


def _replace(owner, key: str, new) -> None:
    """Set ``owner[key]`` (a dict) or ``owner.key`` (a module) to ``new``, remembering what was
    there the first time, for ``unregister``."""
    is_dict = isinstance(owner, dict)
    old = owner.get(key, _MISSING) if is_dict else getattr(owner, key, _MISSING)
    if old is new:
        return
    if not any(o is owner and k == key for o, k, _ in _saved):
        _saved.append((owner, key, old))
    if is_dict:
        owner[key] = new
    else:
        setattr(owner, key, new)


def _modules_holding(original) -> list:
    """Loaded verl modules that hold ``original`` under its name (imported by name)."""
    name = original.__name__
    return [module for module_name, module in list(sys.modules.items())
            if module is not None and (module_name == "verl" or module_name.startswith("verl."))
            and getattr(module, name, None) is original]


def register(override: bool = False) -> None:
    """Add ``"agentrl_gae"`` and ``"agentrl_ppo"`` to verl's registries and register the
    ``agentrl_varlen`` attention; with ``override=True`` also make verl's ``"gae"`` (registry
    entry and ``compute_gae_advantage_return``, wherever loaded verl modules hold it) and
    ``"vanilla"`` run ours. Idempotent; ``unregister()`` undoes it.

    Raises ImportError naming verl when it is not installed.
    """
    if not isinstance(override, bool):
        raise TypeError(f"override must be a bool, got {type(override).__name__}")
    core_algos = require("verl", "verl.trainer.ppo.core_algos")
    from agentrl_fast.models.attention import register_attention

    register_attention()
    _replace(core_algos.ADV_ESTIMATOR_REGISTRY, ADV_ESTIMATOR, agentrl_gae)
    _replace(core_algos.POLICY_LOSS_REGISTRY, POLICY_LOSS, agentrl_ppo)
    if not override:
        return
    _replace(core_algos.ADV_ESTIMATOR_REGISTRY, "gae", compute_gae_advantage_return)
    _replace(core_algos.POLICY_LOSS_REGISTRY, "vanilla", agentrl_ppo)
    original = _original(core_algos, "compute_gae_advantage_return")
    for module in _modules_holding(original):
        _replace(module, "compute_gae_advantage_return", compute_gae_advantage_return)


def _original(module, name: str):
    """verl's own object under ``module.name``, even when ``register`` already replaced it."""
    for owner, key, old in _saved:
        if owner is module and key == name:
            return old
    return getattr(module, name)


def patch_logprobs(fused: bool = True) -> None:
    """Route verl's FSDP actor's log-probs and entropy through our kernels. Call it before the
    engine is built (verl reads the entropy function when it builds the engine).

    - remove-padding path (``use_fused_kernels=False``): ``token_logprobs`` replaces
      ``logprobs_from_logits`` in ``verl.workers.engine.fsdp.transformer_impl`` and
      ``verl.utils.torch_functional.entropy_from_logits``;
    - ``fused=True`` also replaces verl's fused ``torch`` backend for dense text models
      (``dense_common.forward_with_torch_backend``, selected by ``use_fused_kernels=True``
      with ``fused_kernel_options.impl_backend=torch``) with ``linear_token_logprobs`` on the
      LM head's weight.

    ``unregister()`` undoes it. Raises ImportError naming verl when it is not installed.
    """
    from agentrl_fast.integrations import _verl_logprobs as ours

    torch_functional = require("verl", "verl.utils.torch_functional")
    transformer_impl = require("verl", "verl.workers.engine.fsdp.transformer_impl")
    _replace(transformer_impl, "logprobs_from_logits", ours.logprobs_from_logits)
    _replace(torch_functional, "entropy_from_logits", ours.entropy_from_logits)
    if fused:
        dense_common = require("verl", "verl.models.transformers.dense_common")
        _replace(dense_common, "forward_with_torch_backend", ours.forward_with_linear_logprobs)


def unregister() -> None:
    """Restore every registry entry and function that ``register`` / ``patch_logprobs``
    replaced (verl's own objects), and remove our registry names. The attention name stays
    registered with transformers (harmless: nothing selects it unless asked)."""
    while _saved:
        owner, key, old = _saved.pop()
        if isinstance(owner, dict):
            if old is _MISSING:
                owner.pop(key, None)
            else:
                owner[key] = old
        elif old is _MISSING:
            delattr(owner, key)
        else:
            setattr(owner, key, old)
