"""Rollout generation (agentrl_fast.generators.base): TorchGenerator and sampling_distribution.

Tiny randomly initialized HF models built from configs in code (nothing downloaded), float32 on
the CPU. The key claim for rollouts: the log-probs recorded while sampling a left-padded batch
equal the trainer's teacher-forced log-probs of prompt + generated ids (each sequence alone, and
all of them packed through ``packed_forward``), at the sampling temperature, before top-k/top-p.
Then: per-row seeds make outputs reproducible and independent of the rest of the batch (order,
company, ``max_batch_size`` chunks); stop ids end sequences (and the loop, once all stopped);
``sampling_distribution`` keeps exactly the top-k / top-p set (checked against a float64
reference and transformers' own warpers) and the sampler's empirical frequencies follow it; bad
arguments raise clear errors (in a child interpreter); generation builds no autograd graph.
"""

import copy
import inspect
import math
import textwrap

import pytest
import torch
import transformers
from error_cases import bad_input_tests

from agentrl_fast.generators.base import FINISH_REASONS, Generation, Generator
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.generators.torch_generator import TorchGenerator, sampling_distribution
from agentrl_fast.models import pack, packed_forward, unpack, use_packed_attention

VOCAB = 96
PROMPT_LENGTHS = (1, 3, 17, 40)  # left padding up to 39 tokens in one batch
SEEDS = (11, 22, 33, 44)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model gains nothing from two, and a CI job sharing the CPUs
    makes spinning threads ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_model(family: str = "qwen3", *, attn: str = "sdpa", init: float = 0.2, vocab: int = VOCAB,
                layers: int = 2, seed: int = 0):
    """A float32 model in eval mode; ``init`` (initializer_range) 0.2 gives peaked next-token
    distributions, 0.02 nearly flat ones."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,  # GQA
                  max_position_embeddings=256, tie_word_embeddings=False, initializer_range=init,
                  attention_dropout=0.0)
    if family == "qwen3":
        config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif family == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(scope="module")
def peaked():
    return _tiny_model("qwen3", init=0.2)


@pytest.fixture(scope="module")
def flat():
    return _tiny_model("qwen3", init=0.02, layers=1, seed=1)


def _prompts(lengths=PROMPT_LENGTHS, seed=0, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def _tempered_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


def _teacher_forced(logits: torch.Tensor, prompt_length: int, ids, temperature: float) -> torch.Tensor:
    """Log-probs of ``ids`` from a sequence's logits ``[prompt_length + len(ids), V]``: position
    t-1 predicts token t."""
    logprobs = _tempered_logprobs(logits[prompt_length - 1:-1], temperature)
    return logprobs.gather(-1, torch.tensor(ids)[:, None])[:, 0]


def _assert_same_ids(got: list[Generation], want: list[Generation], what: str, logprob_tol=1e-5):
    assert len(got) == len(want), what
    for row, (g, w) in enumerate(zip(got, want)):
        assert g.ids == w.ids, f"{what}: row {row} ids {g.ids} != {w.ids}"
        assert g.finish_reason == w.finish_reason, f"{what}: row {row}"
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0,
                                   atol=logprob_tol, msg=lambda m: f"{what}: row {row}: {m}")


@pytest.fixture(autouse=True, params=["fast", "hf"])
def decode_path(request, monkeypatch):
    """Every test runs on both forwards a TorchGenerator can take: the lean one of
    ``agentrl_fast.models.fast_decode`` (the default for these Llama-family models) and HF's own
    ``forward`` (what other models get)."""
    if request.param == "hf":
        monkeypatch.setattr("agentrl_fast.models.fast_decode.fast_decoder", lambda model: None)
    return request.param


class _CallCounter:
    """Counts forward calls of a model (through its input embedding, which both decode paths
    call once per forward) and records whether grad mode was on in each."""

    def __init__(self, model):
        self.grad_modes = []
        self._handle = model.get_input_embeddings().register_forward_hook(
            lambda *_: self.grad_modes.append(torch.is_grad_enabled()))

    @property
    def calls(self) -> int:
        return len(self.grad_modes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.remove()


# ---------------------------------------------------------------------------------------------
# 1. Sampling log-probs == teacher-forced log-probs (alone and packed)


@pytest.mark.parametrize("family,attn", [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa")])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 20, 0.9), (0.7, 8, 0.95), (0.7, 0, 0.6)])
def test_logprobs_equal_teacher_forced_alone_and_packed(family, attn, temperature, top_k, top_p):
    model = _tiny_model(family, attn=attn)
    prompts = _prompts()
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12)
    out = TorchGenerator(model, pad_id=0).generate(prompts, sampling, seeds=list(SEEDS))

    sequences = [p + g.ids for p, g in zip(prompts, out)]
    packed_model = use_packed_attention(copy.deepcopy(model))
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(sequences)
    with torch.no_grad():
        packed_logits = packed_forward(packed_model, input_ids, position_ids, cu_seqlens,
                                       max_seqlen).logits
    per_sequence = unpack(packed_logits, cu_seqlens)

    for prompt, g, sequence, packed in zip(prompts, out, sequences, per_sequence):
        what = f"{family}/{attn} T={temperature} k={top_k} p={top_p}, prompt of {len(prompt)}"
        assert g.finish_reason == "length" and len(g.ids) == len(g.logprobs) == 12, what
        assert all(isinstance(i, int) and 0 <= i < VOCAB for i in g.ids), what
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0]
        want = _teacher_forced(alone, len(prompt), g.ids, temperature)
        got = torch.tensor(g.logprobs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m: f"{what} alone: {m}")
        torch.testing.assert_close(_teacher_forced(packed, len(prompt), g.ids, temperature), want,
                                   rtol=0, atol=1e-4, msg=lambda m: f"{what} packed: {m}")
        # every sampled token lies in the top-k/top-p set of its step
        _, filtered = sampling_distribution(alone[len(prompt) - 1:-1], sampling)
        kept = filtered.gather(-1, torch.tensor(g.ids)[:, None])[:, 0]
        assert torch.isfinite(kept).all(), f"{what}: sampled outside the top-k/top-p set: {kept}"


def test_greedy_is_argmax_with_untempered_logprobs(peaked):
    prompts = _prompts()
    generator = TorchGenerator(peaked)
    # top-k/top-p do not change the argmax; the recorded log-probs are untempered
    sampling = SamplingParams(temperature=0, top_k=3, top_p=0.5, max_new_tokens=10)
    out = generator.generate(prompts, sampling, seeds=list(SEEDS))
    for prompt, g in zip(prompts, out):
        with torch.no_grad():
            logits = peaked(input_ids=torch.tensor([prompt + g.ids])).logits[0]
        steps = logits[len(prompt) - 1:-1]
        assert g.ids == steps.argmax(-1).tolist(), f"prompt of {len(prompt)}: not greedy"
        torch.testing.assert_close(torch.tensor(g.logprobs), _teacher_forced(logits, len(prompt), g.ids, 1.0),
                                   rtol=0, atol=1e-4)
    # seeds play no part
    _assert_same_ids(generator.generate(prompts, sampling, seeds=[5, 6, 7, 8]), out, "greedy, other seeds")


@pytest.mark.parametrize("temperature", [0.7, 0])
def test_banned_ids_are_never_sampled_and_logprobs_are_renormalized(peaked, temperature):
    """``banned_ids`` are masked before the log-softmax: never sampled (nor chosen greedily),
    and each recorded log-prob is the teacher-forced one renormalized without them (the
    distribution the token was drawn from)."""
    prompts = _prompts()
    generator = TorchGenerator(peaked)
    free = generator.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=8),
                              seeds=list(SEEDS))
    banned = tuple(sorted({g.ids[0] for g in free}))  # each row's own first token
    sampling = SamplingParams(temperature=temperature, max_new_tokens=8, banned_ids=banned)
    for prompt, g in zip(prompts, generator.generate(prompts, sampling, seeds=list(SEEDS))):
        assert not set(g.ids) & set(banned)
        with torch.no_grad():
            logits = peaked(input_ids=torch.tensor([prompt + g.ids])).logits[0]
        masked = logits.index_fill(-1, torch.tensor(banned), float("-inf"))
        renormalized = _teacher_forced(masked, len(prompt), g.ids, temperature)
        torch.testing.assert_close(torch.tensor(g.logprobs), renormalized, rtol=0, atol=1e-4)
        assert renormalized[0] > _teacher_forced(logits, len(prompt), g.ids, temperature)[0] + 0.01
    with pytest.raises(ValueError, match="banned_ids holds 96, outside the model's vocabulary"):
        generator.generate(prompts, SamplingParams(banned_ids=(3, VOCAB)))
    with pytest.raises(ValueError, match="banned_ids must be token ids"):
        SamplingParams(banned_ids=(-1,))


# ---------------------------------------------------------------------------------------------
# 2. Reproducibility and batch independence


def test_same_seeds_same_output_regardless_of_batch(flat):
    # No prefix cache: a repeated prompt would reuse the keys of the first call, equal only up
    # to float rounding (the prefix-cache tests below check those ids).
    generator = TorchGenerator(flat, prefix_cache_bytes=0)
    prompts = _prompts()
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, max_new_tokens=16)
    out = generator.generate(prompts, sampling, seeds=list(SEEDS))
    assert generator.generate(prompts, sampling, seeds=list(SEEDS)) == out  # bit for bit
    cached = TorchGenerator(flat)
    cached.generate(prompts, sampling, seeds=list(SEEDS))
    _assert_same_ids(cached.generate(prompts, sampling, seeds=list(SEEDS)), out, "repeated, cached")

    order = [2, 0, 3, 1]
    permuted = generator.generate([prompts[i] for i in order], sampling, seeds=[SEEDS[i] for i in order])
    _assert_same_ids(permuted, [out[i] for i in order], "permuted batch")
    for i, (prompt, seed) in enumerate(zip(prompts, SEEDS)):
        _assert_same_ids(generator.generate([prompt], sampling, seeds=[seed]), [out[i]], f"row {i} alone")
    # in other company: two extra long prompts widen the padding
    others = _prompts((60, 2), seed=9)
    mixed = generator.generate(others + prompts, sampling, seeds=[7, 8, *SEEDS])[2:]
    _assert_same_ids(mixed, out, "with other prompts")


def test_different_seeds_differ_and_default_seeds_follow_torch_seed(flat):
    generator = TorchGenerator(flat, prefix_cache_bytes=0)  # bit-for-bit repeats
    prompt = _prompts((5,))[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    out = generator.generate([prompt] * 6, sampling, seeds=[1, 2, 3, 4, 5, 1])
    distinct = {tuple(g.ids) for g in out[:5]}
    assert len(distinct) == 5, f"different seeds gave equal outputs: {[g.ids for g in out]}"
    assert out[5] == out[0], "the same prompt and seed in one batch must give the same output"
    # seeds=None: seeds from torch.initial_seed(), so torch.manual_seed makes calls reproducible
    torch.manual_seed(1234)
    first = generator.generate([prompt] * 2, sampling)
    torch.manual_seed(1234)
    assert generator.generate([prompt] * 2, sampling) == first
    assert first[0].ids != first[1].ids  # one seed per row, not one per call


@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_max_batch_size_chunks_give_the_same_results(flat, max_batch_size):
    prompts = _prompts((4, 1, 9, 2, 30, 7, 3), seed=3)
    seeds = list(range(100, 107))
    sampling = SamplingParams(temperature=0.8, top_k=30, max_new_tokens=8, stop_ids=(5, 6, 7))
    whole = TorchGenerator(flat, max_batch_size=64).generate(prompts, sampling, seeds=seeds)
    chunked = TorchGenerator(flat, max_batch_size=max_batch_size).generate(prompts, sampling, seeds=seeds)
    _assert_same_ids(chunked, whole, f"max_batch_size={max_batch_size}")


# ---------------------------------------------------------------------------------------------
# 2b. Prefix cache: a turn that extends the last one prefills only its new tokens


class _PrefillWidths:
    """The ``input_ids`` width of every multi-token forward (the prefills) of a model (seen by
    its input embedding)."""

    def __init__(self, model):
        self.widths = []
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._record)

    def _record(self, module, args):
        ids = args[0]
        if ids.shape[1] > 1 or not self.widths:
            self.widths.append(ids.shape[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def _turns(model, generator, prompts, sampling, turns: int, seed: int):
    """``turns`` calls, each prompt extended by its output and fresh random tokens (a tool
    response), as the rollout engine does; the outputs of every call."""
    extra = torch.Generator().manual_seed(seed)
    prompts, calls = [list(p) for p in prompts], []
    for turn in range(turns):
        out = generator.generate(prompts, sampling, seeds=[seed + 10 * turn + i for i in range(len(prompts))])
        calls.append(out)
        prompts = [p + g.ids + torch.randint(1, VOCAB, (1 + (turn + i) % 4,), generator=extra).tolist()
                   for i, (p, g) in enumerate(zip(prompts, out))]
    return calls


@pytest.mark.parametrize("temperature,stop_ids", [(0.8, (5, 6, 7)), (0.0, ()), (1.0, (3,))])
def test_prefix_cache_gives_the_uncached_outputs(peaked, temperature, stop_ids):
    prompts = _prompts((1, 2, 17, 40, 5), seed=6)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=7, stop_ids=stop_ids)
    cached = TorchGenerator(peaked)
    plain = TorchGenerator(peaked, prefix_cache_bytes=0)
    with _PrefillWidths(peaked) as widths:
        got = _turns(peaked, cached, prompts, sampling, turns=5, seed=1)
    want = _turns(peaked, plain, prompts, sampling, turns=5, seed=1)
    for turn, (g, w) in enumerate(zip(got, want)):
        _assert_same_ids(g, w, f"turn {turn}")
    assert not plain.prefix_cache.entries
    assert len(cached.prefix_cache.entries) == len(prompts)  # the superseded ones were dropped
    # from the second turn on only new tokens are prefilled: at most a turn's new tokens
    # (fresh tokens 1-4) plus its last sampled id, against 40+ for a whole prompt
    assert widths.widths[0] == 40 and max(widths.widths[1:]) <= 5, widths.widths


def test_prefix_cache_mixes_hits_misses_shared_starts_and_whole_kept_prompts(peaked):
    sampling = SamplingParams(temperature=0.9, max_new_tokens=1)
    first = _prompts((9, 30), seed=8)
    generator = TorchGenerator(peaked)
    out = generator.generate(first, sampling, seeds=[1, 2])
    # kept: each prompt with its one id dropped (the last id is never fed); the same prompts
    # again are kept sequences in full, cut to all but their last token; a new prompt misses
    # a prompt that leaves a kept sequence after 25 tokens (a new sub-trace after a compaction)
    # reuses those 25
    prompts = [first[0], first[1] + out[1].ids + [4, 5], _prompts((13,), seed=9)[0], [7],
               first[1][:25] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    seeds = [3, 4, 5, 6, 7]
    sampling = SamplingParams(temperature=0.9, max_new_tokens=6)
    with _PrefillWidths(peaked) as widths:
        got = generator.generate(prompts, sampling, seeds=seeds)
    assert widths.widths[0] == 13, widths.widths  # the miss is the widest tail
    _assert_same_ids(got, TorchGenerator(peaked, prefix_cache_bytes=0).generate(prompts, sampling, seeds=seeds),
                     "hits, misses, a whole kept prompt, a one-token prompt, a shared start")


def test_prefix_cache_is_dropped_when_the_weights_change():
    model = _tiny_model("qwen3", init=0.2, seed=3)
    prompts = _prompts((6, 11), seed=2)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
    generator = TorchGenerator(model)
    out = generator.generate(prompts, sampling, seeds=[0, 1])
    nxt = [p + g.ids + [9] for p, g in zip(prompts, out)]

    def check(what):
        with _PrefillWidths(model) as widths:
            got = generator.generate(nxt, sampling, seeds=[0, 1])
        assert widths.widths[0] == max(map(len, nxt)), f"{what}: served stale keys ({widths.widths})"
        _assert_same_ids(got, TorchGenerator(model, prefix_cache_bytes=0).generate(nxt, sampling, seeds=[0, 1]),
                         what)

    with torch.no_grad():  # an optimizer-like in-place step
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    check("after an in-place update")
    generator.generate(prompts, sampling, seeds=[0, 1])
    model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
    check("after load_state_dict")
    generator.generate(prompts, sampling, seeds=[0, 1])
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 1.05  # new storage, version counter untouched
    check("after .data =")


def test_prefix_cache_capacity():
    model = _tiny_model("qwen3", layers=1)
    prompts = _prompts((30, 20, 10), seed=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    per_token = 2 * 2 * 16 * 4  # one layer: keys and values, 2 kv heads of 16 floats
    generator = TorchGenerator(model, prefix_cache_bytes=40 * per_token)
    generator.generate(prompts, sampling, seeds=[0, 1, 2])
    cache = generator.prefix_cache
    # 33 + 23 + 13 positions do not fit in 40: the oldest rows went first
    assert cache.bytes <= 40 * per_token
    assert sorted(len(k) for k in cache.entries) == [13, 23]
    assert cache.bytes == sum(len(k) for k in cache.entries) * per_token
    tiny = TorchGenerator(model, prefix_cache_bytes=per_token)  # no row fits: nothing kept
    tiny.generate(prompts, sampling, seeds=[0, 1, 2])
    assert not tiny.prefix_cache.entries and tiny.prefix_cache.bytes == 0
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="prefix_cache_bytes must be an int >= 0"):
            TorchGenerator(model, prefix_cache_bytes=bad)


def test_prefix_cache_lookup_table_stays_proportional_to_what_it_keeps():
    """Kept ids grow every turn (each prompt extends the last): the lookup table grows each
    dimension only when it is the one too small, so its size stays within a small factor of
    the longest key times the number of keys, and lookups still find the longest prefix."""
    from agentrl_fast.generators.torch_generator import _PrefixCache

    cache = _PrefixCache(capacity=1 << 40)
    kv = torch.zeros(1, 2, 1, 1, 1)
    keys = [tuple(range(10 + 3 * i)) for i in range(12)]  # 12 turns, each 3 tokens longer
    for key in keys:
        cache.put(key, kv)
    rows, width = cache._table.shape
    assert rows <= 2 * len(keys) and width <= 2 * len(keys[-1]), (rows, width)
    n, key, _ = cache.longest_prefix(list(range(500)))
    assert key == keys[-1] and n == len(keys[-1])


# ---------------------------------------------------------------------------------------------
# 3. Stops


def _truncate_at_stop(g: Generation, stop_ids) -> tuple[list[int], str]:
    for i, token in enumerate(g.ids):
        if token in stop_ids:
            return g.ids[:i + 1], "stop"
    return g.ids, "length"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_stop_ids_end_sequences_and_the_loop(flat, temperature):
    generator = TorchGenerator(flat)
    prompts = _prompts((2, 9, 1, 25, 4, 13), seed=5)
    seeds = [3, 1, 4, 1, 5, 9]
    max_new = 10
    base_sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new)
    with _CallCounter(flat) as counter:
        base = generator.generate(prompts, base_sampling, seeds=seeds)
    assert [g.finish_reason for g in base] == ["length"] * len(base)
    assert counter.calls == max_new, "prefill + one forward per further token, none wasted"

    # row 1's first token (a stop sampled at the first step) and, from another row, a token first
    # sampled at its 4th step or later
    late = next(g.ids[i] for g in base[:1] + base[2:] for i in range(3, max_new)
                if g.ids[i] not in g.ids[:i])
    stops = (base[1].ids[0], late)
    expected = [_truncate_at_stop(g, stops) for g in base]
    assert sum(r == "length" for _, r in expected) >= 1 and sum(r == "stop" for _, r in expected) >= 2
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new, stop_ids=stops)
    with _CallCounter(flat) as counter:
        out = generator.generate(prompts, sampling, seeds=seeds)
    for row, (g, b, (ids, reason)) in enumerate(zip(out, base, expected)):
        assert (g.ids, g.finish_reason) == (ids, reason), f"row {row}: stops {stops}, base {b.ids}"
        # finished rows leave the batch, so later steps run at another batch size: equal up to
        # float32 rounding
        assert g.logprobs == pytest.approx(b.logprobs[:len(ids)], abs=1e-5), f"row {row}"
        assert not any(t in stops for t in g.ids[:-1]), f"row {row}: ids after a stop"
    assert out[1].ids == [stops[0]] and out[1].finish_reason == "stop"
    assert counter.calls == max_new

    # all rows stopped by their second token: the loop ends there (prefill + 1 forward)
    early = tuple({g.ids[1] for g in base} | {g.ids[0] for g in base[:2]})
    with _CallCounter(flat) as counter:
        out = generator.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=max_new,
                                                         stop_ids=early), seeds=seeds)
    assert all(g.finish_reason == "stop" and len(g.ids) <= 2 for g in out), [g.ids for g in out]
    assert [g.ids for g in out] == [_truncate_at_stop(g, early)[0] for g in base]
    assert counter.calls == max(len(g.ids) for g in out) < max_new


def test_one_token_budget(flat):
    prompts = _prompts((3, 8))
    with _CallCounter(flat) as counter:
        out = TorchGenerator(flat).generate(prompts, SamplingParams(max_new_tokens=1), seeds=[0, 1])
    assert counter.calls == 1  # the prefill only
    assert [len(g.ids) for g in out] == [1, 1] and all(g.finish_reason == "length" for g in out)


# ---------------------------------------------------------------------------------------------
# 4. sampling_distribution


def _reference_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[set[int]]:
    """Per row, the set top-k then top-p keeps, in float64 from the definition: the k largest,
    then the smallest prefix of the (renormalized) sorted probabilities whose mass reaches
    top_p."""
    kept = []
    for row in logits.double():
        probs = torch.softmax(row / (temperature if temperature > 0 else 1.0), dim=-1).tolist()
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        if top_k:
            order = order[:top_k]
        total = sum(probs[i] for i in order)
        keep, mass = [], 0.0
        for i in order:
            keep.append(i)
            mass += probs[i] / total
            if mass >= top_p:
                break
        kept.append(set(keep))
    return kept


def _hf_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[set[int]]:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float() / (temperature if temperature > 0 else 1.0)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in scores]


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (1.0, 5, 1.0), (0.7, 1, 1.0), (1.0, 0, 0.9), (0.5, 0, 0.5), (1.3, 12, 0.8),
    (0.7, 5, 0.95), (1.0, 64, 0.7), (1.0, 500, 1.0), (0.7, 0, 1e-6), (0.0, 4, 0.5)])
def test_sampling_distribution_keeps_the_top_k_top_p_set(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100))
    logits = torch.randn(16, 64, generator=gen) * 3
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    recorded, filtered = sampling_distribution(logits, sampling)
    assert recorded.dtype == filtered.dtype == torch.float32 and filtered.shape == logits.shape
    # recorded: the untruncated tempered log-softmax (untempered for greedy)
    torch.testing.assert_close(recorded, _tempered_logprobs(logits, temperature), rtol=0, atol=1e-6)
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in filtered]
    assert kept == _reference_kept(logits, temperature, top_k, top_p)
    assert kept == _hf_kept(logits, temperature, top_k, top_p)
    argmax = logits.argmax(-1).tolist()
    for row in range(logits.shape[0]):
        assert argmax[row] in kept[row]
        if top_k:
            assert len(kept[row]) <= top_k
        # kept entries keep their recorded value (the sampler renormalizes)
        idx = sorted(kept[row])
        assert torch.equal(filtered[row, idx], recorded[row, idx])


def test_sampling_distribution_top_k_ties_and_half_precision():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    _, filtered = sampling_distribution(logits, SamplingParams(top_k=2))
    assert torch.isfinite(filtered[0]).tolist() == [True, False, True, True, False, True]  # ties kept
    recorded, _ = sampling_distribution(logits.to(torch.bfloat16), SamplingParams(temperature=0.5))
    assert recorded.dtype == torch.float32


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 8, 0.9), (0.7, 0, 0.8), (1.5, 6, 1.0)])
def test_empirical_first_token_frequencies(peaked, temperature, top_k, top_p):
    n = 2000
    prompt = _prompts((6,), seed=4)[0]
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    with torch.no_grad():
        logits = peaked(input_ids=torch.tensor([prompt])).logits[0, -1:]
    recorded, filtered = sampling_distribution(logits, sampling)
    recorded, expected = recorded[0], torch.softmax(filtered[0], dim=-1)
    kept = set(torch.isfinite(filtered[0]).nonzero().flatten().tolist())
    assert len(kept) >= 3 and float(expected.max()) < 0.8, "a test that says something needs spread"

    out = TorchGenerator(peaked, max_batch_size=n).generate([prompt] * n, sampling, seeds=range(n))
    tokens = torch.tensor([g.ids[0] for g in out])
    assert set(tokens.tolist()) <= kept, f"sampled outside the kept set {sorted(kept)}"
    frequencies = torch.bincount(tokens, minlength=VOCAB).double() / n
    worst = float((frequencies - expected.double()).abs().max())
    assert worst < 0.03, f"frequencies {frequencies[sorted(kept)]} vs {expected[sorted(kept)]}"
    # chi-square over the kept set, far below the 0.1% quantile for its degrees of freedom
    counts, mass = frequencies[sorted(kept)] * n, expected.double()[sorted(kept)] * n
    chi2 = float(((counts - mass) ** 2 / mass).sum())
    assert chi2 < 3 * len(kept) + 20, chi2
    logprobs = torch.tensor([g.logprobs[0] for g in out])
    torch.testing.assert_close(logprobs, recorded[tokens], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 5. No autograd graph; caller's grad mode and training flag untouched; the protocol


@pytest.mark.parametrize("training", [False, True])
def test_no_grad_and_modes_untouched(training):
    model = _tiny_model("qwen3", layers=1).train(training)
    prompts = _prompts((3, 7))
    with _CallCounter(model) as counter:
        out = TorchGenerator(model).generate(prompts, SamplingParams(max_new_tokens=4), seeds=[0, 1])
        assert torch.is_grad_enabled()
        with torch.no_grad():
            TorchGenerator(model).generate(prompts, SamplingParams(max_new_tokens=2), seeds=[0, 1])
        assert torch.is_grad_enabled()
    assert counter.grad_modes and not any(counter.grad_modes), "forward ran with grad enabled"
    assert model.training is training
    assert all(p.grad is None for p in model.parameters())
    for g in out:
        assert type(g.ids) is list and all(type(i) is int for i in g.ids)
        assert type(g.logprobs) is list and all(type(x) is float and math.isfinite(x) and x <= 0
                                                for x in g.logprobs)
        assert g.finish_reason in FINISH_REASONS


def test_torch_generator_follows_the_protocol_and_takes_tensor_prompts(flat):
    assert inspect.signature(TorchGenerator.generate) == inspect.signature(Generator.generate)
    generator = TorchGenerator(flat, prefix_cache_bytes=0)  # bit-for-bit repeats
    prompts = _prompts((4, 2))
    sampling = SamplingParams(max_new_tokens=3)
    want = generator.generate(prompts, sampling, seeds=[1, 2])
    assert generator.generate([torch.tensor(p) for p in prompts], sampling, seeds=(1, 2)) == want
    assert generator.generate([list(torch.tensor(p, dtype=torch.int32)) for p in prompts], sampling,
                              seeds=(1, 2)) == want  # lists of 0-d tensors
    assert generator.generate((tuple(p) for p in prompts), sampling, seeds=iter([1, 2])) == want
    assert generator.generate([], sampling, seeds=[]) == []


# ---------------------------------------------------------------------------------------------
# 6. Bad inputs: exception type and message fragment, in a child interpreter

PRELUDE = textwrap.dedent("""
    import torch, transformers
    from agentrl_fast.config.sampling import SamplingParams
    from agentrl_fast.generators.torch_generator import TorchGenerator
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    g = TorchGenerator(model)
    sp = SamplingParams(max_new_tokens=2)
