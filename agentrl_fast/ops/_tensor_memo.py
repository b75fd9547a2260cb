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
