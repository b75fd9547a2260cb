"""Generation for rollouts in this process: :class:`TorchGenerator`, batched sampling with a KV
cache for Hugging Face causal LMs.

Sampling log-probs (docs/design.md): ``log_softmax(logits / temperature)`` of the sampled token,
before top-k/top-p truncation, so they equal the trainer's recomputed log-probs at the same
temperature up to float rounding. Each sequence samples from its own ``torch.Generator`` seeded
by the caller (one uniform per token, inverted through the batch's cumulative distribution), so
a sequence's tokens do not depend on which other sequences share its batch; with the same seeds
the same ids come out (on the CPU, bit for bit, for the same cached prefixes).

Prefix cache: a multi-turn rollout calls ``generate`` once per turn with a prompt that extends
the previous call's prompt and output. :class:`TorchGenerator` keeps each finished row's keys and
values (up to ``prefix_cache_bytes``, least recently used first out) and prefills only the new
tail of a prompt that extends a kept sequence, as vLLM's automatic prefix caching does. The
cache is dropped whenever a parameter of the model changes (an optimizer step, a
``load_state_dict``), so it never serves keys of other weights.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.generators.base import Generation
from agentrl_fast.models.wrappers import unwrap


def sampling_distribution(logits: torch.Tensor, sampling: SamplingParams
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, filtered_logprobs)`` of ``logits [B, V]`` (float32): the tempered
    log-softmax that log-probs are recorded from, and the same after top-k/top-p (``-inf``
    outside the kept set), which tokens are drawn from. Banned ids are masked before the
    log-softmax: the recorded log-probs are then the renormalized ones tokens are drawn from."""
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    logits = logits.float()
    if sampling.banned_ids:
        banned = torch.tensor(sampling.banned_ids, device=logits.device)
        logits = logits.index_fill(-1, banned, float("-inf"))
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
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


