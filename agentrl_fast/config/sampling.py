"""Sampling parameters of a generator (a leaf: standard library only)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` (0: greedy; log-probs are then those of the untempered distribution),
    ``top_p`` in (0, 1], ``top_k`` (0: off), ``max_new_tokens`` per sequence, ``stop_ids``:
    token ids that end a sequence (kept as its last sampled id)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
                and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0, "
                             f"got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: max_new_tokens must be an int >= 1, "
                             f"got {self.max_new_tokens!r}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
