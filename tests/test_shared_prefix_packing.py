"""Shared-prefix (tree) packing, the model side (issue 47): the layout of
:func:`agentrl_fast.models.packing.pack_shared` (groups, positions, maps back to the plain
packing) and, on tiny float32 HF models built in code, policy log-probs, entropies, critic values,
a shared value head's values and parameter gradients with sharing equal to the plain packing of
the same sub-traces, for the native (CPU default) and the reference attention backends and with
fused layers."""

import importlib
import itertools
import random

import pytest
import torch

from agentrl_fast.harness.trajectory import SubTrace
from agentrl_fast.models import use_packed_attention
from agentrl_fast.models.critic import ValueHead, critic_values, make_critic
from agentrl_fast.models.fused import use_fused_layers
from agentrl_fast.models.packing import (SharedLayout, pack, pack_shared,
                                         position_ids_from_cu_seqlens)
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.ops.varlen_attention import BACKENDS
from agentrl_fast.train.packing import pack_sub_traces

attention_module = importlib.import_module("agentrl_fast.models.attention")

VOCAB = 96


# ---------------------------------------------------------------------------------------------
# The layout, checked against what it must mean.


def check_layout(layout: SharedLayout, sequences, shareable):
    """Every sequence reads back from its rows with positions 0..n-1, its rows are a prefix
    segment (read by its suffix through ``prefix_of``) then its own segment, rows shared by
    several sequences lie within each one's shareable tokens, and the maps agree."""
    ids, positions = layout.input_ids[0].tolist(), layout.position_ids[0].tolist()
    cu, parent = layout.cu_seqlens.tolist(), layout.prefix_of.tolist()
    segment_of = [s for s in range(len(cu) - 1) for _ in range(cu[s + 1] - cu[s])]
    assert len(ids) == len(positions) == cu[-1] == len(segment_of)
    assert layout.max_seqlen == max(b - a for a, b in itertools.pairwise(cu))
    rows, prev, last = layout.rows.tolist(), layout.prev_rows.tolist(), layout.last_rows.tolist()
    assert len(rows) == len(prev) == sum(map(len, sequences)) == layout.num_tokens
    readers: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for b, sequence in enumerate(sequences):
        mine = rows[start:start + len(sequence)]
        assert [ids[r] for r in mine] == list(sequence)
        assert [positions[r] for r in mine] == list(range(len(sequence)))
        assert prev[start:start + len(sequence)] == ([-1] + mine[:-1] if mine else [])
        assert last[b] == (mine[-1] if mine else -1)
        segments = [segment_of[r] for r in mine]
        if len(set(segments)) == 2:  # its prefix segment, then its own (a suffix of it)
            p, own = segments[0], segments[-1]
            assert parent[own] == p and parent[p] == -1 and p < own
        elif mine:  # a sequence on its own, or wholly a shared prefix
            assert len(set(segments)) == 1 and parent[segments[0]] == -1
        assert segments == sorted(segments)
        for s in set(segments):  # whole segments, in order
            assert [r for r in mine if segment_of[r] == s] == list(range(cu[s], cu[s + 1]))
        for j, r in enumerate(mine):
            readers.setdefault(r, []).append((b, j))
        start += len(sequence)
    for r, who in readers.items():
        if len(who) > 1:
            assert all(j < shareable[b] for b, j in who), (r, who)
    assert layout.saved_tokens == layout.num_tokens - len(ids)
    assert layout.shares == any(p >= 0 for p in parent)
    assert layout.cu_seqlens.dtype == layout.prefix_of.dtype == torch.int32
    want = position_ids_from_cu_seqlens(layout.cu_seqlens, len(ids), layout.prefix_of)
    assert want.tolist() == positions


