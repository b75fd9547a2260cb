"""Sampling parameters of a generator (a leaf: standard library only)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How a generator samples each sequence (a turn, in a rollout)."""

    temperature: float = 1.0
    """Softmax temperature, >= 0; 0: greedy (log-probs are then those of the untempered
    distribution). The trainer's log-probs use the same temperature, so PPO's ratio starts at
    1. Below 1 samples fewer unlikely tokens; 1 samples the policy as it is."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches
    ``top_p``, in (0, 1]; 1: off. Log-probs stay those before truncation (the vLLM backend
    needs it off)."""
    top_k: int = 0
    """Sample from the ``top_k`` most likely tokens; 0: off (the vLLM backend needs it off)."""
    max_new_tokens: int = 256
    """Most tokens generated per sequence; a turn that reaches it without a stop truncates its
    rollout. Set it above the longest turn a good policy writes."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a sequence (kept as its last sampled id). The rollout engine sets
    them to its chat format's stop tokens, whatever is given here; they matter when calling a
    generator directly."""
    banned_ids: tuple[int, ...] = ()
    """Token ids never sampled: masked before the softmax (vLLM: a logit bias of -100), so the
    recorded log-probs are the renormalized ones the tokens were drawn from, the behaviour
    policy's; with recomputed old log-probs (``train.recompute_logprobs``) the truncated
    importance weight (``train.tis_cap``) corrects for the mismatch. The proxy bans
    ``<tool_call>`` for a request's ``tool_choice: "none"``."""

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
        banned = tuple(self.banned_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in banned):
            raise ValueError(f"SamplingParams: banned_ids must be token ids (ints >= 0), "
                             f"got {self.banned_ids!r}")
        object.__setattr__(self, "banned_ids", tuple(sorted(set(banned))))
