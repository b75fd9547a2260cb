"""The Triton backend's deterministic backward under the interpreter (TRITON_INTERPRET=1): with
``deterministic=True`` dq comes from its own kernel (``varlen_attention_backward_dq_kernel``)
instead of float32 atomics from the dk/dv kernel. The default (atomic) path runs the full grid in
``test_varlen_attention_triton_grid*.py``; here the deterministic one runs every dtype x causal
flag with odd lengths, length 1, empty sequences, two tiles and GQA 4:2 at D = 64 (and bf16 at
an odd D, 59: the masked head dimension), against the float64 reference with flash-attention's
tolerance, and on NaN-poisoned gradients. (Shorter sequences than the full grid's: the CI
budget.)"""

import math
import zlib

import pytest
import torch

from agentrl_fast.ops.varlen_attention import BACKENDS
from test_varlen_attention import DTYPES, ODD_HEAD_DIM, _grid_id, make_inputs, run_and_compare

LENGTHS = [0, 1, 7, 45, 0, 70, 0]  # odd lengths, length 1, empty sequences, a second tile
GRID = ([(LENGTHS, dtype, causal, (4, 2), 64) for dtype in DTYPES for causal in (True, False)]
        + [(LENGTHS, torch.bfloat16, True, (4, 2), ODD_HEAD_DIM)])


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_deterministic_backward_matches_float64(case):
    lengths, dtype, causal, (hq, hk), head_dim = case
    q, k, v, cu, max_seqlen = make_inputs(lengths, hq, hk, head_dim, dtype,
                                          seed=zlib.crc32(_grid_id(case).encode()))
    run_and_compare(q, k, v, cu, max_seqlen, causal=causal, backend="triton", deterministic=True)


@pytest.mark.parametrize("causal", [True, False])
def test_both_backwards_overwrite_poisoned_gradients_and_agree(causal):
    """The atomic and the deterministic backward called directly on NaN-filled dq, dk, dv write
    every element; dk and dv are the same kernel's (bitwise equal), dq agrees to float32
    rounding of the summation order."""
    backend = BACKENDS["triton"]
    q, k, v, cu, max_seqlen = make_inputs([0, 1, 7, 113, 0, 30], 4, 2, 32, torch.bfloat16,
                                          seed=40 + causal, requires_grad=False)
    scale = 32 ** -0.5
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan)
    backend.forward(q, k, v, cu, max_seqlen, causal, scale, False, out, lse)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(41)).to(q.dtype)
    results = []
    for deterministic in (False, True):
        grads = [torch.full_like(x, math.nan) for x in (q, k, v)]
        backend.backward(dout, q, k, v, out, lse, cu, max_seqlen, causal, scale, deterministic,
                         *grads)
        for name, x in zip(("dq", "dk", "dv"), grads):
            assert torch.isfinite(x).all(), f"{name} (deterministic={deterministic}): unwritten"
        results.append(grads)
    (dq_atomic, dk_atomic, dv_atomic), (dq_det, dk_det, dv_det) = results
    assert torch.equal(dk_atomic, dk_det) and torch.equal(dv_atomic, dv_det)
    torch.testing.assert_close(dq_atomic.float(), dq_det.float(), rtol=2e-2, atol=2e-2)
