"""Packing sub-traces into token-budget micro-batches (docs/design.md: "The packed layout",
"Training").

Two planning functions work on lengths only (pure Python, deterministic):

- :func:`micro_batches` splits a global batch into micro-batches of at most ``token_budget``
  tokens each, no padding, as few as first-fit-decreasing needs, balanced by tokens;
- :func:`balanced_partition` splits it into exactly ``parts`` groups (data-parallel ranks) whose
  token counts differ by at most the longest sequence's length.

:func:`pack_sub_traces` then lays the chosen sub-traces end to end as a :class:`PackedBatch`
(``input_ids [1, T]``, position ids restarting per sequence, ``cu_seqlens``, per-token action
mask, sampling log-probs and rewards, a dense rollout index per sequence), ready for
:func:`agentrl_fast.models.packed_forward` and the packed ops.

Typical use::

    index = rollout_index_map(sub_traces)                    # one numbering for the global batch
    plan = micro_batches([len(s) for s in sub_traces], token_budget=16384)
    for chosen in plan:
        batch = pack_sub_traces(sub_traces, chosen, index).to("cuda")
        ...
        advantages = batch.gather(advantages_per_sub_trace)  # [T], this batch's order
        per_sequence = batch.split(logprobs)                 # B tensors, ``batch.indices`` order
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from agentrl_fast.harness.trajectory import END_KINDS, SubTrace
from agentrl_fast.models.packing import SharedLayout, pack, pack_shared, unpack

__all__ = ["PackedBatch", "balanced_partition", "micro_batches", "pack_sub_traces",
           "rollout_index_map", "shared_layout"]


# ---------------------------------------------------------------------------------------------
# Argument checks.


def _as_int(value, name: str) -> int:
    """``value`` as a Python int (ints and integer scalars such as numpy's; not bool, not float)."""
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return operator.index(value)


def _check_lengths(lengths) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        dtype = lengths.dtype
        if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
            raise TypeError(f"lengths must hold integers, got a tensor of dtype {lengths.dtype}")
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-D (one length per sequence), got shape "
                             f"{tuple(lengths.shape)}")
        lengths = lengths.tolist()
    elif not isinstance(lengths, Sequence) or isinstance(lengths, (str, bytes)):
        raise TypeError(f"lengths must be a sequence of ints (one per sequence), got "
                        f"{type(lengths).__name__}; pass e.g. [len(s) for s in sub_traces]")
    out = []
    for i, n in enumerate(lengths):
        n = _as_int(n, f"lengths[{i}]")
        if n < 0:
            raise ValueError(f"lengths[{i}] = {n}: a sequence length must be >= 0")
        out.append(n)
    return out


