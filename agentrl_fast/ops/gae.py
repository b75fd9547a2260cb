"""GAE over packed trajectories (docs/design.md, "GAE over packed trajectories").

The kernels are native (``csrc/gae.cpp`` for the CPU, ``csrc/gae.cu`` for CUDA), declared as
``torch.ops.agentrl_fast.gae`` / ``gae_out`` in ``csrc/bindings.cpp``; this module holds the
public functions and the fake (meta) implementations that let ``torch.compile`` trace them.
"""

import torch

from agentrl_fast import _native  # noqa: F401  (registers torch.ops.agentrl_fast.*)
from agentrl_fast.ops._checks import require_real, require_tensor


def _output_dtype(rewards: torch.Tensor, values: torch.Tensor) -> torch.dtype:
    if torch.float64 in (rewards.dtype, values.dtype):
        return torch.float64
    return torch.float32


@torch.library.register_fake("agentrl_fast::gae")
def _gae_fake(rewards, values, cu_seqlens, action_mask=None, bootstrap_values=None, gamma=1.0,
              lam=1.0, validate=True, sequence_lam=None):
    out = rewards.new_empty(rewards.shape, dtype=_output_dtype(rewards, values))
    return out, torch.empty_like(out)


@torch.library.register_fake("agentrl_fast::gae_out")
def _gae_out_fake(rewards, values, cu_seqlens, action_mask, bootstrap_values, gamma, lam,
                  validate, advantages, returns, sequence_lam=None):
    return None


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    action_mask: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE advantages and returns over a packed batch of sequences.

    Args:
        rewards: ``[T]`` float (any of fp32/fp64/fp16/bf16); non-zero only on action tokens.
        values: ``[T]`` float; ``values[t] = V(x_<t)``, the critic's value before token ``t``.
        cu_seqlens: ``[B+1]`` int32, ``0 = cu[0] <= cu[1] <= ... <= cu[B] = T``.
        action_mask: ``[T]`` bool, True on tokens the policy sampled; default all True.
        bootstrap_values: ``[B]`` float, the value after each sequence's last token (0 when
            the episode ended, the critic's value when a limit cut it, ``V`` at the first
            action token of the next sub-trace when compaction continued it); default zeros.
        gamma, lam: discount and GAE lambda, in ``[0, 1]``; ``lam`` may be a ``[B]`` float
            tensor, one lambda per sequence (a length-adaptive lambda, :func:`adaptive_lam`),
            in one call.
        validate: check values (monotonic ``cu_seqlens``, finite inputs, no rewards on
            non-action tokens, a per-sequence ``lam`` in ``[0, 1]``); costs one host sync on
            the GPU.

    Returns:
        ``(advantages, returns)``, each ``[T]``, float32 (float64 when an input is float64),
        zero on non-action tokens. Only action tokens are steps: for action token ``t`` with
        next action token ``n``, ``A_t = r_t + gamma * V_n - V_t + gamma * lam * A_n``; the last
        action token of a sequence uses its bootstrap value and ``A = 0``. ``returns = A + V``.
    """
    require_tensor("rewards", rewards)
    require_tensor("values", values)
    require_tensor("cu_seqlens", cu_seqlens)
    require_tensor("action_mask", action_mask, optional=True)
    require_tensor("bootstrap_values", bootstrap_values, optional=True)
    gamma = require_real("gamma", gamma)
    sequence_lam = None
    if isinstance(lam, torch.Tensor):
        sequence_lam, lam = lam.detach(), 1.0
    lam = require_real("lam", lam)
    # Advantages are targets, never differentiated through.
    return torch.ops.agentrl_fast.gae(
        rewards.detach(), values.detach(), cu_seqlens,
        None if action_mask is None else action_mask.detach(),
        None if bootstrap_values is None else bootstrap_values.detach(),
        gamma, lam, bool(validate), sequence_lam,
    )


def adaptive_lam(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """The length-adaptive lambda of VAPO (and CompactionRL): ``clamp(1 - 1 / (alpha * l), 0,
    1)`` for each rollout's action-token count ``l`` (``lengths [B]``, int or float), float64
    ``[B]``; a rollout with no action token gets 0. Pass it as :func:`gae`'s ``lam``."""
    require_tensor("lengths", lengths)
    alpha = require_real("alpha", alpha)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    scaled = alpha * lengths.to(torch.float64)
    lam = 1.0 - 1.0 / scaled.clamp(min=torch.finfo(torch.float64).tiny)
    return lam.clamp(0.0, 1.0)


