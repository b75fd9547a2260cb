"""Fused layers for HF Llama-family models (Qwen3, Qwen2, Llama), Liger-kernel style: the
model's RMSNorm modules and SwiGLU MLPs run :mod:`agentrl_fast.ops.fused_layers` instead of
HF's chains of elementwise ops. Parameters, state dicts and outputs (up to float rounding) stay
the same; on the CPU the training step of a small model gets markedly faster (the norms alone
are about a sixth of it; numbers in docs/experiments.md).

``use_fused_layers(model)`` swaps each such module's class for a subclass whose ``forward``
calls the fused op, so copies (``copy.deepcopy``, a reference model) keep it, and
:func:`~agentrl_fast.models.critic.make_critic` gives a fused policy's critic fused layers too.
"""

from __future__ import annotations

import torch

from agentrl_fast.ops.fused_layers import rms_norm, swiglu

FAMILIES = ("qwen3", "qwen2", "llama")

_SUBCLASSES: dict[type, type] = {}


def _fused_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _fused_class(cls: type, forward) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {
            "forward": forward, "__module__": __name__, "_agentrl_fast_fused": True})
    return _SUBCLASSES[cls]


def _is_norm(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def _is_swiglu_mlp(module: torch.nn.Module, activation: str) -> bool:
    return (activation == "silu" and all(isinstance(getattr(module, name, None), torch.nn.Linear)
                                         for name in ("gate_proj", "up_proj", "down_proj")))


def use_fused_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model``'s RMSNorms and SwiGLU MLPs on the fused ops (in place; returns ``model``).

    Raises ``ValueError`` for a model outside the Llama family (``config.model_type`` not one of
    ``FAMILIES``), whose norms may differ (Gemma's scale by ``1 + weight``)."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"use_fused_layers: model_type {family!r} is not one of "
                         f"{', '.join(FAMILIES)} (Llama-family RMSNorm and SwiGLU)")
    activation = getattr(config, "hidden_act", None)
    for module in model.modules():
        if getattr(type(module), "_agentrl_fast_fused", False):
            continue
        if _is_norm(module):
            module.__class__ = _fused_class(type(module), _fused_norm_forward)
        elif _is_swiglu_mlp(module, activation):
            module.__class__ = _fused_class(type(module), _fused_mlp_forward)
    return model


def uses_fused_layers(model: torch.nn.Module) -> bool:
    """Whether :func:`use_fused_layers` was applied to ``model`` (or a model it was copied
    from)."""
    return any(getattr(type(m), "_agentrl_fast_fused", False) for m in model.modules())
