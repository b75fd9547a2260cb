"""Token-budget micro-batches, balanced data-parallel partitions and packing sub-traces
(agentrl_fast.train.packing): partitions are exact, within budget, no worse than first-fit
decreasing, deterministic; packed tensors match hand-computed layouts."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_fast.harness.trajectory import SubTrace
from agentrl_fast.models.packing import position_ids_from_cu_seqlens
from agentrl_fast.train.packing import (PackedBatch, balanced_partition, micro_batches,
                                        pack_sub_traces, rollout_index_map)

# ---------------------------------------------------------------------------------------------
# References, written independently of the module.


def reference_ffd(lengths, budget):
    """Textbook first-fit decreasing (longest first, ties by index), O(N * bins)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads, bins = [], []
    for i in order:
        for b in range(len(loads)):
            if loads[b] + lengths[i] <= budget:
                loads[b] += lengths[i]
                bins[b].append(i)
                break
        else:
            loads.append(lengths[i])
            bins.append([i])
    return bins


def loads_of(lengths, groups):
    return [sum(lengths[i] for i in g) for g in groups]


def assert_partition(groups, n):
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n)), "every index exactly once"
    for g in groups:
        assert g == sorted(g), "indices ascending within a group"


def budget_and_lengths():
    """(token_budget, lengths <= budget): often with zeros, ones and budget-sized sequences."""
    return st.integers(1, 300).flatmap(lambda budget: st.tuples(st.just(budget), st.lists(
        st.one_of(st.just(0), st.just(1), st.just(budget), st.integers(0, budget),
                  st.integers(0, max(1, budget // 4))), max_size=60)))


# ---------------------------------------------------------------------------------------------
# micro_batches


@settings(max_examples=300, deadline=None)
@given(budget_and_lengths())
def test_micro_batches_properties(case):
    budget, lengths = case
    groups = micro_batches(lengths, budget)
    assert_partition(groups, len(lengths))
    loads = loads_of(lengths, groups)
    assert all(load <= budget for load in loads), f"over budget: {loads}"
    assert all(groups), "no empty micro-batch"
    assert [g[0] for g in groups] == sorted(g[0] for g in groups), "ordered by first index"
    ffd = reference_ffd(lengths, budget)
    assert len(groups) <= len(ffd)
    if lengths:
        assert max(loads) <= max(loads_of(lengths, ffd)), "no less balanced than FFD"
    # determinism, whatever container the lengths come in
    assert micro_batches(lengths, budget) == groups
    assert micro_batches(tuple(lengths), budget) == groups
    assert micro_batches(torch.tensor(lengths, dtype=torch.int64), budget) == groups


def test_micro_batches_balances_better_than_ffd():
    lengths = [5, 4, 3, 3, 3, 2]
    # FFD: {5, 4}, {3, 3, 3}, {2}: loads 9, 9, 2
    assert loads_of(lengths, reference_ffd(lengths, 10)) == [9, 9, 2]
    groups = micro_batches(lengths, 10)
    assert groups == [[0, 5], [1, 4], [2, 3]]  # loads 7, 7, 6
    assert loads_of(lengths, groups) == [7, 7, 6]


def test_micro_batches_edge_cases():
    assert micro_batches([], 8) == []
    assert micro_batches([0, 0, 0], 1) == [[0, 1, 2]]  # zero-length sequences cost nothing
    assert micro_batches([4, 4, 4], 4) == [[0], [1], [2]]  # each exactly the budget
    assert micro_batches([4, 0, 4, 0], 4) in ([[0, 1, 3], [2]], [[0, 1], [2, 3]], [[0, 3], [1, 2]],
                                              [[0], [1, 2, 3]])
    assert micro_batches([1] * 10, 100) == [list(range(10))]
    assert micro_batches([7], 7) == [[0]]


@pytest.mark.parametrize("seed", [0, 1])
def test_micro_batches_large_batch_is_fast_and_tight(seed):
    import time
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, rng.randint(1, 64), rng.randint(1, 4096)]) for _ in range(4096)]
    start = time.perf_counter()
    groups = micro_batches(lengths, 8192)
    elapsed = time.perf_counter() - start
    assert_partition(groups, len(lengths))
    loads = loads_of(lengths, groups)
    ffd = reference_ffd(lengths, 8192)
    assert len(groups) == len(ffd) and max(loads) <= 8192
    assert max(loads) - min(loads) <= max(loads_of(lengths, ffd)) - min(loads_of(lengths, ffd))
    assert elapsed < 2.0, f"micro_batches took {elapsed:.2f} s for 4096 sequences"


def test_micro_batches_errors():
    with pytest.raises(ValueError, match=r"sequence 3 has 900 tokens, more than token_budget=512; "
                                         r"raise token_budget"):
        micro_batches([10, 20, 30, 900], 512)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"token_budget must be a positive int, got {bad}"):
            micro_batches([1, 2], bad)
    for bad in (2.5, 512.0, "512", True, None):
        with pytest.raises(TypeError, match="token_budget must be an int"):
            micro_batches([1, 2], bad)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -3: a sequence length must be >= 0"):
        micro_batches([1, -3], 8)
    with pytest.raises(TypeError, match=r"lengths\[0\] must be an int"):
        micro_batches([1.5], 8)
    with pytest.raises(TypeError, match="lengths must be a sequence of ints"):
        micro_batches({1, 2}, 8)
    with pytest.raises(TypeError, match="lengths must hold integers"):
        micro_batches(torch.tensor([1.0, 2.0]), 8)
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        micro_batches(torch.tensor([[1, 2]]), 8)


# ---------------------------------------------------------------------------------------------
# balanced_partition


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.just(0), st.integers(0, 50), st.integers(0, 5000)), max_size=80),
       st.integers(1, 12))
