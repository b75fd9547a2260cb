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


@torch.library.custom_op("agentrl_fast::validate_cu_seqlens", mutates_args=())
def validate_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int, max_seqlen: int) -> torch.Tensor:
    """Value checks of ``cu_seqlens`` (one host sync on the GPU); returns a copy of it.

    A registered op, so that ``torch.compile`` keeps one graph; callers pass the returned copy on
    to the kernel so the check cannot be dropped as dead code. ``max_seqlen < 0`` skips the
    ``max_seqlen`` check.
    """
    if cu_seqlens.numel() == 0:
        raise ValueError("cu_seqlens must have at least one element (cu_seqlens[0] = 0)")
    cu = cu_seqlens.to(torch.int64)
    if cu.numel() == 1:  # no sequences
        first, last, decreasing_at, longest = int(cu[0]), int(cu[0]), -1, 0
    else:
        lengths = cu[1:] - cu[:-1]
        probes = torch.stack([
            cu[0], cu[-1],
            torch.where((lengths < 0).any(), (lengths < 0).to(torch.uint8).argmax(), -1),
            lengths.max(),
        ]).tolist()
        first, last, decreasing_at, longest = probes
    if first != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {first}")
    if decreasing_at >= 0:
        i = decreasing_at
        raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}] = {int(cu[i])} > "
                         f"cu_seqlens[{i + 1}] = {int(cu[i + 1])}")
    if last != num_tokens:
        raise ValueError(f"cu_seqlens[-1] must equal the number of tokens T = {num_tokens}, got {last}")
    if max_seqlen >= 0 and max_seqlen < longest:
        raise ValueError(f"max_seqlen = {max_seqlen} is smaller than the longest sequence in "
                         f"cu_seqlens ({longest}); pass max_seqlen >= {longest}")
    return cu_seqlens.clone()


@validate_cu_seqlens.register_fake
def _validate_cu_seqlens_fake(cu_seqlens, num_tokens, max_seqlen):
    return torch.empty_like(cu_seqlens)


def check_cu_seqlens_metadata(cu_seqlens: torch.Tensor, device: torch.device) -> None:
    """Metadata checks of ``cu_seqlens`` (no sync): int32, 1-D, non-empty, on ``device``."""
    require_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be torch.int32, got {cu_seqlens.dtype}; "
                        "pass cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be 1-D [B+1] with at least one element (cu_seqlens[0] = 0), "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on {device} like q, got {cu_seqlens.device}")


def check_prefix_of_metadata(prefix_of: torch.Tensor, num_segments: int,
                             device: torch.device) -> None:
    """Metadata checks of ``prefix_of`` (no sync): a 1-D int32 ``[B]`` tensor on ``device``,
    ``B = cu_seqlens.numel() - 1``."""
    require_tensor("prefix_of", prefix_of)
    if prefix_of.dtype != torch.int32:
        raise TypeError(f"prefix_of must be torch.int32, got {prefix_of.dtype}; "
                        "pass prefix_of.to(torch.int32)")
    if prefix_of.dim() != 1 or prefix_of.numel() != num_segments:
        raise ValueError(f"prefix_of must be 1-D [B] with B = cu_seqlens.numel() - 1 = "
                         f"{num_segments} segments, got shape {tuple(prefix_of.shape)}")
    if prefix_of.device != device:
        raise ValueError(f"prefix_of must be on {device} like q, got {prefix_of.device}")


@torch.library.custom_op("agentrl_fast::validate_prefix_of", mutates_args=())
def validate_prefix_of(prefix_of: torch.Tensor) -> torch.Tensor:
    """Value checks of ``prefix_of`` (one host sync on the GPU); returns a copy of it.

    ``prefix_of[b]`` is -1 (segment b stands alone) or an earlier segment ``p < b`` with
    ``prefix_of[p] == -1`` (one level: a prefix is never itself a suffix). A registered op like
    ``validate_cu_seqlens``, for the same reasons.
    """
    num_segments = prefix_of.numel()
    if num_segments == 0:
        return prefix_of.clone()
    parent = prefix_of.to(torch.int64)
    segment = torch.arange(num_segments, device=prefix_of.device)
    out_of_range = (parent < -1) | (parent >= segment)
    linked = (parent >= 0) & ~out_of_range
    grandparent = torch.where(linked, parent[parent.clamp(0, num_segments - 1)], -1)
    nested = linked & (grandparent != -1)

    bad = out_of_range | nested
    first = torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1)
    at = first.clamp(min=0)
    b, p, above = torch.stack([first, parent[at], grandparent[at]]).tolist()  # the one sync
    if b < 0:
        return prefix_of.clone()
    if p < -1 or p >= b:
        allowed = (f"-1 (no prefix) or an earlier segment's index in 0..{b - 1}" if b > 0
                   else "-1 (segment 0 has no earlier segment)")
        raise ValueError(f"prefix_of[{b}] = {p} is out of range: it must be {allowed}")
    raise ValueError(f"prefix_of[{b}] = {p} names segment {p}, which is itself a suffix "
                     f"(prefix_of[{p}] = {above}); a prefix must have prefix_of = -1 (one "
                     f"level of sharing)")


@validate_prefix_of.register_fake
def _validate_prefix_of_fake(prefix_of):
    return torch.empty_like(prefix_of)