def test_groups_positions_and_maps():
    system = list(range(10, 30))  # 20 tokens
    sequences = [system + [1, 2, 3], system + [4, 5], [7, 8, 9], system[:10] + [9], [],
                 system, [5]]
    shareable = [20, 20, 3, 11, 0, 20, 1]
    layout = pack_shared(sequences, shareable)
    check_layout(layout, sequences, shareable)
    # [system][1 2 3][4 5] | [7 8 9] | [system[:10] 9] | [5]: sequence 3 shares only 10 tokens,
    # worth less than keeping the 20-token prefix for 0, 1 and 5; sequence 5 is all prefix.
    assert layout.cu_seqlens.tolist() == [0, 20, 23, 25, 28, 39, 40]
    assert layout.prefix_of.tolist() == [-1, 0, 0, -1, -1, -1]
    assert layout.position_ids[0, 20:25].tolist() == [20, 21, 22, 20, 21]
    assert layout.prev_rows[23:26].tolist() == [-1, 0, 1]
    assert layout.prev_rows[43:45].tolist() == [19, 23]  # the first suffix token reads row 19
    assert layout.last_rows.tolist() == [22, 24, 27, 38, -1, 19, 39]
    assert layout.saved_tokens == 40 and layout.shares
    assert layout.max_seqlen == 20


def test_nothing_shareable_is_the_plain_packing():
    gen = random.Random(0)
    sequences = [[gen.randrange(VOCAB) for _ in range(n)] for n in (5, 1, 0, 12)]
    for shareable in ([0, 0, 0, 0], [5, 1, 0, 12]):  # nothing allowed; nothing in common
        layout = pack_shared(sequences, shareable)
        check_layout(layout, sequences, shareable)
        input_ids, position_ids, _, max_seqlen = pack(sequences)
        assert torch.equal(layout.input_ids, input_ids)
        assert torch.equal(layout.position_ids, position_ids)
        assert layout.cu_seqlens.tolist() == [0, 5, 6, 18]  # the empty sequence has no segment
        assert torch.equal(layout.rows, torch.arange(18))
        assert not layout.shares and layout.saved_tokens == 0 and layout.max_seqlen == max_seqlen
        assert layout.attention_prefix_of is None
    empty = pack_shared([[], []], [0, 0])
    assert empty.cu_seqlens.tolist() == [0, 0] and empty.num_tokens == 0
    assert empty.last_rows.tolist() == [-1, -1]


def test_min_prefix_and_identical_sequences():
    common = list(range(40, 47))  # 7 tokens: one short of the default minimum
    sequences = [common + [1, 2], common + [3, 4]]
    assert pack_shared(sequences, [9, 9]).saved_tokens == 0
    layout = pack_shared(sequences, [9, 9], min_prefix=7)
    check_layout(layout, sequences, [9, 9])
    assert layout.saved_tokens == 7 and layout.prefix_of.tolist() == [-1, 0, 0]
    same = [list(range(12))] * 3
    layout = pack_shared(same, [10, 10, 10])  # action tokens from 10 on: never shared
    check_layout(layout, same, [10, 10, 10])
    assert layout.cu_seqlens.tolist() == [0, 10, 12, 14, 16] and layout.saved_tokens == 20
    whole = pack_shared(same, [12, 12, 12])  # no action tokens: all in the prefix, no suffix
    check_layout(whole, same, [12, 12, 12])
    assert whole.cu_seqlens.tolist() == [0, 12] and whole.saved_tokens == 24
    assert not whole.shares and whole.last_rows.tolist() == [11, 11, 11]
    with pytest.raises(ValueError, match=r"shareable\[1\] must be an int >= 0"):
        pack_shared(same, [1, -1, 0])
    with pytest.raises(ValueError, match="shareable must be a list of 3 ints"):
        pack_shared(same, [1, 1])
    with pytest.raises(ValueError, match="min_prefix must be an int >= 1"):
        pack_shared(same, [1, 1, 1], min_prefix=0)


def test_random_layouts_keep_their_invariants():
    gen = random.Random(1)
    prompts = [[gen.randrange(VOCAB) for _ in range(gen.randrange(0, 30))] for _ in range(4)]
    for _ in range(200):
        sequences, shareable = [], []
        for _ in range(gen.randrange(1, 9)):
            head = gen.choice(prompts)[:gen.randrange(0, 31)]
            tail = [gen.randrange(VOCAB) for _ in range(gen.randrange(0, 6))]
            sequences.append(head + tail)
            shareable.append(gen.randrange(0, len(head) + len(tail) + 2))
        check_layout(pack_shared(sequences, shareable, min_prefix=gen.choice([1, 4, 8])),
                     sequences, shareable)


# ---------------------------------------------------------------------------------------------
# Sub-traces like a rollout's: several share a system + task prompt, then differ.