def sample_tokens(filtered: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``filtered [B, V]`` (log-probs, ``-inf`` outside the kept set), drawn
    by inverting the row's cumulative distribution at one float64 uniform from
    ``generators[row]``; on the CPU, ``int64 [B]``."""
    probs = filtered.double().exp().cpu()
    cdf = probs.cumsum(-1)
    uniform = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators])
    tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total may round up to the total: fall back to the last token with mass.
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(tokens, last)


def parameter_stamp(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter of ``model`` is replaced, changed in place or given new
    storage (an optimizer step, ``load_state_dict``, ``module.to``, ``.data =``)."""
    return tuple((id(p), p._version, p.data_ptr()) for p in model.parameters())


class _PrefixCache:
    """Keys and values of finished rows (``tuple(ids) -> [layers, 2, H_kv, len(ids), D]``, keys
    then values), least recently used first out beyond ``capacity`` bytes; valid for one
    state of the model's parameters. A prompt reuses the kept sequence it shares the longest
    prefix with (a new sub-trace shares the system prompt and task with its rollout's last)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.stamp = None
        self._clear_table()

    def _clear_table(self) -> None:
        # Kept ids, one row per entry (-1 pads; a discarded entry's row becomes -2s, which no
        # token matches, until the table is rebuilt without it).
        self._rows: dict[tuple, int] = {}
        self._keys: list[tuple | None] = []
        self._table = np.full((0, 0), -1, dtype=np.int64)

    @staticmethod
    def _size(kv: torch.Tensor) -> int:
        return kv.numel() * kv.element_size()

    def validate(self, stamp: tuple) -> None:
        """Drop every entry if the model's :func:`parameter_stamp` is not the last call's."""
        if stamp != self.stamp:
            self.entries.clear()
            self.bytes, self.stamp = 0, stamp
            self._clear_table()

    def longest_prefix(self, prompt: list[int]) -> tuple[int, tuple | None, torch.Tensor | None]:
        """``(n, key, kv)``: the kept sequence ``key`` sharing the longest prefix with
        ``prompt``, its ``n`` shared positions (at most ``len(prompt) - 1``: the last prompt
        token is always fed) and their keys and values; ``(0, None, None)`` if none shares one."""
        if not self.entries or len(prompt) < 2:
            return 0, None, None
        table = self._table[:len(self._keys)]
        width = min(table.shape[1], len(prompt) - 1)
        # Shared prefix of each kept row: the first mismatch, or all ``width`` positions.
        differs = table[:, :width] != np.asarray(prompt[:width], dtype=np.int64)
        shared = np.where(differs.any(-1), differs.argmax(-1), width)
        best = int(shared.argmax())
        n = int(shared[best])
        if n == 0:
            return 0, None, None
        key = self._keys[best]
        self.entries.move_to_end(key)
        return n, key, self.entries[key][..., :n, :]

    def discard(self, key: tuple) -> None:
        kv = self.entries.pop(key, None)
        if kv is not None:
            self.bytes -= self._size(kv)
            row = self._rows.pop(key)
            self._table[row] = -2
            self._keys[row] = None
            if len(self._rows) * 2 < len(self._keys):  # mostly dead rows: rebuild
                live = [r for r, k in enumerate(self._keys) if k is not None]
                self._table = self._table[live]
                self._keys = [self._keys[r] for r in live]
                self._rows = {k: r for r, k in enumerate(self._keys)}

    def put(self, key: tuple, kv: torch.Tensor) -> None:
        size = self._size(kv)
        if not key or size > self.capacity:
            return
        self.discard(key)
        self.entries[key] = kv
        self.bytes += size
        rows, width = self._table.shape
        if len(self._keys) == rows or len(key) > width:  # grow to fit the new row
            # Each dimension doubles only when it is the one too small (a longer key must not
            # double the rows: prompts grow every turn).
            grown = np.full((max(2 * rows, 16) if len(self._keys) == rows else rows,
                             max(2 * width, len(key)) if len(key) > width else width), -1,
                            dtype=np.int64)
            grown[:rows, :width] = self._table
            self._table = grown
        self._table[len(self._keys), :len(key)] = key
        self._rows[key] = len(self._keys)
        self._keys.append(key)
        while self.bytes > self.capacity:
            self.discard(next(iter(self.entries)))


class TorchGenerator:
    """Batched sampling with a KV cache for an HF causal LM (``model(input_ids, attention_mask,
    position_ids, cache) -> logits``), prompts left-padded in one batch per call (chunks of
    ``max_batch_size``); a prompt that extends an earlier call's prompt and output prefills only
    its new tokens (``prefix_cache_bytes`` of kept keys and values; 0 turns it off)."""

    def __init__(self, model: torch.nn.Module, pad_id: int = 0, max_batch_size: int = 64,
                 prefix_cache_bytes: int = 1 << 30, fast_decode: bool | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchGenerator: model must be a torch.nn.Module (an HF causal LM), "
                            f"got {type(model).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"TorchGenerator: max_batch_size must be an int >= 1, "
                             f"got {max_batch_size!r}")
        if not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise ValueError(f"TorchGenerator: prefix_cache_bytes must be an int >= 0 (0: off), "
                             f"got {prefix_cache_bytes!r}")
        if fast_decode not in (None, True, False):
            raise ValueError(f"TorchGenerator: fast_decode must be None (when the model allows), "
                             f"True or False, got {fast_decode!r}")
        self.model = model
        self.fast = None
        if fast_decode is not False:
            from agentrl_fast.models.fast_decode import fast_decoder
            self.fast = fast_decoder(model)
            if self.fast is None and fast_decode:
                raise ValueError(f"TorchGenerator: fast_decode=True, but "
                                 f"{type(model).__name__} is not a Llama-family decoder the "
                                 f"fast path covers (Qwen3, Qwen2, Llama with full attention)")
        self.pad_id = int(pad_id)
        self.max_batch_size = max_batch_size
        self.prefix_cache = _PrefixCache(prefix_cache_bytes)
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset_prefix_cache(self) -> None:
        """Forget every kept sequence (the rollout engine does at the start of each run, so a run
        gives the same log-probs, bit for bit, whatever ran before it)."""
        self.prefix_cache = _PrefixCache(self.prefix_cache.capacity)

    def update_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model``'s parameters from the next call on: copied into this
        generator's model unless it is that model (then it already is current: the prefix
        cache checks the parameters before each use)."""
        if unwrap(model) is not self.model:
            self.model.load_state_dict(unwrap(model).state_dict())
        self.reset_prefix_cache()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Generation]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        embeddings = getattr(self.model, "get_input_embeddings", lambda: None)()
        vocab_size = getattr(embeddings, "num_embeddings", None) or math.inf
        if any(i >= vocab_size for i in sampling.banned_ids):
            raise ValueError(f"sampling.banned_ids holds {max(sampling.banned_ids)}, outside the "
                             f"model's vocabulary [0, {vocab_size})")
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
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be callable as on_tokens(prompt index, ids), got "
                            f"{type(on_tokens).__name__}")
        out: list[Generation] = []
        stamp = parameter_stamp(self.model)
        if self.prefix_cache.capacity:
            self.prefix_cache.validate(stamp)
        if self.fast is not None:
            self.fast.refresh(stamp)
        with self._generation_mode():
            for start in range(0, len(prompts), self.max_batch_size):
                stop = start + self.max_batch_size
                heard = None if on_tokens is None else functools.partial(_shifted, on_tokens,
                                                                         start)
                out += self._generate_batch(prompts[start:stop], sampling, seeds[start:stop],
                                            heard)
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

    def _caches_plain_layers(self) -> bool:
        """Whether the model's cache is one plain (full-attention) layer per decoder layer, the
        layout the prefix cache copies rows out of and into."""
        if not hasattr(self, "_plain_layers"):
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer
            layers = DynamicCache(config=self.model.config).layers
            self._plain_layers = bool(layers) and all(type(x) is DynamicLayer for x in layers)
        return self._plain_layers

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams,
                        seeds: list[int], on_tokens: Callable[[int, list[int]], None] | None
                        ) -> list[Generation]:
        from transformers import DynamicCache

        device = self.device
        caching = self.prefix_cache.capacity > 0 and (self.fast is not None
                                                      or self._caches_plain_layers())
        hits = [self.prefix_cache.longest_prefix(p) if caching else (0, None, None)
                for p in prompts]
        # Layout: [kept keys, right-aligned | new prompt tokens, right-aligned], masks mark both.
        batch, cached = len(prompts), max(n for n, _, _ in hits)
        width = max(len(p) - n for p, (n, _, _) in zip(prompts, hits))
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, cached + width), dtype=torch.long)
        position_ids = torch.zeros((batch, width), dtype=torch.long)
        for row, (prompt, (n, _, _)) in enumerate(zip(prompts, hits)):
            tail = len(prompt) - n
            input_ids[row, width - tail:] = torch.tensor(prompt[n:])
            attention_mask[row, cached - n:cached] = 1
            attention_mask[row, cached + width - tail:] = 1
            position_ids[row, width - tail:] = torch.arange(n, len(prompt))
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = position_ids.to(device)
        fast, cache, state = self.fast, None, None
        if fast is not None:
            state = fast.start(batch, cached + width + sampling.max_new_tokens, device)
            for row, (n, _, kv) in enumerate(hits):
                if n:
                    state.write_prefix(row, kv, cached)
            state.length = cached
            logits = fast.forward(state, input_ids, position_ids, attention_mask[:, cached:] > 0)
        else:
            data = None
            if cached:
                kept = next(kv for _, _, kv in hits if kv is not None)
                layers, _, heads, _, dim = kept.shape
                data = kept.new_zeros(layers, 2, batch, heads, cached, dim)
                for row, (n, _, kv) in enumerate(hits):
                    if n:
                        data[:, :, row, :, cached - n:] = kv
                data = [(k, v) for k, v in data]
            cache = DynamicCache(data, config=self.model.config)
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids, use_cache=True, logits_to_keep=1,
                                **{self._cache_argument: cache}).logits[:, -1]
        generators = [torch.Generator(device="cpu").manual_seed(int(s) % (2 ** 63)) for s in seeds]
        stops = torch.tensor(sampling.stop_ids or [-1], device=device)
        ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished = [False] * batch
        reasons = ["length"] * batch
        rows = list(range(batch))  # the prompt row of each row still in the batch

        def keep_rows(positions: list[int]) -> None:
            """Put the keys and values of ``rows[k]`` for ``k`` in ``positions`` (prompt and
            every sampled id but the last) in the prefix cache."""
            if not caching:
                return
            for k in positions:
                row = rows[k]
                if state is not None:
                    kv = state.row(k)
                else:
                    real = attention_mask[k].nonzero()[:, 0]
                    kv = torch.stack([torch.stack((x.keys[k][:, real], x.values[k][:, real]))
                                      for x in cache.layers])
                self.prefix_cache.put(tuple(prompts[row] + ids[row][:-1]), kv)

        for step in range(sampling.max_new_tokens):
            recorded, filtered = sampling_distribution(logits, sampling)
            if sampling.temperature == 0:
                tokens = filtered.argmax(-1).cpu()
            else:
                tokens = sample_tokens(filtered, [generators[row] for row in rows])
            token_logprobs = recorded.cpu().gather(-1, tokens[:, None])[:, 0].tolist()
            is_stop = torch.isin(tokens.to(device), stops).cpu().tolist()
            for k, (row, token) in enumerate(zip(rows, tokens.tolist())):
                ids[row].append(token)
                logprobs[row].append(token_logprobs[k])
                if is_stop[k]:
                    finished[row], reasons[row] = True, "stop"
                if on_tokens is not None:
                    on_tokens(row, [token])
            keep = [k for k, row in enumerate(rows) if not finished[row]]
            if not keep or step == sampling.max_new_tokens - 1:
                keep_rows(list(range(len(rows))))
                break  # no forward for logits that would not be sampled from
            if len(keep) < len(rows):  # finished rows leave the batch (and the cache)
                keep_rows([k for k, row in enumerate(rows) if finished[row]])
                index = torch.tensor(keep, device=device)
                if state is not None:
                    state.select(index)
                else:
                    cache.batch_select_indices(index)
                    attention_mask = attention_mask[index]
                position_ids = position_ids[index]
                tokens = tokens[keep]
                rows = [rows[k] for k in keep]
            position_ids = position_ids[:, -1:] + 1
            if state is not None:
                logits = fast.forward(state, tokens[:, None].to(device), position_ids,
                                      torch.ones((len(rows), 1), dtype=torch.bool, device=device))
                continue
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)],
                                       dim=1)
            logits = self.model(input_ids=tokens[:, None].to(device),
                                attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, **{self._cache_argument: cache}).logits[:, -1]
        for n, key, _ in hits:
            if n and n == len(key):  # wholly extended by a sequence just kept
                self.prefix_cache.discard(key)
        return [Generation(i, lp, r) for i, lp, r in zip(ids, logprobs, reasons)]


def _shifted(on_tokens: Callable[[int, list[int]], None], offset: int, row: int,
             ids: list[int]) -> None:
    """``on_tokens`` of a sub-batch: its rows are the prompts from ``offset`` on."""
    on_tokens(offset + row, ids)


