"""Packing sequences into one row for an HF model, and splitting per-token outputs back.

docs/design.md's packed layout: ``T`` tokens of ``B`` sequences laid end to end, ``cu_seqlens`` int32
``[B+1]`` (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T``, empty sequences
allowed), position ids restarting at 0 in every sequence. No padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pack", "position_ids_from_cu_seqlens", "unpack"]


def _as_sequence(index: int, sequence) -> torch.Tensor:
    if isinstance(sequence, torch.Tensor):
        tensor = sequence
    elif isinstance(sequence, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in sequence):
            bad = next(x for x in sequence if isinstance(x, bool) or not isinstance(x, int))
            raise TypeError(f"sequences[{index}] must hold token ids (ints), got an element of type "
                            f"{type(bad).__name__}; pass a 1-D list of ints or a 1-D integer tensor")
        tensor = torch.tensor(sequence, dtype=torch.long)
    else:
        raise TypeError(f"sequences[{index}] must be a 1-D integer tensor or a list of ints, got "
                        f"{type(sequence).__name__}")
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise TypeError(f"sequences[{index}] must hold integer token ids, got dtype {tensor.dtype}; "
                        "pass token ids (e.g. tensor.long())")
    if tensor.dim() != 1:
        raise ValueError(f"sequences[{index}] must be 1-D (one sequence of token ids), got shape "
                         f"{tuple(tensor.shape)}; pass each sequence separately (e.g. list(batch) for "
                         "a [B, L] tensor without padding)")
    return tensor


def pack(sequences, *, device: torch.device | str | None = None):
    """Lay sequences end to end in one row.

    Args:
        sequences: a list (or tuple) of 1-D integer tensors or lists of ints; empty sequences are
            allowed (they get an empty slot in ``cu_seqlens``), but not all of them empty.
        device: where the outputs go (default: the device of the tensors given, else the CPU).

    Returns:
        ``(input_ids, position_ids, cu_seqlens, max_seqlen)``: ``input_ids [1, T]`` int64,
        ``position_ids [1, T]`` int64 restarting at 0 per sequence, ``cu_seqlens [B+1]`` int32,
        ``max_seqlen`` a Python int — valid by construction, ready for
        :func:`agentrl_fast.models.packed_forward`.
    """
    if isinstance(sequences, torch.Tensor) or not isinstance(sequences, Sequence) or isinstance(
            sequences, (str, bytes)):
        raise TypeError(f"sequences must be a list of 1-D token-id tensors or lists, got "
                        f"{type(sequences).__name__}" + (" (for a [B, L] tensor without padding "
                                                          "pass list(tensor))"
                                                          if isinstance(sequences, torch.Tensor) else ""))
    if len(sequences) == 0:
        raise ValueError("sequences is empty; pass at least one sequence to pack")
    tensors = [_as_sequence(i, s) for i, s in enumerate(sequences)]
    if device is None:
        devices = {s.device for s in sequences if isinstance(s, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"sequences are on several devices {sorted(map(str, devices))}; move them "
                             "to one device or pass device=")
        device = devices.pop() if devices else torch.device("cpu")
    lengths = [t.shape[0] for t in tensors]
    num_tokens = sum(lengths)
    if num_tokens == 0:
        raise ValueError(f"all {len(tensors)} sequences are empty; there is nothing to pack")
    input_ids = torch.cat([t.to(device=device, dtype=torch.long) for t in tensors]).unsqueeze(0)
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device=device,
                                                                               dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).to(device)
    return input_ids, position_ids.unsqueeze(0), cu_seqlens, max(lengths)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position ids ``[T]`` (int64) restarting at 0 in every sequence of ``cu_seqlens`` (valid,
    ``cu_seqlens[-1] == num_tokens``); computed on the device, without a host sync."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=num_tokens)
    return torch.arange(num_tokens, device=cu.device) - starts


def unpack(per_token: torch.Tensor, cu_seqlens) -> list[torch.Tensor]:
    """Split a packed per-token output back into its sequences (the inverse of :func:`pack`).

    Args:
        per_token: ``[1, T, ...]`` (a model's output on the packed row) or ``[T, ...]``. A leading
            dimension of size 1 is taken as the batch dimension when the next one has ``T``
            entries (with ``T == 1``, ``[1, 1, ...]`` is read as ``[1, T, ...]``).
        cu_seqlens: int ``[B+1]`` (tensor or list), as returned by :func:`pack`.

    Returns:
        ``B`` tensors (views of ``per_token``), ``[len_b, ...]`` each; empty sequences give empty
        tensors.
    """
    if not isinstance(per_token, torch.Tensor):
        raise TypeError(f"per_token must be a torch.Tensor, got {type(per_token).__name__}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [B+1], got shape {tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        bounds = list(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be a tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if len(bounds) == 0 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start with 0 (cu_seqlens[0] = 0), got {bounds[:4]}")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}] = {bounds[i]} > "
                         f"cu_seqlens[{i + 1}] = {bounds[i + 1]}")
    num_tokens = bounds[-1]
    if per_token.dim() >= 2 and per_token.shape[0] == 1 and per_token.shape[1] == num_tokens:
        per_token = per_token[0]
    if per_token.dim() == 0 or per_token.shape[0] != num_tokens:
        raise ValueError(f"per_token must be [1, T, ...] or [T, ...] with T = cu_seqlens[-1] = "
                         f"{num_tokens}, got shape {tuple(per_token.shape)}")
    return list(torch.split(per_token, lengths, dim=0))