def _sub_trace(name: str, context: list[int], turns: list[tuple[list[int], list[int]]],
               end: str = "terminal") -> SubTrace:
    trace = SubTrace(rollout_id=name)
    trace.append_context(context)
    for action, observation in turns:
        trace.append_action(action, [-0.5] * len(action))
        trace.append_context(observation)
    trace.add_reward(1.0)
    trace.close(end)
    return trace


def sub_traces(seed: int = 0) -> list[SubTrace]:
    """Three tasks (a 24-token system prompt, then a task prompt): task a's three samples, task
    b's two (one with two sub-traces), a lone task c; a one-token sub-trace; one whose first
    token is an action."""
    gen = random.Random(seed)

    def ids(n):
        return [gen.randrange(VOCAB) for _ in range(n)]

    system = ids(24)
    tasks = {name: system + ids(n) for name, n in (("a", 17), ("b", 9), ("c", 5))}
    traces = [_sub_trace(f"{task}{i}", tasks[task], [(ids(gen.randrange(3, 9)), ids(6))
                                                       for _ in range(gen.randrange(1, 3))])
              for task, i in (("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("b", 1))]
    # b0's second sub-trace restarts from the task prompt and a summary
    traces.append(_sub_trace("b0", tasks["b"] + ids(4), [(ids(5), [])], end="truncated"))
    traces[-1].index = 1
    traces.append(SubTrace(rollout_id="one", ids=[3], action_mask=[0], logprobs=[0.0],
                           rewards=[0.0], end="terminal"))
    traces.append(SubTrace(rollout_id="act", ids=tasks["a"][:3] + [4], action_mask=[1, 0, 1, 1],
                           logprobs=[-1.0, 0.0, -1.0, -1.0], rewards=[0.0] * 4, end="terminal"))
    return traces


def test_pack_sub_traces_shares_prompts_only():
    traces = sub_traces()
    plain = pack_sub_traces(traces)
    batch = pack_sub_traces(traces, share_prefixes=True)
    assert plain.shared is None
    for name in ("input_ids", "position_ids", "cu_seqlens", "action_mask", "rollout_logprobs",
                 "rewards", "rollout_index"):
        assert torch.equal(getattr(batch, name), getattr(plain, name)), name
    shareable = [next((i for i, a in enumerate(t.action_mask) if a), len(t.ids)) for t in traces]
    check_layout(batch.shared, [t.ids for t in traces], shareable)
    assert shareable[-1] == 0  # the sub-trace opening with an action shares nothing
    shared_rows = batch.shared.rows[batch.action_mask]  # action tokens: rows of their own
    assert shared_rows.unique().numel() == shared_rows.numel()
    # one level: task a's 41-token prompt x 3; b's three sub-traces and c share only the
    # 24-token system prompt, which saves more (3 x 24) than b's 33-token prompt alone (2 x 33)
    assert batch.shared.saved_tokens == 2 * 41 + 3 * 24
    assert batch.shared.prefix_of.tolist() == [-1, 0, 0, 0, -1, 4, 4, 4, 4, -1, -1]
    moved = batch.to("meta")
    assert moved.shared.rows.device.type == "meta"
    assert moved.shared.max_seqlen == batch.shared.max_seqlen
    assert batch.shared.rows.device.type == "cpu"


# ---------------------------------------------------------------------------------------------
# The models: sharing gives the plain packing's outputs and gradients.


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max()) if want.numel() else 0.0


def _assert_close(got, want, what, rtol=1e-4):
    scale = max(float(want.detach().abs().max()), 1e-6) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")
    return _max_diff(got, want)


class _Calls(list):
    """The prefix_of of each attention call, and the backend's name."""
    name: str


@pytest.fixture
def backend(request, monkeypatch):
    """Run the models' attention on ``request.param``; record its prefix_of calls."""
    calls = _Calls()
    calls.name = request.param
    real = attention_module.varlen_attention

    def op(*args, **kwargs):
        calls.append(kwargs.get("prefix_of"))
        return real(*args, backend=request.param, **kwargs)

    monkeypatch.setattr(attention_module, "varlen_attention", op)
    return calls


def _policy(fused: bool, seed: int = 3):
    policy = tiny_qwen3(VOCAB, seed=seed)  # GQA: 4 query heads, 2 key/value heads
    with torch.no_grad():  # larger weights: peaked attention, so a wrong key set shows
        for name, parameter in policy.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4)
    if fused:
        use_fused_layers(policy)
    return use_packed_attention(policy)


def _grads(loss: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    parameters = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, parameters, allow_unused=True))