def gae_padded(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on padded ``[B, L]`` rows, as verl's ``compute_gae_advantage_return`` computes it.

    ``mask[B, L]`` (bool, or 0/1 int/float as verl passes it) marks the action tokens; each row
    ends with a zero bootstrap. On action tokens the results equal verl's returns and its
    advantages before whitening (``returns - values``); on other tokens they are 0 (verl leaves
    carried-over values there). Runs the packed kernel on the rows laid end to end.

    Returns ``(advantages, returns)``, each ``[B, L]``, float32 (float64 for float64 inputs).
    """
    require_tensor("rewards", rewards)
    require_tensor("values", values)
    require_tensor("mask", mask)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D [B, L], got shape {tuple(rewards.shape)}")
    for name, tensor in (("values", values), ("mask", mask)):
        if tensor.shape != rewards.shape:
            raise ValueError(
                f"{name} must have the shape of rewards {tuple(rewards.shape)}, got {tuple(tensor.shape)}"
            )
    rows, length = rewards.shape
    cu_seqlens = torch.arange(0, rows * length + 1, max(length, 1), dtype=torch.int32,
                              device=rewards.device)[: rows + 1]
    if length == 0:
        cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device=rewards.device)
    action_mask = mask.reshape(-1) if mask.dtype == torch.bool else mask.reshape(-1) != 0
    advantages, returns = gae(
        rewards.reshape(-1), values.reshape(-1), cu_seqlens, action_mask=action_mask,
        gamma=gamma, lam=lam, validate=validate,
    )
    return advantages.view(rows, length), returns.view(rows, length)


def whiten(
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten advantages over the action tokens: ``(A - mean) / sqrt(var + eps)``.

    ``advantages`` and ``action_mask`` (bool) share a shape (``[T]`` packed or ``[B, L]``).
    Mean and unbiased variance are taken over the action tokens (verl's ``masked_whiten``);
    with ``shift_mean=False`` the mean is added back. The result is 0 on non-action tokens;
    with fewer than two action tokens the variance is taken as 0. No host sync.
    """
    require_tensor("advantages", advantages)
    require_tensor("action_mask", action_mask)
    if action_mask.dtype != torch.bool:
        raise TypeError(f"action_mask must be bool, got {action_mask.dtype}; pass action_mask.bool()")
    if advantages.shape != action_mask.shape:
        raise ValueError(
            f"action_mask must have the shape of advantages {tuple(advantages.shape)}, "
            f"got {tuple(action_mask.shape)}"
        )
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be floating point, got {advantages.dtype}")
    compute_dtype = torch.float64 if advantages.dtype == torch.float64 else torch.float32
    zero = torch.zeros((), dtype=compute_dtype, device=advantages.device)
    # where(), not a product with the mask: non-finite values on non-action tokens stay out.
    x = torch.where(action_mask, advantages.to(compute_dtype), zero)
    count = action_mask.sum().to(compute_dtype)
    mean = x.sum() / count.clamp(min=1)
    centered = torch.where(action_mask, x - mean, zero)
    variance = (centered * centered).sum() / (count - 1).clamp(min=1)
    whitened = centered * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = torch.where(action_mask, whitened + mean, zero)
    return whitened.to(advantages.dtype)
