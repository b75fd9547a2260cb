"""The Triton backend's native prefix-shared mode (``prefix_of``; kernels in
``agentrl_fast/kernels/varlen_attention_prefix.py``) under the interpreter (TRITON_INTERPRET=1):
its ``prefix_forward`` / ``prefix_backward`` called directly on NaN-poisoned outputs against the
float64 oracle of ``test_varlen_attention_prefix.py`` (the plain reference on the UNSHARED
packing, a prefix's dk/dv summed over its copies) with flash-attention's tolerance: every
layout there (one prefix with one and several suffixes, groups mixed with plain sequences,
empty prefixes and suffixes, length 1, odd lengths, non-adjacent suffixes, no segment), each
dtype with GQA/MQA/MHA on segments that cross the kernels' blocks, an odd head dim, both
backwards (atomic dq and deterministic, bitwise reproducible), garbage ``prefix_of`` read as
-1, the device-built tables, and the public function with ``backend="triton"``."""

import pytest
import torch
from test_varlen_attention import cu_seqlens_of
from test_varlen_attention_prefix import (HEAD_DIM, LAYOUTS, MIXED, _grads,
                                          assert_matches_oracle, make_case, run_kernels,
                                          run_public)

from agentrl_fast.ops import varlen_attention
from agentrl_fast.ops._varlen_attention_prefix import prefix_kernels
from agentrl_fast.ops.varlen_attention import BACKENDS
from agentrl_fast.ops import varlen_attention_triton as triton_launcher
from agentrl_fast.ops.varlen_attention_triton import (cached_prefix_table, prefix_sequences,
                                                      sequence_bounds, suffix_query_blocks)

NAMES = ("out", "lse", "dq", "dk", "dv")
# Segments longer than the blocks the interpreter's launches use (bf16/fp16 at D 32: forward
# 128 x 128, dk/dv 64 keys x 64 queries, dq 128 x 64; fp32: 64 x 32, 64 x 32, 64 x 32): a
# prefix of several key blocks, suffixes of several query blocks, partial last blocks.
BLOCKS = ([150, 70, 9, 131, 0, 66], [-1, 0, -1, 0, 0, 2])
FIXED = [name for name in LAYOUTS if not name.startswith("random-")]


def kernels(deterministic=False):
    """(prefix_forward, prefix_backward) of the triton backend, the backward's
    ``deterministic`` fixed."""
    backend = BACKENDS["triton"]

    def backward(dout, q, k, v, out, lse, cu, prefix_of, max_seqlen, scale, _, *grads):
        backend.prefix_backward(dout, q, k, v, out, lse, cu, prefix_of, max_seqlen, scale,
                                deterministic, *grads)
    return backend.prefix_forward, backward


def run_case(layout, dtype, gqa, *, seed, head_dim=HEAD_DIM, deterministic=False):
    """The kernels on poisoned outputs against the oracle: (results, max errors)."""
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, *gqa, dtype, seed=seed,
                                                         head_dim=head_dim)
    scale = head_dim ** -0.5
    results = run_kernels(kernels(deterministic), q, k, v, cu, prefix_of, max_seqlen, scale,
                          dout)
    context = f"(triton prefix mode, layout={layout}, dtype={dtype}, gqa={gqa}, D={head_dim})"
    return results, assert_matches_oracle(results, q, k, v, layout, scale, dout, context)


def test_the_backend_has_a_native_prefix_mode():
    backend = BACKENDS["triton"]
    assert backend.prefix_forward is not None and backend.prefix_backward is not None
    assert prefix_kernels(backend) == (backend.prefix_forward, backend.prefix_backward)


@pytest.mark.parametrize("layout_name", FIXED)
def test_layout_matches_unshared_float64(layout_name):
    run_case(LAYOUTS[layout_name], torch.bfloat16, (2, 1), seed=len(layout_name))


@pytest.mark.parametrize("dtype, gqa", [(torch.float32, (4, 1)), (torch.bfloat16, (4, 2)),
                                        (torch.float16, (2, 2))], ids=str)
def test_dtype_and_gqa_across_blocks_match_unshared_float64(dtype, gqa):
    _, errors = run_case(BLOCKS, dtype, gqa, seed=7)
    print(f"{dtype} {gqa}: max errors " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))


