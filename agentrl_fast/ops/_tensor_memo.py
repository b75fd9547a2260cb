"""Facts about a tensor (a validated ``cu_seqlens``, ``cu_seqlens`` derived from position ids,
the attention kernels' tile tables of a ``cu_seqlens``), kept while the tensor lives and is not
modified in place: the layers of one forward pass share them."""

from __future__ import annotations

import weakref

import torch


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors (torch.inference_mode) track no version
        return -1


class TensorMemo:
    """``get(tensor, fact)`` / ``put(tensor, fact, value)``, keyed by the tensor's identity and
    version (an in-place change forgets its facts; a freed tensor's entry goes with it)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, int, dict]] = {}

    def _facts(self, tensor: torch.Tensor, create: bool) -> dict | None:
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is tensor and entry[1] == _version(tensor):
            return entry[2]
        if not create:
            return None
        entries = self._entries
        ref = weakref.ref(tensor, lambda _, key=key: entries.pop(key, None))
        facts: dict = {}
        entries[key] = (ref, _version(tensor), facts)
        return facts

    def get(self, tensor: torch.Tensor, fact):
        facts = self._facts(tensor, create=False)
        return None if facts is None else facts.get(fact)

    def put(self, tensor: torch.Tensor, fact, value) -> None:
        self._facts(tensor, create=True)[fact] = value

    def __len__(self) -> int:
        return len(self._entries)


class PairMemo:
    """Facts about a pair of tensors (``prefix_of``, ``cu_seqlens``), kept while both live
    unmodified: ``get_or_build(first, second, fact, build)`` returns the fact, calling
    ``build()`` (which must not return None) once per pair, fact and versions."""

    def __init__(self):
        self._by_first = TensorMemo()

    def get_or_build(self, first: torch.Tensor, second: torch.Tensor, fact, build):
        by_second = self._by_first.get(first, "by_second")
        if by_second is None:
            by_second = TensorMemo()
            self._by_first.put(first, "by_second", by_second)
        value = by_second.get(second, fact)
        if value is None:
            value = build()
            by_second.put(second, fact, value)
        return value