def test_balanced_partition_properties(lengths, parts):
    groups = balanced_partition(lengths, parts)
    assert len(groups) == parts
    assert_partition(groups, len(lengths))
    loads = loads_of(lengths, groups)
    assert max(loads) - min(loads) <= max(lengths, default=0), (
        f"per-part token counts differ by more than one sequence: {loads}")
    nonempty = [g for g in groups if g]
    assert groups[:len(nonempty)] == nonempty, "empty groups last"
    assert [g[0] for g in nonempty] == sorted(g[0] for g in nonempty)
    assert balanced_partition(lengths, parts) == groups
    assert balanced_partition(list(lengths), parts) == groups


def test_balanced_partition_examples():
    assert balanced_partition([3, 1], 4) == [[0], [1], [], []]
    assert balanced_partition([], 3) == [[], [], []]
    assert balanced_partition([5, 5, 5], 1) == [[0, 1, 2]]
    groups = balanced_partition([8, 7, 6, 5, 4], 2)  # 30 tokens: LPT gives 17/13, best is 15/15
    assert sorted(loads_of([8, 7, 6, 5, 4], groups)) == [15, 15]
    rng = random.Random(0)
    lengths = [rng.randint(0, 4096) for _ in range(2048)]
    loads = loads_of(lengths, balanced_partition(lengths, 8))
    assert max(loads) - min(loads) <= 1


def test_balanced_partition_errors():
    with pytest.raises(ValueError, match="parts must be a positive int, got 0"):
        balanced_partition([1, 2], 0)
    with pytest.raises(TypeError, match="parts must be an int"):
        balanced_partition([1, 2], 2.0)
    with pytest.raises(ValueError, match=r"lengths\[0\] = -1"):
        balanced_partition([-1], 2)


# ---------------------------------------------------------------------------------------------
# pack_sub_traces


def make_sub_trace(rollout_id, index, steps, reward=None, end="terminal"):
    """``steps``: ("c", ids) context or ("a", ids, logprobs) action."""
    sub_trace = SubTrace(rollout_id, index=index)
    for step in steps:
        if step[0] == "c":
            sub_trace.append_context(step[1])
        else:
            sub_trace.append_action(step[1], step[2])
    if reward is not None:
        sub_trace.add_reward(reward)
    sub_trace.close(end)
    return sub_trace


