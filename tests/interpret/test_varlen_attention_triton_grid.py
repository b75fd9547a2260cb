"""The Triton backend of ``varlen_attention`` under the interpreter (TRITON_INTERPRET=1), on part
1's grid (``tests/test_varlen_attention.py``: every dtype x causal x GQA ratio at D = 64 with
odd lengths, length 1 and empty sequences): forward, LSE and backward against the float64
reference, with flash-attention's tolerance (2x forward / 3x backward the error of the same
math done by PyTorch in the input dtype). D = 128, an odd D and the long sequence are in
``test_varlen_attention_triton_grid_wide.py`` (each file stays under a minute)."""


import pytest

from test_varlen_attention import DTYPES, GQA, MIXED_LENGTHS, _grid_id, check_grid_case

GRID = [(MIXED_LENGTHS, dtype, causal, gqa, 64)
        for dtype in DTYPES for causal in (True, False) for gqa in GQA]


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_triton_backend_matches_float64(case):
    check_grid_case(case, "triton")
