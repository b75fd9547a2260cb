"""A generator that runs a text policy through the real engine (scripted experts, tests)."""

from __future__ import annotations

from typing import Callable, Protocol

from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.generators.base import Generation


class TextCodec(Protocol):
    """What :class:`ScriptedGenerator` needs of a chat format
    (:class:`~agentrl_fast.harness.chat_format.ChatFormat` is one)."""

    im_end_id: int

    def decode(self, ids: list[int]) -> str: ...

    def encode(self, text: str) -> list[int]: ...


class ScriptedGenerator:
    """A :class:`~agentrl_fast.generators.base.Generator` that runs a text policy
    (``policy(context_text) -> output_text``) through the real engine: it decodes each prompt,
    asks the policy, and returns the output's ids plus the stop id the output calls for
    (``</tool_call>`` ends a call in ``"tool_call"`` mode — it is the output's last token —
    otherwise ``<|im_end|>``), with log-prob 0 (a deterministic policy). An output holding a
    ``sampling.banned_ids`` id fails (``finish_reason "error"``): a script cannot avoid it."""

    def __init__(self, policy: Callable[[str], str], chat_format: TextCodec):
        self.policy = policy
        self.chat_format = chat_format

    def generate(self, prompts, sampling: SamplingParams, seeds=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Generation]:
        out = []
        for index, prompt in enumerate(prompts):
            text = self.policy(self.chat_format.decode(prompt))
            ids = self.chat_format.encode(text)
            if not (ids and ids[-1] in sampling.stop_ids):
                ids.append(self.chat_format.im_end_id)
            ids = ids[:sampling.max_new_tokens]
            banned = sorted(set(ids) & set(sampling.banned_ids))
            if banned:  # a script cannot be renormalized: it fails as a failed request does
                out.append(Generation([], [], "error", error=(
                    f"the scripted policy wrote token {banned[0]} "
                    f"({self.chat_format.decode([banned[0]])!r}), which sampling.banned_ids "
                    f"forbids")))
                continue
            reason = "stop" if ids[-1] in sampling.stop_ids else "length"
            for token in ids if on_tokens is not None else ():
                on_tokens(index, [token])
            out.append(Generation(ids, [0.0] * len(ids), reason))
        return out
