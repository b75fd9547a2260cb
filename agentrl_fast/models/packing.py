"""Packing sequences into one row for an HF model, and splitting per-token outputs back.

docs/design.md's packed layout: ``T`` tokens of ``B`` sequences laid end to end, ``cu_seqlens`` int32
``[B+1]`` (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T``, empty sequences
allowed), position ids restarting at 0 in every sequence. No padding.

The shared-prefix layout (:func:`pack_shared`, :class:`SharedLayout`): sequences that begin with
the same tokens are laid out as one prefix segment followed by each one's suffix segment
(``[P][S1]..[Sn]``), the suffixes' position ids continuing from the prefix; ``prefix_of`` tells
``varlen_attention`` which segment a suffix reads. Maps (``rows``, ``prev_rows``, ``last_rows``)
bring per-row model outputs back to the plain packing of the same sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

__all__ = ["MIN_SHARED_PREFIX", "SharedLayout", "pack", "pack_shared",
           "position_ids_from_cu_seqlens", "unpack"]


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


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int,
                                 prefix_of: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids ``[T]`` (int64) restarting at 0 in every sequence of ``cu_seqlens`` (valid,
    ``cu_seqlens[-1] == num_tokens``); with ``prefix_of [B]`` (valid), a suffix segment's
    continue from its prefix segment's length. Computed on the device, without a host sync."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    starts = cu[:-1]
    if prefix_of is not None:
        parent = prefix_of.to(torch.long)
        starts = starts - torch.where(parent >= 0, lengths[parent.clamp(min=0)], 0)
    starts = torch.repeat_interleave(starts, lengths, output_size=num_tokens)
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


# ---------------------------------------------------------------------------------------------
# The shared-prefix layout.

MIN_SHARED_PREFIX = 8
"""The shortest prefix worth a segment of its own (a shorter one saves less than it costs in
segments and attention launches)."""


@dataclass
class SharedLayout:
    """``B`` sequences (``T`` tokens in their plain packing) laid out with shared prefixes in
    ``Ts <= T`` rows of ``Bs`` segments.

    The model runs on ``input_ids [1, Ts]`` int64, ``position_ids [1, Ts]`` int64 (a suffix's
    continue from its prefix's length), ``cu_seqlens [Bs+1]`` int32 over segments, ``prefix_of
    [Bs]`` int32 (``-1``, or the segment a suffix reads; ``varlen_attention``'s) and
    ``max_seqlen`` (the longest segment). Maps to the plain packing of the same sequences in
    the same order: ``rows [T]`` int64 (the row holding plain token ``t``), ``prev_rows [T]``
    int64 (the row whose output is about token ``t``: its sequence's previous token's row, -1 at
    a sequence's first token) and ``last_rows [B]`` int64 (each sequence's last token's row, -1
    when empty). ``saved_tokens = T - Ts``; ``shares``: some segment is a suffix (else the
    plain attention runs).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    prefix_of: torch.Tensor
    max_seqlen: int
    rows: torch.Tensor
    prev_rows: torch.Tensor
    last_rows: torch.Tensor
    saved_tokens: int
    shares: bool

    @property
    def num_tokens(self) -> int:
        """``T``, the tokens of the plain packing."""
        return self.rows.shape[0]

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(input_ids, position_ids, cu_seqlens, max_seqlen)`` of the shared rows."""
        return self.input_ids, self.position_ids, self.cu_seqlens, self.max_seqlen

    @property
    def attention_prefix_of(self) -> torch.Tensor | None:
        """``prefix_of`` for the attention, None when no segment is a suffix."""
        return self.prefix_of if self.shares else None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SharedLayout:
        """A copy with every tensor on ``device``."""
        return replace(self, **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                                for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _prefix_groups(keys: list[list[int]], min_prefix: int) -> list[tuple[list[int], int]]:
    """``[(members ascending, prefix length)]`` covering every index once; a lone member has
    prefix length 0. Groups are runs of the keys in sorted order (those sharing a prefix lie
    together), chosen by dynamic programming to save the most tokens: a run of ``n`` keys whose
    common prefix has ``L >= min_prefix`` tokens saves ``(n - 1) L``. Deterministic."""
    order = sorted(range(len(keys)), key=lambda b: (keys[b], b))
    common = [_common_prefix(keys[a], keys[b]) for a, b in itertools.pairwise(order)]
    best = [0] * (len(order) + 1)  # best[j]: the most saved over order[:j]
    start = list(range(len(order) + 1))  # start[j]: where the run ending at order[j-1] begins
    for j in range(1, len(order) + 1):
        best[j], start[j] = best[j - 1], j - 1
        run = None
        for i in range(j - 1, 0, -1):  # the run order[i-1 .. j-1]
            run = common[i - 1] if run is None else min(run, common[i - 1])
            if run < min_prefix:
                break
            if best[i - 1] + (j - i) * run > best[j]:
                best[j], start[j] = best[i - 1] + (j - i) * run, i - 1
    groups, j = [], len(order)
    while j > 0:
        members = sorted(order[start[j]:j])
        prefix = min(common[start[j]:j - 1]) if len(members) > 1 else 0
        groups.append((members, prefix))
        j = start[j]
    return sorted(groups, key=lambda g: g[0][0])


def _check_shareable(shareable, lengths: list[int]) -> list[int]:
    if isinstance(shareable, torch.Tensor):
        shareable = shareable.tolist()
    if not isinstance(shareable, Sequence) or len(shareable) != len(lengths):
        raise ValueError(f"shareable must be a list of {len(lengths)} ints, one per sequence, got "
                         f"{shareable!r:.80}")
    out = []
    for b, n in enumerate(shareable):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"shareable[{b}] must be an int >= 0 (how many leading tokens of "
                             f"sequence {b} may be shared), got {n!r}")
        out.append(min(n, lengths[b]))
    return out


def pack_shared(sequences, shareable, *, min_prefix: int = MIN_SHARED_PREFIX,
                device: torch.device | str | None = None) -> SharedLayout:
    """Lay sequences out with shared prefixes: a :class:`SharedLayout`.

    Args:
        sequences: ``B`` token-id lists or 1-D integer tensors (empty ones allowed).
        shareable: ``[B]`` ints, how many leading tokens of each sequence may be shared (for a
            sub-trace, the tokens before its first action token); capped at its length.
        min_prefix: the shortest prefix to share (>= 1).
        device: where the tensors go (default: the CPU).

    Sequences whose shareable tokens begin alike form groups laid out as ``[P][S1]..[Sn]``
    (``P`` their longest common shareable prefix, ``Si`` the rest of member ``i``; an empty
    rest gets no segment); the others stay as they are. Groups and lone sequences come in the
    order of their first sequence; members in their order.
    """
    if isinstance(sequences, torch.Tensor) or not isinstance(sequences, Sequence):
        raise TypeError(f"sequences must be a list of 1-D token-id tensors or lists, got "
                        f"{type(sequences).__name__}")
    if isinstance(min_prefix, bool) or not isinstance(min_prefix, int) or min_prefix < 1:
        raise ValueError(f"min_prefix must be an int >= 1, got {min_prefix!r}")
    tokens = [_as_sequence(b, s).tolist() for b, s in enumerate(sequences)]
    shareable = _check_shareable(shareable, [len(t) for t in tokens])
    keys = [t[:n] for t, n in zip(tokens, shareable)]
    segments: list[list[int]] = []  # token ids
    offsets: list[int] = []  # each segment's first position id
    prefix_of: list[int] = []
    rows: list[list[int]] = [[] for _ in tokens]  # per sequence, its tokens' rows
    num_rows = 0

    def add(segment: list[int], offset: int, parent: int) -> int:
        nonlocal num_rows
        segments.append(segment)
        offsets.append(offset)
        prefix_of.append(parent)
        num_rows += len(segment)
        return num_rows - len(segment)

    for members, prefix in _prefix_groups(keys, min_prefix):
        if prefix == 0:  # a lone sequence, as it is
            b = members[0]
            if tokens[b]:
                first = add(tokens[b], 0, -1)
                rows[b] = list(range(first, first + len(tokens[b])))
            continue
        parent = len(segments)
        first = add(tokens[members[0]][:prefix], 0, -1)
        for b in members:
            rows[b] = list(range(first, first + prefix))
            if len(tokens[b]) > prefix:
                start = add(tokens[b][prefix:], prefix, parent)
                rows[b] += range(start, start + len(tokens[b]) - prefix)
    return _layout(segments, offsets, prefix_of, rows, device)


def _layout(segments: list[list[int]], offsets: list[int], prefix_of: list[int],
            rows: list[list[int]], device) -> SharedLayout:
    if not segments:  # no tokens at all: one empty segment, so the kernels see B >= 1
        segments, offsets, prefix_of = [[]], [0], [-1]
    lengths = [len(s) for s in segments]
    flat = [r for per_sequence in rows for r in per_sequence]
    prev = [r for per_sequence in rows if per_sequence for r in [-1] + per_sequence[:-1]]
    cpu = {"dtype": torch.long}
    layout = SharedLayout(
        input_ids=torch.tensor([t for s in segments for t in s], **cpu).reshape(1, -1),
        position_ids=torch.tensor([o + i for o, n in zip(offsets, lengths) for i in range(n)],
                                  **cpu).reshape(1, -1),
        cu_seqlens=torch.tensor([0] + lengths, **cpu).cumsum(0).to(torch.int32),
        prefix_of=torch.tensor(prefix_of, dtype=torch.int32),
        max_seqlen=max(lengths),
        rows=torch.tensor(flat, **cpu),
        prev_rows=torch.tensor(prev, **cpu),
        last_rows=torch.tensor([r[-1] if r else -1 for r in rows], **cpu),
        saved_tokens=len(flat) - sum(lengths),
        shares=any(p >= 0 for p in prefix_of))
    return layout if device is None else layout.to(device)