def _compare_grads(got, want, what) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.abs().any()
            continue
        worst = max(worst, _assert_close(g, w, what, rtol=2e-4))
    return worst


CASES = [("native", False), ("reference", False), ("native", True)]


@pytest.mark.parametrize("backend,fused", CASES, indirect=["backend"],
                         ids=[f"{b}{'-fused' if f else ''}" for b, f in CASES])
def test_policy_logprobs_entropy_and_gradients_match(backend, fused):
    policy = _policy(fused)
    batch = pack_sub_traces(sub_traces(), share_prefixes=True)
    inputs = (batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(0))
    worst = {}
    for mask in (None, batch.action_mask):
        backend.clear()
        got = policy_logprobs(policy, *inputs, temperature=0.8, return_entropy=True,
                              token_mask=mask, layout=batch.shared)
        assert backend and all(p is not None for p in backend)  # the prefix-shared op ran
        want = policy_logprobs(policy, *inputs, temperature=0.8, return_entropy=True,
                               token_mask=mask)
        for name, g, w in zip(("logp", "entropy"), got, want):
            worst[name] = max(worst.get(name, 0.0), _assert_close(g, w, name))
        losses = [((out[0] + 0.1 * out[1]) * weights).sum() for out in (got, want)]
        worst["grad"] = max(worst.get("grad", 0.0), _compare_grads(
            _grads(losses[0], policy), _grads(losses[1], policy), "policy gradient"))
        if mask is not None:
            assert bool((got[0][~mask] == 0).all())
    print(f"\npolicy, max |shared - plain|: {worst}, saved {batch.shared.saved_tokens} of "
          f"{batch.num_tokens} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "reference"], indirect=True)
def test_cuda_policy_logprobs_and_gradients_match(backend):
    """On CUDA in float32 (the Triton kernels' ieee dots; the reference's generic path): shared
    == plain log-probs, entropies and gradients. (torch's and flash-attn's kernels take no
    float32: tests/test_varlen_attention_prefix.py checks them in bf16/fp16.)"""
    reason = BACKENDS[backend.name].unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"backend {backend.name!r} unavailable: {reason}")
    policy = _policy(fused=False).cuda()
    batch = pack_sub_traces(sub_traces(), share_prefixes=True).to("cuda")
    inputs = (batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(0)).cuda()
    got = policy_logprobs(policy, *inputs, temperature=0.8, return_entropy=True,
                          layout=batch.shared)
    assert backend and all(p is not None for p in backend)  # the prefix-shared op ran
    want = policy_logprobs(policy, *inputs, temperature=0.8, return_entropy=True)
    rtol = 2e-4
    for name, g, w in zip(("logp", "entropy"), got, want):
        _assert_close(g, w, name, rtol=rtol)
    losses = [((out[0] + 0.1 * out[1]) * weights).sum() for out in (got, want)]
    for g, w in zip(_grads(losses[0], policy), _grads(losses[1], policy)):
        if w is not None:
            _assert_close(g, w, "policy gradient", rtol=10 * rtol)