def test_odd_head_dim():
    """D 59 (padded to 64, the head dimension masked)."""
    run_case(LAYOUTS["non-adjacent"], torch.bfloat16, (2, 1), seed=9, head_dim=59)


def test_deterministic_backward_is_bitwise_reproducible_and_agrees_with_the_atomic_one():
    """The deterministic backward twice on poisoned gradients: the same bits, within the
    oracle's tolerance; the atomic backward's dk/dv are the same kernel's in the same order
    (bitwise equal), its dq (float32 atomics) agrees to rounding. GQA 4:2, several suffixes
    across blocks, each prefix tile's dk/dv split over 8 programs (more chunks than some
    tiles' lists: empty chunks too; the other tests run the launcher's own choice, 1 on the
    small layouts and 2-4 on ``BLOCKS``)."""
    with triton_launcher.dkdv_splits_held(8):
        _splits_bitwise_and_atomic()


def _splits_bitwise_and_atomic():
    layout = BLOCKS  # its 9-token prefix with 2 heads a group: 6 entries, so 2 empty chunks
    first, _ = run_case(layout, torch.bfloat16, (4, 2), seed=10, deterministic=True)
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.bfloat16, seed=10)
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = first[:2]
    for deterministic in (True, False):
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        BACKENDS["triton"].prefix_backward(dout, q, k, v, out, lse, cu, prefix_of, max_seqlen,
                                           HEAD_DIM ** -0.5, deterministic, *grads)
        if deterministic:
            for name, a, b in zip(NAMES[2:], grads, first[2:]):
                assert torch.equal(a, b), name
        else:
            assert torch.equal(grads[1], first[3]) and torch.equal(grads[2], first[4])
            torch.testing.assert_close(grads[0].float(), first[2].float(), rtol=2e-2,
                                       atol=2e-2)


def test_splits_fill_the_device_within_their_bounds():
    """Enough programs for 2 per processor over the prefixes' tiles, at most 8 chunks of at
    least 4 entries; 1 without prefixes or with enough tiles."""
    cpu = torch.device("cpu")  # 8 processors
    assert triton_launcher.prefix_dkdv_splits((0, 0, 0), 2, 4, cpu) == 1
    assert triton_launcher.prefix_dkdv_splits((128, 1, 64), 1, 4, cpu) == 8
    assert triton_launcher.prefix_dkdv_splits((512, 4, 64), 2, 4, cpu) == 2
    assert triton_launcher.prefix_dkdv_splits((2048, 16, 64), 2, 4, cpu) == 1
    assert triton_launcher.prefix_dkdv_splits((128, 1, 3), 1, 4, cpu) == 3  # 12 entries


@pytest.mark.parametrize("dtype,head_dim,splits,rows", [
    (torch.bfloat16, 64, 2, 70), (torch.float16, 59, 8, 1), (torch.float32, 48, 3, 129)])