@pytest.fixture
def sub_traces():
    return [
        make_sub_trace("r0", 0, [("c", [1, 2, 3]), ("a", [4, 5], [-0.5, -0.25]), ("c", [6])],
                       reward=1.0, end="continued"),
        make_sub_trace("r1", 0, [], end="truncated"),  # empty
        make_sub_trace("r0", 1, [("c", [7]), ("a", [8], [-1.0])], reward=0.5),
        make_sub_trace("r2", 0, [("c", [9])], end="truncated"),  # length 1
        make_sub_trace("r1", 1, [("c", [10, 11]), ("a", [12], [-2.0])], reward=-1.0),
    ]


def test_pack_sub_traces_layout(sub_traces):
    batch = pack_sub_traces(sub_traces)
    assert isinstance(batch, PackedBatch)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 0, 0, 1, 2]]
    assert batch.cu_seqlens.tolist() == [0, 6, 6, 8, 9, 12]
    assert batch.max_seqlen == 6
    assert batch.action_mask.tolist() == [False, False, False, True, True, False,
                                          False, True, False, False, False, True]
    assert batch.rollout_logprobs.tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, -1.0, 0, 0, 0, -2.0]
    assert batch.rewards.tolist() == [0, 0, 0, 0, 1.0, 0, 0, 0.5, 0, 0, 0, -1.0]
    assert batch.rollout_index.tolist() == [0, 1, 0, 2, 1]  # r0, r1, r0, r2, r1
    assert batch.indices == [0, 1, 2, 3, 4]
    assert batch.ends == ["continued", "truncated", "terminal", "truncated", "terminal"]
    assert batch.lengths == [6, 0, 2, 1, 3]
    assert batch.num_tokens == 12 and batch.num_sequences == 5
    dtypes = {"input_ids": torch.int64, "position_ids": torch.int64, "cu_seqlens": torch.int32,
              "action_mask": torch.bool, "rollout_logprobs": torch.float32,
              "rewards": torch.float32, "rollout_index": torch.int64}
    shapes = {"input_ids": (1, 12), "position_ids": (1, 12), "cu_seqlens": (6,),
              "action_mask": (12,), "rollout_logprobs": (12,), "rewards": (12,),
              "rollout_index": (5,)}
    for name, dtype in dtypes.items():
        assert getattr(batch, name).dtype == dtype, name
        assert tuple(getattr(batch, name).shape) == shapes[name], name
    assert torch.equal(batch.position_ids[0], position_ids_from_cu_seqlens(batch.cu_seqlens, 12))
    # against each sub-trace's own tensors
    for sub_trace, ids, mask, lp, rw in zip(sub_traces, batch.split(batch.input_ids),
                                            batch.split(batch.action_mask),
                                            batch.split(batch.rollout_logprobs),
                                            batch.split(batch.rewards)):
        own = sub_trace.to_tensors()
        assert torch.equal(ids, own["ids"]) and torch.equal(mask, own["action_mask"])
        assert torch.equal(lp, own["logprobs"]) and torch.equal(rw, own["rewards"])


def test_pack_sub_traces_subset_keeps_global_rollout_numbering(sub_traces):
    batch = pack_sub_traces(sub_traces, [4, 3, 0])  # packed in the order given
    assert batch.indices == [4, 3, 0]
    assert batch.input_ids.tolist() == [[10, 11, 12, 9, 1, 2, 3, 4, 5, 6]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 5]]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 10]
    assert batch.rollout_index.tolist() == [1, 2, 0]  # numbering of the whole list
    assert batch.ends == ["terminal", "truncated", "continued"]
    # a slice of the global list keeps the global numbering when given the global map
    index = rollout_index_map(sub_traces)
    assert index == {"r0": 0, "r1": 1, "r2": 2}
    sliced = pack_sub_traces(sub_traces[3:], rollout_index=index)
    assert sliced.rollout_index.tolist() == [2, 1]
    assert pack_sub_traces(sub_traces[3:]).rollout_index.tolist() == [0, 1]  # own numbering


