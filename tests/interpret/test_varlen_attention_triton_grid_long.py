"""The Triton backend under the interpreter on part 1's long case: one 600-token sequence (several
tiles, the unmasked interior blocks, the longest-first tile order), every dtype and causal flag,
GQA 2:1, forward, LSE and backward against the float64 reference with flash-attention's
tolerance; and a long sequence among short ones with a 256 head dim (the widest padding)."""


import pytest
import torch

from test_varlen_attention import (DTYPES, LONG_LENGTHS, _grid_id, check_grid_case, make_inputs,
                                   run_and_compare)

GRID = [(LONG_LENGTHS, dtype, causal, (2, 1), 64) for dtype in DTYPES for causal in (True, False)]


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_triton_backend_matches_float64(case):
    check_grid_case(case, "triton")


@pytest.mark.parametrize("head_dim", [256, 200])
def test_head_dim_256(head_dim):
    q, k, v, cu, max_seqlen = make_inputs([5, 0, 70, 1], 2, 1, head_dim, torch.bfloat16, seed=head_dim)
    run_and_compare(q, k, v, cu, max_seqlen, causal=True, backend="triton")
