"""HF integration: packed forward passes through ``varlen_attention`` (agentrl_fast.models).

Tiny randomly initialized models built from configs in code (nothing downloaded), in float32 on
the CPU: on a packed row they give the logits and parameter gradients of each sequence run alone
(with transformers' own sdpa attention); the attention function receives no mask and no
``[L, L]`` tensor, calls the op with ``validate=False``, and ``cu_seqlens`` is validated once per
forward. Plus ``pack``/``unpack`` and the error messages (in a child interpreter).
"""

import copy
import importlib
import inspect
import textwrap

import pytest
import torch
import transformers
from error_cases import bad_input_tests

from agentrl_fast.models import (ATTN_NAME, pack, packed_attention_forward, packed_attention_mask,
                                 packed_forward, position_ids_from_cu_seqlens, register_attention,
                                 unpack, use_packed_attention)

attention_module = importlib.import_module("agentrl_fast.models.attention")

VOCAB = 128
LENGTHS = (1, 7, 0, 13, 5)  # T = 26: no model dimension equals it (head_dim 16, hidden 64)


def _tiny_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,  # GQA, 2 groups
                  max_position_embeddings=128, tie_word_embeddings=False,
                  initializer_range=0.2,  # peaked attention, so a leak across sequences shows
                  attention_dropout=0.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    if family == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    raise ValueError(family)


def _models(family: str, seed: int = 0):
    """(reference on transformers' sdpa, the same weights on packed attention), float32."""
    config, cls = _tiny_config(family)
    torch.manual_seed(seed)
    reference = cls(config).float()
    reference.set_attn_implementation("sdpa")
    packed = use_packed_attention(copy.deepcopy(reference))
    assert reference.config._attn_implementation == "sdpa"
    assert packed.config._attn_implementation == ATTN_NAME
    return reference, packed


