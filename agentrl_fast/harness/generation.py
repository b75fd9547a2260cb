"""Generation for rollouts: the :class:`Generator` protocol and :class:`TorchGenerator`, batched
sampling with a KV cache for Hugging Face causal LMs.

Sampling log-probs (DESIGN.md): ``log_softmax(logits / temperature)`` of the sampled token,
before top-k/top-p truncation, so they equal the trainer's recomputed log-probs at the same
temperature up to float rounding. Each sequence samples from its own ``torch.Generator`` seeded
by the caller, so a sequence's tokens do not depend on which other sequences share its batch;
with the same seeds the same ids come out (on the CPU, bit for bit).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from agentrl_fast.harness.chat_format import ChatFormat

FINISH_REASONS = ("stop", "length")


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


@dataclass(frozen=True)
class Generation:
    """One sequence's output: sampled ``ids`` (stop id included), their sampling ``logprobs``,
    ``finish_reason`` ``"stop"`` or ``"length"``."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Generator(Protocol):
    """What the rollout engine needs from an inference engine (TorchGenerator here; vLLM or
    SGLang backends implement the same call)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        """Continue each prompt (token ids) until a stop id or ``max_new_tokens``; ``seeds``:
        one per prompt, for reproducible sampling."""


def sampling_distribution(logits: torch.Tensor, sampling: SamplingParams
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, filtered_logprobs)`` of ``logits [B, V]`` (float32): the tempered
    log-softmax that log-probs are recorded from, and the same after top-k/top-p (``-inf``
    outside the kept set), which tokens are drawn from."""
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    filtered = logprobs
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, sampling.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logprobs, order = torch.sort(filtered, dim=-1, descending=True)
        # Renormalized over what top-k kept (as HF's TopP warper and vLLM do after top-k).
        probs = torch.softmax(sorted_logprobs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= sampling.top_p
        sorted_logprobs = sorted_logprobs.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logprobs)
    return logprobs, filtered


