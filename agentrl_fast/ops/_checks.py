"""Argument checks at the Python boundary, for what the native op's schema cannot express.

Conventions (CONTRIBUTING.md): a bad value raises ValueError, a bad type or dtype TypeError,
and the message names the argument and the fix.
"""

import numbers

import torch


def require_tensor(name: str, value, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def require_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)