def _sequences(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def _assert_close(got, want, what, rtol=1e-4):
    scale = max(float(want.abs().max()), 1e-12) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# pack / unpack


def test_pack_layout_and_round_trip():
    seqs = [torch.tensor([5, 6, 7]), [], [9], torch.tensor([1, 2, 3, 4], dtype=torch.int32), [8, 8]]
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(seqs)
    assert input_ids.dtype == torch.long and input_ids.shape == (1, 10)
    assert input_ids[0].tolist() == [5, 6, 7, 9, 1, 2, 3, 4, 8, 8]
    assert position_ids.dtype == torch.long
    assert position_ids[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 3, 4, 8, 10]
    assert isinstance(max_seqlen, int) and max_seqlen == 4
    assert position_ids_from_cu_seqlens(cu_seqlens, 10).tolist() == position_ids[0].tolist()
    # [1, T] and [T, ...] both split back, as views; empty sequences give empty tensors
    for packed in (input_ids, input_ids[0]):
        parts = unpack(packed, cu_seqlens)
        assert [p.tolist() for p in parts] == [list(map(int, s)) for s in seqs]
    hidden = torch.randn(1, 10, 3)
    parts = unpack(hidden, cu_seqlens.tolist())
    assert [tuple(p.shape) for p in parts] == [(3, 3), (0, 3), (1, 3), (4, 3), (2, 3)]
    assert parts[3].data_ptr() == hidden[0, 4].data_ptr()
    assert torch.equal(torch.cat(parts), hidden[0])


def test_pack_single_sequence_and_device():
    input_ids, position_ids, cu_seqlens, max_seqlen = pack([[3, 1, 2]], device="cpu")
    assert input_ids.tolist() == [[3, 1, 2]] and position_ids.tolist() == [[0, 1, 2]]
    assert cu_seqlens.tolist() == [0, 3] and max_seqlen == 3


# ---------------------------------------------------------------------------------------------
# Packed forward == each sequence alone: logits and parameter gradients


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_logits_and_gradients_match_each_sequence_alone(family):
    reference, packed = _models(family)
    seqs = _sequences()
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(seqs)
    num_tokens = input_ids.shape[1]
    weights = torch.randn(1, num_tokens, VOCAB, generator=torch.Generator().manual_seed(1))

    logits = packed_forward(packed, input_ids, position_ids, cu_seqlens, max_seqlen).logits
    assert logits.shape == (1, num_tokens, VOCAB)
    (logits * weights).sum().backward()

    per_sequence = unpack(logits.detach(), cu_seqlens)
    for seq, got, w in zip(seqs, per_sequence, unpack(weights, cu_seqlens)):
        if seq.numel() == 0:
            assert got.shape == (0, VOCAB)
            continue
        alone = reference(input_ids=seq.unsqueeze(0)).logits[0]
        _assert_close(got, alone.detach(), f"{family} logits of a sequence of {seq.numel()} tokens")
        (alone * w).sum().backward()  # gradients accumulate over the sequences

    named_reference = dict(reference.named_parameters())
    for name, param in packed.named_parameters():
        want = named_reference[name].grad
        assert param.grad is not None and want is not None, name
        _assert_close(param.grad, want, f"{family} gradient of {name}")

    # The comparison can see a leak: the same row as one sequence gives other logits.
    with torch.no_grad():
        one = torch.tensor([0, num_tokens], dtype=torch.int32)
        leaked = packed_forward(packed, input_ids, position_ids, one, num_tokens).logits
    assert (leaked - logits.detach()).abs().max() > 1e-2


def test_boundaries_from_position_ids_or_one_sequence():
    """Without cu_seq_lens_q: sequences restart where the position ids are 0 (nothing to
    validate); without position ids either, the row is one sequence."""
    reference, packed = _models("qwen3")
    seqs = _sequences()
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(seqs)
    with torch.no_grad():
        want = packed_forward(packed, input_ids, position_ids, cu_seqlens, max_seqlen).logits
        got = packed(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        _assert_close(got, want, "boundaries from position_ids")
        # no position ids: HF numbers the row 0..T-1 -> one sequence, like sdpa on the whole row
        whole = packed(input_ids=input_ids, use_cache=False).logits
        _assert_close(whole, reference(input_ids=input_ids).logits, "one sequence")


def test_inference_mode():
    """Under torch.inference_mode (tensors without version counters), both ways of passing the
    boundaries work and agree with the autograd-mode forward."""
    _, packed = _models("qwen3")
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(_sequences())
    with torch.no_grad():
        want = packed_forward(packed, input_ids, position_ids, cu_seqlens, max_seqlen).logits
    with torch.inference_mode():
        ids, pos, cu = input_ids.clone(), position_ids.clone(), cu_seqlens.clone()
        got = packed_forward(packed, ids, pos, cu, max_seqlen).logits
        direct = packed(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu.clone(),
                        cu_seq_lens_k=cu.clone(), max_length_q=max_seqlen, max_length_k=max_seqlen,
                        use_cache=False).logits
    assert torch.equal(got, want) and torch.equal(direct, want)


def test_position_ids_default_to_restarts_from_cu_seqlens():
    _, packed = _models("qwen3")
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(_sequences())
    with torch.no_grad():
        want = packed_forward(packed, input_ids, position_ids, cu_seqlens, max_seqlen).logits
        got = packed_forward(packed, input_ids[0], None, cu_seqlens, max_seqlen).logits
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# What the attention function receives; validation once per forward


class _Spy:
    """An attention function recording its arguments, then calling the real one; registered
    under its own name with the real mask function."""

    name = "agentrl_varlen_test_spy"

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.calls.append({"args": (query, key, value, attention_mask, *args), "kwargs": dict(kwargs)})
        return packed_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


@pytest.fixture
def spy_setup(monkeypatch):
    """(model on the spy attention, spy, validate-call counter, varlen_attention calls)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    spy = _Spy()
    monkeypatch.setitem(AttentionInterface._global_mapping, spy.name, spy)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, spy.name, packed_attention_mask)
    validations, op_calls = [], []
    real_validate, real_op = attention_module.validate_cu_seqlens, attention_module.varlen_attention

    def counting_validate(cu_seqlens, num_tokens, max_seqlen):
        validations.append((cu_seqlens.tolist(), num_tokens, max_seqlen))
        return real_validate(cu_seqlens, num_tokens, max_seqlen)

    def recording_op(q, k, v, cu_seqlens, max_seqlen, **kwargs):
        op_calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape),
                         "cu_seqlens": cu_seqlens.tolist(), "max_seqlen": max_seqlen, **kwargs})
        return real_op(q, k, v, cu_seqlens, max_seqlen, **kwargs)

    monkeypatch.setattr(attention_module, "validate_cu_seqlens", counting_validate)
    monkeypatch.setattr(attention_module, "varlen_attention", recording_op)
    _, model = _models("qwen3")
    model.set_attn_implementation(spy.name)
    assert model.config._attn_implementation == spy.name
    return model, spy, validations, op_calls


def _assert_no_square_tensor(call, length):
    tensors = [a for a in call["args"] if isinstance(a, torch.Tensor)]
    tensors += [v for v in call["kwargs"].values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        assert not (t.dim() >= 2 and t.shape[-1] == length and t.shape[-2] == length), (
            f"the attention function received a tensor of shape {tuple(t.shape)} ([..., L, L] mask)")


def test_attention_receives_no_mask_and_validates_once(spy_setup):
    model, spy, validations, op_calls = spy_setup
    layers = model.config.num_hidden_layers
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(_sequences())
    num_tokens = input_ids.shape[1]

    logits = packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen).logits
    logits.sum().backward()
    assert len(spy.calls) == layers
    for call in spy.calls:
        query, key, value, attention_mask = call["args"][:4]
        assert attention_mask is None
        assert query.shape == (1, 4, num_tokens, 16) and key.shape == value.shape == (1, 2, num_tokens, 16)
        assert call["kwargs"]["cu_seq_lens_q"].tolist() == cu_seqlens.tolist()
        assert call["kwargs"]["max_length_q"] == max_seqlen
        _assert_no_square_tensor(call, num_tokens)
    assert len(op_calls) == layers
    for call in op_calls:
        assert call["validate"] is False
        assert call["q"] == (num_tokens, 4, 16) and call["k"] == call["v"] == (num_tokens, 2, 16)
        assert call["cu_seqlens"] == cu_seqlens.tolist() and call["max_seqlen"] == max_seqlen
    assert validations == [(cu_seqlens.tolist(), num_tokens, max_seqlen)]  # once, up front

    # packed_forward(validate=False): no value check at all, and the caller's tensor is not
    # marked as validated (a later direct call with it checks it)
    validations.clear()
    packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen, validate=False)
    assert validations == []
    with torch.no_grad():
        model(input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=cu_seqlens,
              max_length_q=max_seqlen, use_cache=False)
    assert len(validations) == 1

    # A direct call with HF's flash-attention keyword arguments (int64 cu_seqlens, as HF's type
    # hint says): validated by the first layer only, once per forward.
    for _ in range(2):
        validations.clear()
        cu64 = cu_seqlens.long()  # a fresh tensor each forward
        with torch.no_grad():
            direct = model(input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=cu64,
                           cu_seq_lens_k=cu64.clone(), max_length_q=max_seqlen,
                           max_length_k=max_seqlen, use_cache=False).logits
        assert len(validations) == 1, validations
        _assert_close(direct, logits.detach(), "direct call with cu_seq_lens_q")

    # Boundaries from position ids: valid by construction, nothing validated.
    validations.clear()
    with torch.no_grad():
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    assert validations == []


def test_registration():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert register_attention() == ATTN_NAME
    assert AttentionInterface._global_mapping[ATTN_NAME] is packed_attention_forward
    assert AttentionMaskInterface._global_mapping[ATTN_NAME] is packed_attention_mask
    assert ATTN_NAME in AttentionInterface().valid_keys()
    # the mask function builds nothing (and accepts an all-ones 2-D mask)
    assert packed_attention_mask(1, q_length=5, kv_length=5) is None
    assert packed_attention_mask(1, 5, 5, attention_mask=torch.ones(1, 5, dtype=torch.bool)) is None


def test_mask_is_none_through_create_causal_mask():
    """transformers' own mask builder, given a packed row, returns None for packed attention
    (sdpa builds a [1, 1, T, T] mask for the same row)."""
    from transformers.masking_utils import create_causal_mask

    config, _ = _tiny_config("qwen3")
    input_ids, position_ids, _, _ = pack(_sequences())
    num_tokens = input_ids.shape[1]
    # The signature changed across transformers versions: name the arguments it has.
    available = {"config": config, "attention_mask": None, "position_ids": position_ids,
                 "inputs_embeds": torch.zeros(1, num_tokens, config.hidden_size),
                 "cache_position": torch.arange(num_tokens), "cache": None, "past_key_values": None}
    available["input_embeds"] = available["inputs_embeds"]
    parameters = inspect.signature(create_causal_mask).parameters
    kwargs = {name: value for name, value in available.items() if name in parameters}
    config._attn_implementation = "sdpa"
    sdpa_mask = create_causal_mask(**kwargs)
    assert sdpa_mask is not None and sdpa_mask.shape[-2:] == (num_tokens, num_tokens)
    config._attn_implementation = register_attention()
    assert create_causal_mask(**kwargs) is None


# ---------------------------------------------------------------------------------------------
# Bad inputs: exception type and message fragment, in a child interpreter


PRELUDE = textwrap.dedent("""
    import json, torch, transformers
    from agentrl_fast.models import pack, unpack, packed_forward, use_packed_attention

    def config(**kwargs):
        return transformers.Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                                        **kwargs)
    torch.manual_seed(0)
    # one config each: set_attn_implementation switches the config object, which models share
    model = use_packed_attention(transformers.Qwen3ForCausalLM(config()))
    plain = transformers.Qwen3ForCausalLM(config())
    ids, pos, cu, mx = pack([[1, 2, 3], [4, 5]])
""")

# name -> (expected exception type name, message fragment, statement)
CASES = {
    "valid_baseline": ("NoError", "", "packed_forward(model, ids, pos, cu, mx)"),
    "pack_empty_list": ("ValueError", "sequences is empty", "pack([])"),
    "pack_all_empty": ("ValueError", "all 2 sequences are empty", "pack([[], torch.zeros(0, dtype=torch.long)])"),
    "pack_2d_sequence": ("ValueError", "sequences[1] must be 1-D", "pack([[1], torch.zeros(2, 3, dtype=torch.long)])"),
    "pack_nested_list": ("TypeError", "sequences[0] must hold token ids", "pack([[1, [2]]])"),
    "pack_float_list": ("TypeError", "sequences[0] must hold token ids", "pack([[1.0, 2.0]])"),
    "pack_float_tensor": ("TypeError", "sequences[0] must hold integer token ids", "pack([torch.ones(3)])"),
    "pack_bool_tensor": ("TypeError", "must hold integer token ids", "pack([torch.ones(3, dtype=torch.bool)])"),
    "pack_tensor_batch": ("TypeError", "pass list(tensor)", "pack(torch.zeros(2, 3, dtype=torch.long))"),
    "pack_string": ("TypeError", "sequences must be a list", "pack('abc')"),
    "pack_not_sequence": ("TypeError", "sequences[0] must be a 1-D integer tensor or a list", "pack([5])"),
    "unpack_wrong_length": ("ValueError", "T = cu_seqlens[-1] = 5", "unpack(torch.zeros(1, 4, 3), cu)"),
    "unpack_decreasing": ("ValueError", "cu_seqlens must be non-decreasing", "unpack(torch.zeros(5), [0, 3, 2, 5])"),
    "unpack_first_nonzero": ("ValueError", "cu_seqlens must start with 0", "unpack(torch.zeros(5), [1, 5])"),
    "unpack_float_cu": ("TypeError", "cu_seqlens must hold integers", "unpack(torch.zeros(5), cu.float())"),
    "forward_not_switched": ("ValueError", "use_packed_attention(model)", "packed_forward(plain, ids, pos, cu, mx)"),
    "forward_cu_int64": ("TypeError", "cu_seqlens must be torch.int32", "packed_forward(model, ids, pos, cu.long(), mx)"),
    "forward_cu_last": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = 5, got 4",
                        "packed_forward(model, ids, pos, torch.tensor([0, 3, 4], dtype=torch.int32), mx)"),
    "forward_max_seqlen_small": ("ValueError", "max_seqlen = 2 is smaller than the longest sequence",
                                 "packed_forward(model, ids, pos, cu, 2)"),
    "forward_max_seqlen_tensor": ("TypeError", "max_seqlen must be a Python int",
                                  "packed_forward(model, ids, pos, cu, torch.tensor(3))"),
    "forward_batch_2": ("ValueError", "input_ids must be [1, T]",
                        "packed_forward(model, ids.expand(2, -1), pos, cu, mx)"),
    "forward_position_ids_shape": ("ValueError", "position_ids must be [1, T] with T = 5",
                                   "packed_forward(model, ids, pos[:, :4], cu, mx)"),
    "model_batch_2": ("ValueError", "batch size 2",
                      "model(input_ids=torch.ones(2, 4, dtype=torch.long), use_cache=False)"),
    "model_padding": ("ValueError", "does not support padding",
                      "model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]), use_cache=False)"),
    "model_cu_without_max": ("ValueError", "cu_seq_lens_q was passed without max_length_q",
                             "model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, use_cache=False)"),
    "model_bad_cu": ("ValueError", "cu_seqlens must be non-decreasing",
                     "model(input_ids=ids, position_ids=pos, cu_seq_lens_q=torch.tensor([0, 4, 3, 5], "
                     "dtype=torch.int32), max_length_q=4, use_cache=False)"),
    "model_cu_k_differs": ("ValueError", "cu_seq_lens_k must equal cu_seq_lens_q",
                           "model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu[:2], "
                           "max_length_q=mx, max_length_k=mx, use_cache=False)"),
    "model_dropout": ("ValueError", "does not support attention dropout",
                      "dropping = use_packed_attention(transformers.Qwen3ForCausalLM(config(attention_dropout=0.1))); "
                      "packed_forward(dropping.train(), ids, pos, cu, mx)"),
    "model_sliding_window": ("ValueError", "sliding_window = 2 < max_seqlen = 3",
                             "windowed = use_packed_attention(transformers.Qwen3ForCausalLM(config("
                             "use_sliding_window=True, sliding_window=2, max_window_layers=0))); "
                             "packed_forward(windowed, ids, pos, cu, mx)"),
    "model_sliding_window_longer": ("NoError", "",
                                    "windowed = use_packed_attention(transformers.Qwen3ForCausalLM(config("
                                    "use_sliding_window=True, sliding_window=3, max_window_layers=0))); "
                                    "packed_forward(windowed, ids, pos, cu, mx)"),
    # validate=False with garbage cu_seqlens: wrong numbers allowed, no crash
    "unvalidated_garbage": ("NoError", "",
                            "packed_forward(model, ids, pos, torch.tensor([0, 9, -4, 2**31 - 1], "
                            "dtype=torch.int32), 1, validate=False)"),
}


outcomes, test_bad_input = bad_input_tests(PRELUDE, CASES)


# ---------------------------------------------------------------------------------------------
# GPU: the same comparison in bfloat16 with the device's fastest backend


@pytest.mark.gpu
def test_cuda_bf16_packed_matches_each_sequence_alone():
    """bf16 on CUDA (backend "auto"): our error against a float32 per-sequence reference is at
    most a few times that of transformers' sdpa in bf16 on each sequence alone."""
    reference, packed = _models("qwen3")
    device = torch.device("cuda")
    reference32 = reference.to(device)
    sdpa16 = copy.deepcopy(reference).to(device, torch.bfloat16)
    packed16 = packed.to(device, torch.bfloat16)
    seqs = _sequences((1, 7, 0, 300, 45, 129))
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(seqs, device=device)
    with torch.no_grad():
        logits = packed_forward(packed16, input_ids, position_ids, cu_seqlens, max_seqlen).logits
        for seq, got in zip(seqs, unpack(logits, cu_seqlens)):
            if seq.numel() == 0:
                continue
            ids = seq.to(device).unsqueeze(0)
            want = reference32(input_ids=ids).logits[0]
            baseline = (sdpa16(input_ids=ids).logits[0].float() - want).abs().max()
            error = (got.float() - want).abs().max()
            assert error <= 3 * baseline + 1e-2 * want.abs().max(), (seq.numel(), error, baseline)


# ---------------------------------------------------------------------------------------------
# policy_logprobs(token_mask=...): the LM head and softmax on the asked rows only


@pytest.mark.parametrize("biased_head", [False, True])  # fused path; logits path (a bias)
def test_policy_logprobs_token_mask_matches_the_full_computation(biased_head):
    from agentrl_fast.models.policy import policy_logprobs
    from agentrl_fast.models.tiny import with_token_bias

    _, model = _models("qwen3", seed=int(torch.randint(0, 1000, ())))
    if biased_head:
        model = with_token_bias(model, {3: 0.5, 7: -1.0})
    sequences = _sequences(seed=int(torch.randint(0, 1000, ())))
    input_ids, position_ids, cu_seqlens, max_seqlen = pack(sequences)
    num_tokens = input_ids.shape[1]
    token_mask = torch.rand(num_tokens) < 0.5
    token_mask[cu_seqlens[:-1].long().clamp(max=num_tokens - 1)] = True  # first tokens: 0 anyway
    inputs = (input_ids, position_ids, cu_seqlens, max_seqlen)
    full_logp, full_entropy = policy_logprobs(model, *inputs, temperature=0.7,
                                              return_entropy=True)
    logp, entropy = policy_logprobs(model, *inputs, temperature=0.7, return_entropy=True,
                                    token_mask=token_mask)
    keep = token_mask.float()
    _assert_close(logp, full_logp * keep, "logp on the masked tokens, 0 elsewhere", rtol=1e-5)
    _assert_close(entropy, full_entropy * keep, "entropy", rtol=1e-5)
    assert bool((logp[~token_mask] == 0).all()) and bool((entropy[~token_mask] == 0).all())
    parameters = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(num_tokens)
    want = torch.autograd.grad(((full_logp + full_entropy) * keep * weights).sum(), parameters)
    got = torch.autograd.grad(((logp + entropy) * weights).sum(), parameters)
    for g, w in zip(got, want):
        _assert_close(g, w, "parameter gradient", rtol=1e-5)
    nothing = policy_logprobs(model, *inputs, token_mask=torch.zeros(num_tokens, dtype=torch.bool))
    assert nothing.shape == (num_tokens,) and bool((nothing == 0).all())
    with pytest.raises(ValueError, match="token_mask must be a bool tensor of shape"):
        policy_logprobs(model, *inputs, token_mask=token_mask.float())
    with pytest.raises(ValueError, match="token_mask must be a bool tensor of shape"):
        policy_logprobs(model, *inputs, token_mask=token_mask[:-1])