def test_pack_sub_traces_empty_batches(sub_traces):
    only_empty = pack_sub_traces(sub_traces, [1])  # one sequence, no tokens
    assert only_empty.input_ids.shape == (1, 0) and only_empty.position_ids.shape == (1, 0)
    assert only_empty.cu_seqlens.tolist() == [0, 0] and only_empty.cu_seqlens.dtype == torch.int32
    assert only_empty.max_seqlen == 0 and only_empty.num_tokens == 0
    assert only_empty.action_mask.shape == (0,) and only_empty.action_mask.dtype == torch.bool
    assert only_empty.rollout_index.tolist() == [1] and only_empty.ends == ["truncated"]
    assert [t.shape for t in only_empty.split(torch.zeros(0))] == [(0,)]
    assert only_empty.gather([torch.zeros(len(s)) for s in sub_traces]).shape == (0,)
    nothing = pack_sub_traces(sub_traces, [])
    assert nothing.num_sequences == 0 and nothing.num_tokens == 0
    assert nothing.cu_seqlens.tolist() == [0] and nothing.rollout_index.shape == (0,)
    assert nothing.split(torch.zeros(0)) == []
    assert nothing.gather([]).shape == (0,)
    assert pack_sub_traces([]).num_sequences == 0


def test_gather_split_round_trip(sub_traces):
    per_sub_trace = [torch.arange(len(s), dtype=torch.float32) + 100 * i
                     for i, s in enumerate(sub_traces)]
    batch = pack_sub_traces(sub_traces, [2, 0, 1])
    packed = batch.gather(per_sub_trace)
    assert packed.tolist() == [200, 201, 0, 1, 2, 3, 4, 5]
    assert [t.tolist() for t in batch.split(packed)] == [[200, 201], [0, 1, 2, 3, 4, 5], []]
    assert torch.equal(batch.gather(dict(enumerate(per_sub_trace))), packed)  # a mapping works
    # trailing dims, and a model-shaped [1, T, ...] output
    per_sub_trace_2d = [torch.randn(len(s), 3) for s in sub_traces]
    packed_2d = batch.gather(per_sub_trace_2d)
    assert packed_2d.shape == (8, 3)
    for i, part in zip(batch.indices, batch.split(packed_2d.unsqueeze(0))):
        assert torch.equal(part, per_sub_trace_2d[i])
    with pytest.raises(ValueError,
                       match=r"per_sequence\[2\] has shape \(5,\) but sub-trace 2 has 2 tokens"):
        batch.gather([torch.zeros(6), torch.zeros(0), torch.zeros(5)])
    with pytest.raises(ValueError, match="per_sequence has no entry for sub-trace 2"):
        batch.gather([torch.zeros(6)])
    with pytest.raises(TypeError, match="per_sequence must be a list"):
        batch.gather(torch.zeros(8))
    with pytest.raises(TypeError, match=r"per_sequence\[2\] must be a torch.Tensor"):
        batch.gather([None, None, [0.0, 0.0]])
    with pytest.raises(ValueError, match="per_token must be"):
        batch.split(torch.zeros(7))


def test_to_returns_a_copy(sub_traces):
    batch = pack_sub_traces(sub_traces)
    for device in ("cpu", torch.device("cpu")):
        moved = batch.to(device)
        assert moved is not batch and isinstance(moved, PackedBatch)
        for name in ("input_ids", "position_ids", "cu_seqlens", "action_mask", "rollout_logprobs",
                     "rewards", "rollout_index"):
            tensor = getattr(moved, name)
            assert tensor.device.type == "cpu" and torch.equal(tensor, getattr(batch, name)), name
            assert tensor.dtype == getattr(batch, name).dtype
        assert moved.indices == batch.indices and moved.indices is not batch.indices
        assert moved.ends == batch.ends and moved.lengths == batch.lengths
        assert moved.max_seqlen == batch.max_seqlen


@pytest.mark.gpu
def test_to_cuda(sub_traces):
    batch = pack_sub_traces(sub_traces).to("cuda")
    assert all(getattr(batch, f).is_cuda for f in ("input_ids", "cu_seqlens", "rollout_index"))
    per_token = batch.split(torch.arange(batch.num_tokens, device="cuda"))
    assert [t.numel() for t in per_token] == [6, 0, 2, 1, 3]