""")

# name -> (expected exception type name, message fragment, statement)
CASES = {
    "valid_baseline": ("NoError", "", "assert len(g.generate([[1, 2], [3]], sp, seeds=[0, 1])) == 2"),
    "temperature_negative": ("ValueError", "temperature must be a finite number >= 0, got -1",
                             "SamplingParams(temperature=-1)"),
    "temperature_nan": ("ValueError", "temperature", "SamplingParams(temperature=float('nan'))"),
    "temperature_inf": ("ValueError", "temperature", "SamplingParams(temperature=float('inf'))"),
    "top_p_zero": ("ValueError", "top_p must be in (0, 1], got 0", "SamplingParams(top_p=0)"),
    "top_p_above_one": ("ValueError", "top_p must be in (0, 1], got 1.5", "SamplingParams(top_p=1.5)"),
    "top_p_nan": ("ValueError", "top_p", "SamplingParams(top_p=float('nan'))"),
    "top_k_negative": ("ValueError", "top_k must be an int >= 0 (0: off), got -1", "SamplingParams(top_k=-1)"),
    "top_k_float": ("ValueError", "top_k must be an int", "SamplingParams(top_k=2.5)"),
    "max_new_tokens_zero": ("ValueError", "max_new_tokens must be an int >= 1, got 0",
                            "SamplingParams(max_new_tokens=0)"),
    "empty_prompt": ("ValueError", "prompts[1] is empty", "g.generate([[1], []], sp)"),
    "prompt_float_id": ("TypeError", "prompts[0] must hold integer token ids, got dtype torch.float32",
                        "g.generate([[1.7, 2]], sp)"),
    "prompt_bool_tensor": ("TypeError", "prompts[0] must hold integer token ids",
                           "g.generate([torch.ones(2, dtype=torch.bool)], sp)"),
    "prompt_2d": ("ValueError", "prompts[0] must be 1-D", "g.generate([[[1, 2]]], sp)"),
    "prompt_id_too_large": ("ValueError", "prompts[1] holds token id 32, outside the model's vocabulary "
                            "[0, 32)", "g.generate([[1], [2, 32]], sp)"),
    "prompt_id_negative": ("ValueError", "prompts[0] holds token id -1", "g.generate([[-1]], sp)"),
    "prompt_empty_tensor": ("ValueError", "prompts[0] is empty",
                            "g.generate([torch.zeros(0, dtype=torch.long)], sp)"),
    "seeds_too_few": ("ValueError", "seeds has 1 entries for 2 prompts", "g.generate([[1], [2]], sp, seeds=[0])"),
    "seeds_too_many": ("ValueError", "seeds has 3 entries for 2 prompts",
                       "g.generate([[1], [2]], sp, seeds=[0, 1, 2])"),
    "on_tokens_not_callable": ("TypeError", "on_tokens must be callable as on_tokens(prompt index, "
                               "ids), got list", "g.generate([[1]], sp, on_tokens=[])"),
    "model_not_module": ("TypeError", "model must be a torch.nn.Module", "TorchGenerator(lambda x: x)"),
    "max_batch_size_zero": ("ValueError", "max_batch_size must be an int >= 1", "TorchGenerator(model, max_batch_size=0)"),
    "sampling_dict": ("TypeError", "sampling must be a SamplingParams, got dict",
                      "g.generate([[1]], {'temperature': 1.0})"),
}


outcomes, test_bad_input = bad_input_tests(PRELUDE, CASES)