class TorchGenerator:
    """Batched sampling with a KV cache for an HF causal LM (``model(input_ids, attention_mask,
    position_ids, cache) -> logits``), prompts left-padded in one batch per call (chunks of
    ``max_batch_size``)."""

    def __init__(self, model: torch.nn.Module, pad_id: int = 0, max_batch_size: int = 64):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchGenerator: model must be a torch.nn.Module (an HF causal LM), "
                            f"got {type(model).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"TorchGenerator: max_batch_size must be an int >= 1, "
                             f"got {max_batch_size!r}")
        self.model = model
        self.pad_id = int(pad_id)
        self.max_batch_size = max_batch_size
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        embeddings = getattr(self.model, "get_input_embeddings", lambda: None)()
        vocab_size = getattr(embeddings, "num_embeddings", None) or math.inf
        checked = []
        for i, p in enumerate(prompts):
            ids = torch.as_tensor(p if isinstance(p, torch.Tensor) else list(p)).cpu()
            if ids.numel() == 0:
                raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token")
            if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
                raise TypeError(f"prompts[{i}] must hold integer token ids, got dtype {ids.dtype}")
            if ids.dim() != 1:
                raise ValueError(f"prompts[{i}] must be 1-D (one prompt of token ids), got shape "
                                 f"{tuple(ids.shape)}")
            out_of_range = (ids < 0) | (ids >= vocab_size)
            if out_of_range.any():
                raise ValueError(f"prompts[{i}] holds token id {int(ids[out_of_range][0])}, outside "
                                 f"the model's vocabulary [0, {vocab_size})")
            checked.append(ids.tolist())
        prompts = checked
        if seeds is None:
            seeds = [torch.initial_seed() + i for i in range(len(prompts))]
        seeds = list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        out: list[Generation] = []
        with self._generation_mode():
            for start in range(0, len(prompts), self.max_batch_size):
                stop = start + self.max_batch_size
                out += self._generate_batch(prompts[start:stop], sampling, seeds[start:stop])
        return out

    @contextlib.contextmanager
    def _generation_mode(self):
        """Eval mode (no dropout while sampling) and a padded-batch attention: a model the
        trainer switched to packed attention (which reads sequence boundaries, not masks) runs
        on sdpa here. Both are restored afterwards."""
        model, config = self.model, self.model.config
        training = model.training
        attention = getattr(config, "_attn_implementation", None)
        switch = attention not in (None, "sdpa", "eager")
        if switch:
            model.set_attn_implementation("sdpa")
        model.eval()
        try:
            yield
        finally:
            model.train(training)
            if switch:
                model.set_attn_implementation(attention)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams,
                        seeds: list[int]) -> list[Generation]:
        from transformers import DynamicCache

        device = self.device
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator(device="cpu").manual_seed(int(s) % (2 ** 63)) for s in seeds]
        stops = torch.tensor(sampling.stop_ids or [-1], device=device)
        cache = DynamicCache(config=self.model.config)
        ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished = [False] * batch
        reasons = ["length"] * batch
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=True, logits_to_keep=1,
                            **{self._cache_argument: cache}).logits[:, -1]
        rows = list(range(batch))  # the prompt row of each row still in the batch
        for step in range(sampling.max_new_tokens):
            recorded, filtered = sampling_distribution(logits, sampling)
            if sampling.temperature == 0:
                tokens = filtered.argmax(-1).cpu()
            else:
                probs = filtered.exp().cpu()
                tokens = torch.stack([torch.multinomial(probs[k], 1, generator=generators[row])[0]
                                      for k, row in enumerate(rows)])
            token_logprobs = recorded.cpu().gather(-1, tokens[:, None])[:, 0]
            is_stop = torch.isin(tokens.to(device), stops).cpu()
            for k, row in enumerate(rows):
                ids[row].append(int(tokens[k]))
                logprobs[row].append(float(token_logprobs[k]))
                if is_stop[k]:
                    finished[row], reasons[row] = True, "stop"
            keep = [k for k, row in enumerate(rows) if not finished[row]]
            if not keep or step == sampling.max_new_tokens - 1:
                break  # no forward for logits that would not be sampled from
            if len(keep) < len(rows):  # finished rows leave the batch (and the cache)
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention_mask, position_ids = attention_mask[index], position_ids[index]
                tokens = tokens[keep]
                rows = [rows[k] for k in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)],
                                       dim=1)
            position_ids = position_ids[:, -1:] + 1
            logits = self.model(input_ids=tokens[:, None].to(device),
                                attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, **{self._cache_argument: cache}).logits[:, -1]
        return [Generation(i, lp, r) for i, lp, r in zip(ids, logprobs, reasons)]


class ScriptedGenerator:
    """A :class:`~agentrl_fast.harness.generation.Generator` that runs a text policy
    (``policy(context_text) -> output_text``) through the real engine: it decodes each prompt,
    asks the policy, and returns the output's ids plus the stop id the output calls for
    (``</tool_call>`` ends a call in ``"tool_call"`` mode — it is the output's last token —
    otherwise ``<|im_end|>``), with log-prob 0 (a deterministic policy)."""

    def __init__(self, policy: Callable[[str], str], chat_format: "ChatFormat"):
        self.policy = policy
        self.chat_format = chat_format

    def generate(self, prompts, sampling: SamplingParams, seeds=None) -> list[Generation]:
        out = []
        for prompt in prompts:
            text = self.policy(self.chat_format.decode(prompt))
            ids = self.chat_format.encode(text)
            if not (ids and ids[-1] in sampling.stop_ids):
                ids.append(self.chat_format.im_end_id)
            ids = ids[:sampling.max_new_tokens]
            reason = "stop" if ids[-1] in sampling.stop_ids else "length"
            out.append(Generation(ids, [0.0] * len(ids), reason))
        return out