@pytest.mark.parametrize("backend", ["native", "reference"], indirect=True)
def test_critic_and_shared_value_head_match(backend):
    policy = _policy(fused=False, seed=4)
    critic = make_critic(policy)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        critic.score.weight.copy_(torch.randn(critic.score.weight.shape, generator=gen))
    head = ValueHead(policy.config.hidden_size)
    with torch.no_grad():
        head.score.weight.copy_(torch.randn(head.score.weight.shape, generator=gen))
    batch = pack_sub_traces(sub_traces(seed=2), share_prefixes=True)
    inputs = (batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
    weights = torch.randn(batch.num_tokens, generator=gen)
    last_weights = torch.randn(batch.num_sequences, generator=gen)
    worst = {}

    def loss(values):
        return (values[0] * weights).sum() + (values[1] * last_weights).sum()

    got = critic_values(critic, *inputs, layout=batch.shared)
    want = critic_values(critic, *inputs)
    worst["values"] = _assert_close(got[0], want[0], "values")
    worst["last_values"] = _assert_close(got[1], want[1], "last values")
    worst["critic grad"] = _compare_grads(_grads(loss(got), critic), _grads(loss(want), critic),
                                          "critic gradient")
    for mask in (batch.action_mask, None):  # the value head reads every token's hidden state
        outputs = []
        for layout in (batch.shared, None):
            logp, hidden = policy_logprobs(policy, *inputs, return_hidden=True, token_mask=mask,
                                           layout=layout)
            assert hidden.shape == (batch.num_tokens, policy.config.hidden_size)
            values = head(hidden, batch.cu_seqlens)
            outputs.append((values, _grads(loss(values) + (logp * weights).sum(),
                                           torch.nn.ModuleList([policy, head]))))
        (got, got_grads), (want, want_grads) = outputs
        worst["head values"] = max(_assert_close(got[0], want[0], "head values"),
                                   _assert_close(got[1], want[1], "head last values"))
        worst["head grad"] = _compare_grads(got_grads, want_grads, "policy + head gradient")
    print(f"\ncritic, max |shared - plain|: {worst}")


def _on_another_attention(model, monkeypatch) -> None:
    """Switch ``model`` to a wrapper of our attention (it reads cu_seqlens, not prefix_of)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def wrapper(*args, **kwargs):
        return attention_module.packed_attention_forward(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "wrapped_varlen", wrapper)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "wrapped_varlen",
                        attention_module.packed_attention_mask)
    model.set_attn_implementation("wrapped_varlen")


def test_direct_model_call_and_bad_input(monkeypatch):
    """``prefix_of`` through a plain ``model(...)`` call (checked by the first layer), and the
    errors: no ``cu_seq_lens_q``, a wrong ``prefix_of``, another attention, a wrong layout."""
    policy = _policy(fused=False)
    batch = pack_sub_traces(sub_traces(), share_prefixes=True)
    layout = batch.shared
    ids, positions, cu, longest = layout.model_inputs()
    direct = policy(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=longest, max_length_k=longest, prefix_of=layout.prefix_of,
                    use_cache=False).logits[0]
    via = attention_module.packed_forward(policy, *layout.model_inputs(),
                                          prefix_of=layout.prefix_of).logits[0]
    _assert_close(direct, via, "direct call")
    implied = attention_module.packed_forward(policy, ids, None, cu, longest,
                                              prefix_of=layout.prefix_of).logits[0]
    _assert_close(implied, via, "position ids built from cu_seqlens and prefix_of")
    with pytest.raises(ValueError, match="prefix_of was passed without cu_seq_lens_q"):
        policy(input_ids=ids, position_ids=positions, prefix_of=layout.prefix_of, use_cache=False)
    bad = layout.prefix_of.clone()
    bad[1] = 5
    with pytest.raises(ValueError, match=r"prefix_of\[1\] = 5"):
        attention_module.packed_forward(policy, *layout.model_inputs(), prefix_of=bad)
    with pytest.raises(ValueError, match=r"prefix_of\[1\] = 5"):
        policy(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, max_length_q=longest,
               prefix_of=bad, use_cache=False)
    _on_another_attention(policy, monkeypatch)
    with pytest.raises(ValueError, match="prefix_of needs the model on packed attention"):
        attention_module.packed_forward(policy, *layout.model_inputs(), prefix_of=layout.prefix_of)
    use_packed_attention(policy)
    with pytest.raises(ValueError, match="layout describes"):
        policy_logprobs(policy, batch.input_ids[:, :-1], batch.position_ids[:, :-1],
                        batch.cu_seqlens, batch.max_seqlen, layout=layout)


def test_a_sliding_window_counts_the_shared_prefix():
    # A suffix attends its prefix too: a window shorter than prefix + suffix must refuse, even
    # though every segment alone fits in it.
    from agentrl_fast.models.attention import packed_attention_forward
    q = torch.randn(1, 2, 7, 8)
    meta = dict(cu_seq_lens_q=torch.tensor([0, 4, 7], dtype=torch.int32), max_length_q=4,
                prefix_of=torch.tensor([-1, 0], dtype=torch.int32))
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=r"sliding_window = 5 < the longest prefix \+ suffix = 7"):
        packed_attention_forward(module, q, q, q, None, sliding_window=5, **meta)
    out, _ = packed_attention_forward(module, q, q, q, None, sliding_window=7, **meta)
    assert out.shape == (1, 7, 2, 8)
