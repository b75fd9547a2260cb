"""What the rollout engine, the proxy and the trainer need from an inference engine: the
:class:`Generator` protocol and the :class:`Generation` it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from agentrl_fast.config.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

FINISH_REASONS = ("stop", "length", "error")


@dataclass(frozen=True)
class Generation:
    """One sequence's output: sampled ``ids`` (stop id included), their sampling ``logprobs``,
    ``finish_reason`` ``"stop"`` or ``"length"``; ``"error"`` (no ids, ``error`` says why) when
    an inference server failed the request: the rollout engine ends that episode. ``version``:
    the policy version of the weights that sampled it (asynchronous training)."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    error: str | None = None
    version: int = 0


class Generator(Protocol):
    """What the rollout engine and the trainer need from an inference engine
    (:class:`~agentrl_fast.generators.torch_generator.TorchGenerator`,
    :class:`~agentrl_fast.generators.vllm_generator.VLLMGenerator`; an
    SGLang backend would implement the same calls)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Generation]:
        """Continue each prompt (token ids) until a stop id or ``max_new_tokens``; ``seeds``:
        one per prompt, for reproducible sampling; ``on_tokens(prompt index, ids)`` hears each
        prompt's ids as they are sampled, in order (the proxy streams replies token by token
        with it; a generator that cannot stream may tell them all at the end)."""

    def update_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model``'s current parameters from the next ``generate`` on."""