def test_pack_sub_traces_errors(sub_traces):
    with pytest.raises(ValueError, match=r"indices\[1\] = 5 is out of range for 5 sub-traces"):
        pack_sub_traces(sub_traces, [0, 5])
    with pytest.raises(ValueError, match=r"indices\[0\] = -1 is out of range"):
        pack_sub_traces(sub_traces, [-1])
    with pytest.raises(ValueError, match=r"indices\[2\] = 0 appears twice"):
        pack_sub_traces(sub_traces, [0, 1, 0])
    with pytest.raises(TypeError, match=r"indices\[0\] must be an int"):
        pack_sub_traces(sub_traces, [0.0])
    with pytest.raises(ValueError, match="rollout_index has no entry for rollout_id 'r2'"):
        pack_sub_traces(sub_traces, rollout_index={"r0": 0, "r1": 1})
    with pytest.raises(TypeError, match="rollout_index must be a mapping"):
        pack_sub_traces(sub_traces, rollout_index=[0, 1, 2])
    with pytest.raises(TypeError, match=r"sub_traces\[1\] must be a SubTrace"):
        pack_sub_traces([sub_traces[0], {"ids": [1]}])
    with pytest.raises(TypeError, match="sub_traces must be a sequence of SubTrace"):
        pack_sub_traces(iter(sub_traces))
    open_sub_trace = SubTrace("r9")
    open_sub_trace.append_context([1, 2])
    with pytest.raises(ValueError, match=r"sub_traces\[1\] \(rollout 'r9' #0\) is not closed"):
        pack_sub_traces([sub_traces[0], open_sub_trace])
    broken = make_sub_trace("r9", 0, [("c", [1, 2])])
    broken.rewards.append(0.0)
    with pytest.raises(ValueError,
                       match=r"sub_traces\[0\]\.rewards has 3 entries but its ids have 2"):
        pack_sub_traces([broken])


# ---------------------------------------------------------------------------------------------
# End to end: plan micro-batches over random sub-traces, pack each, recover every sub-trace.


def random_sub_trace(rng, rollout_id, index, length):
    sub_trace = SubTrace(rollout_id, index=index)
    if length:
        sub_trace.append_context([rng.randrange(1000) for _ in range(rng.randint(1, length))])
    while len(sub_trace) < length:
        n = rng.randint(1, length - len(sub_trace))
        if rng.random() < 0.5:
            sub_trace.append_action([rng.randrange(1000) for _ in range(n)],
                                    [-rng.random() for _ in range(n)])
            sub_trace.add_reward(rng.uniform(-1, 1))
        else:
            sub_trace.append_context([rng.randrange(1000) for _ in range(n)])
    sub_trace.close(rng.choice(["terminal", "truncated", "continued"]))
    return sub_trace


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), max_size=24),
       st.integers(40, 120), st.integers(0, 2**16))
def test_micro_batches_then_pack_recovers_every_sub_trace(specs, budget, seed):
    rng = random.Random(seed)
    sub_traces = [random_sub_trace(rng, f"r{rollout}", i, length)
                  for i, (rollout, length) in enumerate(specs)]
    index = rollout_index_map(sub_traces)
    plan = micro_batches([len(s) for s in sub_traces], budget)
    seen = {}
    for chosen in plan:
        batch = pack_sub_traces(sub_traces, chosen, index)
        assert batch.num_tokens <= budget and batch.indices == chosen
        assert batch.rollout_index.tolist() == [index[sub_traces[i].rollout_id] for i in chosen]
        for i, ids, mask, lp, rw in zip(chosen, batch.split(batch.input_ids),
                                        batch.split(batch.action_mask),
                                        batch.split(batch.rollout_logprobs),
                                        batch.split(batch.rewards)):
            seen[i] = (ids, mask, lp, rw)
    assert sorted(seen) == list(range(len(sub_traces)))
    for i, sub_trace in enumerate(sub_traces):
        own = sub_trace.to_tensors()
        for got, want in zip(seen[i], (own["ids"], own["action_mask"], own["logprobs"],
                                       own["rewards"])):
            assert torch.equal(got, want)