def _check_positive(value, name: str) -> int:
    value = _as_int(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Bin packing and balancing (lengths only).


def _decreasing(lengths: list[int]) -> list[int]:
    """Indices by length, longest first; ties by index."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: each sequence, longest first, goes into the first bin with room.
    Uses at most ``11/9 OPT + 6/9`` bins; every bin is opened by a nonzero sequence, so no bin
    is empty (zero-length sequences fit in bin 0). ``O(N log N)``: a max-tree over the bins'
    free room finds the first bin that fits in ``O(log N)`` (unopened bins have all the room, and
    lie to the right of the opened ones)."""
    size = 1
    while size < len(lengths):
        size *= 2
    free = [budget] * (2 * size)  # free[node] = the most room in any bin below node
    bins: list[list[int]] = []
    for i in _decreasing(lengths):
        n = lengths[i]
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= n else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[node] -= n
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def _longest_processing_time(lengths: list[int], parts: int) -> list[list[int]]:
    """LPT greedy: each sequence, longest first, goes into the least-loaded bin (ties: the lowest
    bin). Greedy into the least-loaded bin guarantees ``max load - min load <= max length``:
    the last sequence ``x`` put into the finally heaviest bin went into the then least-loaded
    bin, so ``max - x <= min``. Makespan at most ``(4/3 - 1/(3 parts))`` of the optimum."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, b) for b in range(parts)]  # (load, bin): heapq keeps ties by the lower bin
    for i in _decreasing(lengths):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def _loads(lengths: list[int], bins: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in b) for b in bins]


_PARTNERS = 4  # how many of the lightest bins the heaviest one trades with per step


def _refine(lengths: list[int], bins: list[list[int]], max_steps: int) -> list[list[int]]:
    """Local search on a partition: repeatedly move one sequence out of the heaviest bin ``h``
    into one of the few lightest bins ``o``, or swap one of ``h``'s sequences for a shorter one
    of ``o``, shifting ``d`` tokens with ``0 < d < load[h] - load[o]`` (the best such move: ``d``
    closest to half the gap), until no such move exists or after ``max_steps`` moves.

    Every step leaves both bins' loads strictly between the old ``load[o]`` and ``load[h]``, so
    the maximum load never rises, the minimum never falls (capacity and ``max - min`` bounds
    are kept), and the sum of squared loads strictly falls. Deterministic (among equally good
    moves the first found wins: lighter partner first, then ``h``'s shorter sequences first).
    """
    k = len(bins)
    if k < 2:
        return bins
    loads = _loads(lengths, bins)
    # per bin, its sequences as sorted (length, index) pairs, and their lengths alone
    members = [sorted((lengths[i], i) for i in b) for b in bins]
    member_lengths = [[n for n, _ in m] for m in members]
    for _ in range(max_steps):
        h = min(range(k), key=lambda b: (-loads[b], b))
        partners = heapq.nsmallest(_PARTNERS, range(k), key=lambda b: (loads[b], b))
        best = None  # (new max of the pair, o, a, b or None)
        for o in partners:
            gap = loads[h] - loads[o]
            if o == h or gap < 2:  # d must be an int strictly inside (0, gap)
                continue
            others, other_lengths = members[o], member_lengths[o]
            for la, a in members[h]:
                if la == 0:
                    continue
                if la < gap:  # move a into o (d = la)
                    score = max(loads[h] - la, loads[o] + la)
                    if best is None or score < best[0]:
                        best = (score, o, a, None)
                # swap a for b of o: d = la - lb in (0, gap) <=> la - gap < lb < la; the best lb
                # is the one closest to la - gap / 2: one of its two neighbours in sorted order
                j = bisect.bisect_left(other_lengths, la - gap / 2)
                for jj in (j - 1, j):
                    if 0 <= jj < len(others):
                        lb, b = others[jj]
                        if 0 < lb and la - gap < lb < la:
                            score = max(loads[h] - la + lb, loads[o] + la - lb)
                            if best is None or score < best[0]:
                                best = (score, o, a, b)
        if best is None:
            break
        _, o, a, b = best
        for src, dst, i in ((h, o, a), (o, h, b)):
            if i is None:
                continue
            j = members[src].index((lengths[i], i))
            del members[src][j], member_lengths[src][j]
            j = bisect.bisect_left(members[dst], (lengths[i], i))
            members[dst].insert(j, (lengths[i], i))
            member_lengths[dst].insert(j, lengths[i])
            loads[src] -= lengths[i]
            loads[dst] += lengths[i]
    return [[i for _, i in m] for m in members]


def _spread(loads: list[int]) -> tuple[int, int]:
    """How balanced a partition is, smaller is better: (max load, max - min)."""
    return (max(loads), max(loads) - min(loads)) if loads else (0, 0)


def _ordered(bins: list[list[int]]) -> list[list[int]]:
    """Each group's indices ascending; groups by their smallest index, empty groups last."""
    bins = [sorted(b) for b in bins]
    return sorted(bins, key=lambda b: (not b, b[0] if b else 0))


def micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Split sequences into micro-batches of at most ``token_budget`` tokens each, no padding.

    The number of micro-batches ``k`` is first-fit decreasing's (FFD: at most
    ``11/9 OPT + 6/9``, OPT the fewest possible). Tokens are then balanced across the ``k`` micro-batches: LPT
    (longest first into the least-loaded micro-batch) replaces FFD's assignment when it fits the
    budget and is at least as balanced, and a local search (moves and swaps out of the heaviest
    micro-batch, see :func:`_refine`) evens it further without ever raising the largest load.
    So the result never has more micro-batches, nor a larger largest micro-batch, than FFD.

    Args:
        lengths: ``[N]`` token counts (ints >= 0, a list, tuple or 1-D integer tensor), e.g.
            ``[len(s) for s in sub_traces]``. Zero-length sequences are allowed (they go
            somewhere; they cost nothing).
        token_budget: the most tokens one micro-batch may hold (int > 0).

    Returns:
        ``k`` lists of indices into ``lengths``; each list ascending, lists ordered by their
        smallest index, every index in exactly one list, no list empty. ``[]`` for ``N == 0``.
        Deterministic: the same input gives the same output (ties broken by index).

    Raises:
        ValueError: a length is negative, ``token_budget <= 0``, or a sequence is longer than
            ``token_budget``.
        TypeError: ``lengths`` is not a sequence of ints, or ``token_budget`` is not an int.
    """
    lengths = _check_lengths(lengths)
    token_budget = _check_positive(token_budget, "token_budget")
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"sequence {i} has {n} tokens, more than token_budget={token_budget}; "
                             "raise token_budget to at least the context budget")
    if not lengths:
        return []
    ffd = _first_fit_decreasing(lengths, token_budget)
    best = ffd
    if len(ffd) > 1:
        lpt = _longest_processing_time(lengths, len(ffd))
        lpt_loads = _loads(lengths, lpt)
        if max(lpt_loads) <= token_budget and _spread(lpt_loads) <= _spread(_loads(lengths, ffd)):
            best = lpt
        best = _refine(lengths, best, max_steps=len(lengths))
    return _ordered(best)


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split sequences into exactly ``parts`` groups with token sums as equal as possible (one
    group per data-parallel rank).

    LPT greedy (longest first into the least-loaded group, ties by the lower group) then the
    local search of :func:`micro_batches`, which never widens the spread. Guarantee: the
    largest and smallest group's token counts differ by at most ``max(lengths)`` (``0`` for
    no sequences) — per-rank token counts differ by at most one sequence's length.

    Args:
        lengths: ``[N]`` token counts (ints >= 0; list, tuple or 1-D integer tensor).
        parts: the number of groups (int > 0); with ``parts > N`` some groups are empty.

    Returns:
        ``parts`` lists of indices into ``lengths``: each ascending, non-empty lists ordered by
        their smallest index, empty lists last; every index in exactly one list.
        Deterministic (ties broken by index).

    Raises:
        ValueError: a length is negative or ``parts <= 0``.
        TypeError: ``lengths`` is not a sequence of ints, or ``parts`` is not an int.
    """
    lengths = _check_lengths(lengths)
    parts = _check_positive(parts, "parts")
    groups = _longest_processing_time(lengths, parts)
    groups = _refine(lengths, groups, max_steps=len(lengths))
    return _ordered(groups)


# ---------------------------------------------------------------------------------------------
# Packed batches.


@dataclass
class PackedBatch:
    """``B`` sub-traces laid end to end in ``T`` tokens (docs/design.md's packed layout, no padding).

    Fields (all tensors on one device):

    - ``input_ids``: ``[1, T]`` int64, the token ids;
    - ``position_ids``: ``[1, T]`` int64, restarting at 0 in every sequence;
    - ``cu_seqlens``: ``[B+1]`` int32 (``0``, then cumulative lengths; empty sequences allowed);
    - ``max_seqlen``: int, the longest sequence (0 when there are no tokens);
    - ``action_mask``: ``[T]`` bool, True exactly on tokens the policy sampled;
    - ``rollout_logprobs``: ``[T]`` float32, the sampling log-probs (0 on context tokens);
    - ``rewards``: ``[T]`` float32, per-token rewards;
    - ``rollout_index``: ``[B]`` int64, a dense rollout number per sequence (sub-traces of one
      rollout share it; numbered by first appearance in the global batch, see
      :func:`rollout_index_map`);
    - ``indices``: which sub-traces of the global list were packed, in packed order;
    - ``ends``: each sequence's ``SubTrace.end`` (``"terminal"``, ``"truncated"`` or
      ``"continued"``);
    - ``lengths``: each sequence's token count (a host-side copy of ``cu_seqlens.diff()``, so
      :meth:`split` and :meth:`gather` need no device sync; derived when not given);
    - ``shared``: None, or the same sequences with shared prefixes (a
      :class:`~agentrl_fast.models.packing.SharedLayout`, ``pack_sub_traces(share_prefixes=True)``)
      for the models' forwards; every other field stays in the plain packing's coordinates.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    rollout_index: torch.Tensor
    indices: list[int]
    ends: list[str]
    lengths: list[int] | None = field(default=None)
    shared: SharedLayout | None = field(default=None)

    def __post_init__(self):
        if self.lengths is None:
            self.lengths = self.cu_seqlens.diff().tolist()

    @property
    def num_tokens(self) -> int:
        """``T``, the number of tokens."""
        return self.input_ids.shape[-1]

    @property
    def num_sequences(self) -> int:
        """``B``, the number of packed sub-traces."""
        return len(self.indices)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor (and the shared layout) on ``device`` (lists copied,
        ``max_seqlen`` kept)."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                 for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), (torch.Tensor, SharedLayout))}
        return dataclasses.replace(self, **moved, indices=list(self.indices), ends=list(self.ends),
                                   lengths=list(self.lengths))

    def gather(self, per_sequence: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]
               ) -> torch.Tensor:
        """Concatenate per-sub-trace tensors in this batch's order: ``per_sequence[i]`` for ``i``
        in :attr:`indices`.

        Args:
            per_sequence: indexed by the *global* sub-trace index (the list given to
                :func:`pack_sub_traces`, or a mapping from those indices): tensors
                ``[len(sub_traces[i]), ...]`` (advantages, returns, weights), all with the same
                trailing shape, dtype and device.

        Returns:
            ``[T, ...]`` on the tensors' device, aligned with this batch's tokens.
        """
        if (isinstance(per_sequence, torch.Tensor)
                or not isinstance(per_sequence, (Sequence, Mapping))):
            raise TypeError(f"per_sequence must be a list (or mapping) of per-sub-trace tensors "
                            f"indexed by global sub-trace index, got {type(per_sequence).__name__}")
        if not self.indices:
            return torch.empty(0, device=self.input_ids.device)
        parts = []
        for i, n in zip(self.indices, self.lengths):
            try:
                tensor = per_sequence[i]
            except (IndexError, KeyError):
                more = "..." if len(self.indices) > 8 else ""
                raise ValueError(f"per_sequence has no entry for sub-trace {i} (this batch packs "
                                 f"sub-traces {self.indices[:8]}{more}); pass one tensor per "
                                 "sub-trace of the global list") from None
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"per_sequence[{i}] must be a torch.Tensor, got "
                                f"{type(tensor).__name__}")
            if tensor.dim() == 0 or tensor.shape[0] != n:
                raise ValueError(f"per_sequence[{i}] has shape {tuple(tensor.shape)} but "
                                 f"sub-trace {i} has {n} tokens; pass a [{n}, ...] tensor")
            parts.append(tensor)
        return torch.cat(parts)

    def split(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor of this batch (``[T, ...]``, or ``[1, T, ...]`` as a model
        returns it) into ``B`` per-sub-trace views ``[len_b, ...]``, in :attr:`indices` order;
        empty sub-traces give empty tensors. No device sync."""
        if not isinstance(per_token, torch.Tensor):
            raise TypeError(f"per_token must be a torch.Tensor, got {type(per_token).__name__}")
        bounds = [0, *itertools.accumulate(self.lengths)]
        return unpack(per_token, bounds)


def _check_sequence(sub_traces) -> None:
    if not isinstance(sub_traces, Sequence) or isinstance(sub_traces, (str, bytes)):
        raise TypeError(f"sub_traces must be a sequence of SubTrace, got "
                        f"{type(sub_traces).__name__}")


def rollout_index_map(sub_traces: Sequence[SubTrace]) -> dict[str, int]:
    """``{rollout_id: 0, 1, 2, ...}`` numbered by first appearance in ``sub_traces`` (build it
    once over the global batch and pass it to every :func:`pack_sub_traces` call)."""
    _check_sequence(sub_traces)
    index: dict[str, int] = {}
    for i, sub_trace in enumerate(sub_traces):
        if not isinstance(sub_trace, SubTrace):
            raise TypeError(f"sub_traces[{i}] must be a SubTrace, got {type(sub_trace).__name__}")
        index.setdefault(sub_trace.rollout_id, len(index))
    return index


def _check_indices(indices, count: int) -> list[int]:
    if isinstance(indices, torch.Tensor):
        indices = indices.tolist()
    if not isinstance(indices, Sequence) or isinstance(indices, (str, bytes)):
        raise TypeError(f"indices must be a sequence of ints, got {type(indices).__name__}")
    out, seen = [], set()
    for j, i in enumerate(indices):
        i = _as_int(i, f"indices[{j}]")
        if not 0 <= i < count:
            raise ValueError(f"indices[{j}] = {i} is out of range for {count} sub-traces; pass "
                             f"indices in [0, {count})")
        if i in seen:
            raise ValueError(f"indices[{j}] = {i} appears twice; pack each sub-trace once")
        seen.add(i)
        out.append(i)
    return out


def _shareable(sub_trace: SubTrace) -> int:
    """The tokens before the first action token: a span holding action tokens is never shared
    (its log-probs and values are the loss's)."""
    return next((i for i, action in enumerate(sub_trace.action_mask) if action),
                len(sub_trace.ids))


def shared_layout(sub_traces: Sequence[SubTrace]) -> SharedLayout:
    """``sub_traces`` (in this order) laid out with shared prefixes: the tokens before each
    one's first action token may be shared (:func:`~agentrl_fast.models.packing.pack_shared`);
    its maps lead to their plain packing (:func:`pack_sub_traces` of the same order)."""
    return pack_shared([s.ids for s in sub_traces], [_shareable(s) for s in sub_traces])


def pack_sub_traces(sub_traces: Sequence[SubTrace], indices: Sequence[int] | None = None,
                    rollout_index: Mapping[str, int] | None = None, *,
                    share_prefixes: bool = False) -> PackedBatch:
    """Lay the chosen sub-traces end to end (on the CPU; move with :meth:`PackedBatch.to`).

    Args:
        sub_traces: the global batch's sub-traces; each must be closed (``end`` set).
        indices: which of them to pack, in this order (default: all, in order); no repeats. An
            empty list gives an empty batch (``T == 0``, ``B == 0``).
        rollout_index: ``rollout_id -> int`` for :attr:`PackedBatch.rollout_index` (default:
            :func:`rollout_index_map` over the whole ``sub_traces``, so micro-batches of one
            global list agree; pass the global map when ``sub_traces`` is itself a slice).
        share_prefixes: also lay the sub-traces out with shared prefixes
            (:attr:`PackedBatch.shared`; the tokens before each one's first action token may be
            shared), so the models run each shared prefix once.

    Returns:
        A :class:`PackedBatch`. Empty sub-traces (0 tokens) get an empty slot in
        ``cu_seqlens``; when every chosen sub-trace is empty, ``T == 0``.
    """
    _check_sequence(sub_traces)
    if indices is None:
        indices = list(range(len(sub_traces)))
    else:
        indices = _check_indices(indices, len(sub_traces))
    if rollout_index is None:
        rollout_index = rollout_index_map(sub_traces)
    elif not isinstance(rollout_index, Mapping):
        raise TypeError(f"rollout_index must be a mapping rollout_id -> int, got "
                        f"{type(rollout_index).__name__}; build it with "
                        "rollout_index_map(sub_traces)")

    chosen: list[SubTrace] = []
    numbers: list[int] = []
    for i in indices:
        sub_trace = sub_traces[i]
        if not isinstance(sub_trace, SubTrace):
            raise TypeError(f"sub_traces[{i}] must be a SubTrace, got {type(sub_trace).__name__}")
        n = len(sub_trace.ids)
        for name in ("action_mask", "logprobs", "rewards"):
            if len(getattr(sub_trace, name)) != n:
                raise ValueError(f"sub_traces[{i}].{name} has {len(getattr(sub_trace, name))} "
                                 f"entries but its ids have {n}; build sub-traces with "
                                 "append_context / append_action")
        if sub_trace.end not in END_KINDS:
            raise ValueError(f"sub_traces[{i}] (rollout {sub_trace.rollout_id!r} "
                             f"#{sub_trace.index}) is not closed (end = {sub_trace.end!r}); "
                             f"close it with SubTrace.close({'/'.join(END_KINDS)}) before "
                             "training on it")
        if sub_trace.rollout_id not in rollout_index:
            raise ValueError(f"rollout_index has no entry for rollout_id "
                             f"{sub_trace.rollout_id!r} (sub_traces[{i}]); build it with "
                             "rollout_index_map over the global batch")
        numbers.append(_as_int(rollout_index[sub_trace.rollout_id],
                               f"rollout_index[{sub_trace.rollout_id!r}]"))
        chosen.append(sub_trace)

    lengths = [len(s.ids) for s in chosen]
    num_tokens = sum(lengths)
    if num_tokens > 0:
        input_ids, position_ids, cu_seqlens, max_seqlen = pack([s.ids for s in chosen])
    else:  # pack() rejects a batch with no tokens; an all-empty (or empty) batch is still valid
        input_ids = torch.zeros(1, 0, dtype=torch.int64)
        position_ids = torch.zeros(1, 0, dtype=torch.int64)
        cu_seqlens = torch.zeros(len(chosen) + 1, dtype=torch.int32)
        max_seqlen = 0

    def flat(name):
        return list(itertools.chain.from_iterable(getattr(s, name) for s in chosen))

    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        action_mask=torch.tensor(flat("action_mask"), dtype=torch.bool).reshape(num_tokens),
        rollout_logprobs=torch.tensor(flat("logprobs"), dtype=torch.float32).reshape(num_tokens),
        rewards=torch.tensor(flat("rewards"), dtype=torch.float32).reshape(num_tokens),
        rollout_index=torch.tensor(numbers, dtype=torch.int64).reshape(len(chosen)),
        indices=indices,
        ends=[s.end for s in chosen],
        lengths=lengths,
        shared=shared_layout(chosen) if share_prefixes else None,
    )