def test_add_splits_sums_in_split_order_into_the_prefix_rows(dtype, head_dim, splits, rows):
    """The split sums' kernel: ``dk = (part_dk[0] + part_dk[1] + ...) * scale``, ``dv`` alike,
    added in split order in float32 (bitwise a sequential float32 sum; bf16 within the cast's
    one unit), cast and written at
    each packed row's token; the other rows of the (poisoned) gradients untouched. Rows past
    one block, one row, an odd head dim (masked columns), every dtype."""
    gen = torch.Generator().manual_seed(rows)
    num_tokens, num_heads_k, scale = rows + 40, 2, 0.125
    part = torch.randn(2, splits, rows, num_heads_k, head_dim, generator=gen) * 4
    part_tokens = torch.randperm(num_tokens, generator=gen)[:rows]
    grads = [torch.full((num_tokens, num_heads_k, head_dim), float("nan"), dtype=dtype)
             for _ in range(2)]
    triton_launcher._add_splits(part, part_tokens, scale, *grads)
    sums = part[:, 0].clone()
    for split in range(1, splits):
        sums = sums + part[:, split]
    for grad, expected in zip(grads, ((sums[0] * scale).to(dtype), sums[1].to(dtype))):
        if dtype == torch.bfloat16:  # the interpreter truncates casts to bf16 (the GPU rounds)
            torch.testing.assert_close(grad[part_tokens], expected, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(grad[part_tokens], expected)
        untouched = torch.ones(num_tokens, dtype=torch.bool)
        untouched[part_tokens] = False
        assert grad[untouched].isnan().all()


def test_a_held_split_count_wins_nests_and_is_released():
    """``dkdv_splits_held`` (the benchmarks' and the sanitizer's): its count over the rule's,
    the innermost of nested ones, the rule's again after."""
    cpu, facts = torch.device("cpu"), (2048, 16, 64)
    assert triton_launcher.prefix_dkdv_splits(facts, 2, 4, cpu) == 1
    for wrong in (0, -1, 2.0):
        with pytest.raises(ValueError, match="splits must be a positive int"):
            with triton_launcher.dkdv_splits_held(wrong):
                pass
    with triton_launcher.dkdv_splits_held(3):
        assert triton_launcher.prefix_dkdv_splits(facts, 2, 4, cpu) == 3
        with triton_launcher.dkdv_splits_held(8):
            assert triton_launcher.prefix_dkdv_splits(facts, 2, 4, cpu) == 8
        assert triton_launcher.prefix_dkdv_splits(facts, 2, 4, cpu) == 3
    assert triton_launcher.prefix_dkdv_splits(facts, 2, 4, cpu) == 1


def test_dkdv_table_packs_the_prefixes_rows():
    """The split sums' rows: each prefix's rows one after another, where its tokens are."""
    lengths, parents = [4, 5, 3, 0, 7, 2, 1], [-1, 0, -1, 0, 2, 0, -1]
    cu = cu_seqlens_of(lengths)
    table = triton_launcher.prefix_dkdv_table(cu, torch.tensor(parents, dtype=torch.int32),
                                              sum(lengths), 2, 2)
    tile_sequence, tile_block = table[1:3]
    part_row, part_tokens, split_tile, facts = table[7:]
    # prefixes: segment 0 (tokens 0-3, tiles 0-1 of 2) and segment 2 (tokens 9-11, 2 tiles)
    assert part_tokens.tolist() == [0, 1, 2, 3, 9, 10, 11]
    tiles = {(tile_sequence[t].item(), tile_block[t].item()) for t in split_tile.tolist()}
    assert tiles == {(1, 0), (1, 1), (3, 0), (3, 1)}  # (sequences of the table: segment + 1)
    assert part_row.tolist()[1] == 0 and part_row.tolist()[3] == 4
    assert facts == (7, 4, 4)  # rows, tiles, most suffix blocks (segment 0: 3 + 1)


def test_public_function_runs_the_native_kernels():
    """varlen_attention(..., prefix_of=..., backend="triton", deterministic=True): the kernels'
    bits, forward and backward."""
    layout = LAYOUTS["one-prefix-one-suffix"]
    q, k, v, cu, prefix_of, max_seqlen, dout = make_case(layout, 4, 2, torch.bfloat16, seed=11)
    public = run_public(q, k, v, cu, prefix_of, max_seqlen, dout, "triton", deterministic=True)
    direct = run_kernels(kernels(True), q, k, v, cu, prefix_of, max_seqlen, HEAD_DIM ** -0.5,
                         dout)
    for name, a, b in zip(NAMES, public, direct):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# Garbage (validate=False): an entry out of range reads as -1, never an out-of-range access.

GARBAGE = [[5, -7, 2**31 - 1, 0, 1, 9, -2**31, 3, 3, 3],  # out of range, itself, later
           [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]]  # chains: each names a suffix


@pytest.mark.parametrize("bad", GARBAGE)
def test_garbage_prefix_of_reads_as_minus_one(bad):
    """Poisoned outputs all written, with the bits of the sanitized ``prefix_of`` (what the op
    layer's generic path reads too), forward and backward."""
    layout = LAYOUTS[MIXED]
    q, k, v, cu, _, max_seqlen, dout = make_case(layout, 2, 1, torch.bfloat16, seed=12)
    garbage = torch.tensor(bad, dtype=torch.int32)
    sane = [p if 0 <= p < b and bad[p] == -1 else -1 for b, p in enumerate(bad)]
    got = run_kernels(kernels(), q, k, v, cu, garbage, max_seqlen, HEAD_DIM ** -0.5, dout)
    want = run_kernels(kernels(), q, k, v, cu, torch.tensor(sane, dtype=torch.int32),
                       max_seqlen, HEAD_DIM ** -0.5, dout)
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("cu_values, bad", [([0, 7, 2, 9], [-1, 0, 0]),
                                            ([-3, 10**9, -5, 4], [-1, 0, 1]),
                                            ([0, 9, 9, 9], [2**31 - 1, -2**31, 0])])
def test_garbage_cu_seqlens_and_prefix_of_never_crash(cu_values, bad):
    """The public function with validate=False, forward and backward: every token written
    (finite), whatever the bounds."""
    q, k, v, _, _, _, dout = make_case(([9], [-1]), 2, 1, torch.float32, seed=13)
    cu = torch.tensor(cu_values, dtype=torch.int64).clamp(-2**31, 2**31 - 1).to(torch.int32)
    out, lse = varlen_attention(q, k, v, cu, 4, prefix_of=torch.tensor(bad, dtype=torch.int32),
                                return_lse=True, backend="triton", validate=False)
    for name, x in zip(NAMES, (out, lse, *_grads(out, (q, k, v), dout))):
        assert torch.isfinite(x).all(), name


# ---------------------------------------------------------------------------------------------
# The device-built tables.

def test_prefix_sequences_sanitize_and_frame():
    cu = cu_seqlens_of([4, 2, 3, 0, 5, 2, 1])
    parents = torch.tensor([-1, 0, -1, 0, 2, 4, 9], dtype=torch.int32)
    # sequence i of the tables is segment i - 1 (0 and 8: the gaps); 5's prefix is a suffix
    assert prefix_sequences(cu, parents).tolist() == [-1, -1, 1, -1, 1, 3, -1, -1, -1]


def test_suffix_query_blocks_list_each_prefix_suffixes_in_order():
    lengths, parents = [4, 5, 3, 0, 7, 2, 1], [-1, 0, -1, 0, 2, 0, -1]
    cu = cu_seqlens_of(lengths)
    bounds = sequence_bounds(cu, sum(lengths))
    prefix = prefix_sequences(cu, torch.tensor(parents, dtype=torch.int32))
    ptr, row, count, suffix_tokens = suffix_query_blocks(bounds, prefix, sum(lengths), 2)
    starts = bounds.tolist()
    blocks = [[(starts[s + 1] + j, min(2, lengths[s] - j)) for s in range(len(lengths))
               if parents[s] == p for j in range(0, lengths[s], 2)]
              for p in range(len(lengths))]
    ptr = ptr.tolist()
    for p, want in enumerate(blocks):  # segment p is sequence p + 1 of the tables
        got = list(zip(row[ptr[p + 1]:ptr[p + 2]].tolist(), count[ptr[p + 1]:ptr[p + 2]].tolist()))
        assert got == want, p
    assert ptr[0] == ptr[1] == 0 and ptr[-1] == sum(map(len, blocks))
    assert suffix_tokens.tolist() == [0, 5 + 0 + 2, 0, 7, 0, 0, 0, 0, 0]


def test_tables_are_built_once_per_pair_of_tensors():
    cu = cu_seqlens_of([5, 3, 8])
    prefix_of = torch.tensor([-1, 0, 0], dtype=torch.int32)
    first = cached_prefix_table(cu, prefix_of, 16, 64)
    assert cached_prefix_table(cu, prefix_of, 16, 64) is first
    assert cached_prefix_table(cu, prefix_of, 16, 64, 32) is not first
    assert cached_prefix_table(cu, prefix_of.clone(), 16, 64) is not first
    prefix_of[2] = -1  # in place: the cached tables no longer describe it
    fresh = cached_prefix_table(cu, prefix_of, 16, 64)
    assert fresh is not first and fresh[1].tolist() == [-1, -1, 1, -1, -1]
    assert len(cached_prefix_table(cu, prefix_of, 16, 64, 32)) == 11  # dk/dv: with the splits'

