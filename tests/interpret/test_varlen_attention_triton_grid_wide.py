"""The Triton backend under the interpreter on the rest of part 1's grid: D = 128 and an odd D
(59, padded to 64: the masked head-dimension path) for every dtype and causal flag, forward,
LSE and backward against the float64 reference with flash-attention's tolerance. The long
sequence is in ``test_varlen_attention_triton_grid_long.py``."""


import pytest

from test_varlen_attention import (DTYPES, MIXED_LENGTHS, ODD_HEAD_DIM, _grid_id, check_grid_case)

GRID = [(MIXED_LENGTHS, dtype, causal, (4, 2), head_dim)
        for head_dim in (128, ODD_HEAD_DIM) for dtype in DTYPES for causal in (True, False)]


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_triton_backend_matches_float64(case):
    check_grid_case(case, "triton")
