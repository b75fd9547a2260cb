"""Bad inputs to ``varlen_attention``: the exception type and a fragment of its message, per case.

As in ``test_gae_errors.py``: every case runs in a child interpreter, so that a crash (a segfault
on a missed check) fails its test instead of the suite. All cases run in one child, which prints
one JSON line per case; if the child dies, the case it died at is recorded as a crash and the
cases after it run in a new child. ``validate=False`` with garbage ``cu_seqlens`` must not crash:
outputs may be anything there.
"""

import textwrap

import pytest
from error_cases import bad_input_tests, no_error_tests

PRELUDE = textwrap.dedent("""
    import json, math, sys
    import torch
    import agentrl_fast
    from agentrl_fast.ops import varlen_attention
    from agentrl_fast.ops.varlen_attention import BACKENDS

    T, Hq, Hk, D = 6, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    q = torch.randn(T, Hq, D, generator=g)
    k = torch.randn(T, Hk, D, generator=g)
    v = torch.randn(T, Hk, D, generator=g)

    def attn(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=4, **kwargs):
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, **kwargs)

    def heads(num_heads, head_dim=D, tokens=T):
        return torch.randn(tokens, num_heads, head_dim, generator=g)

    def cu_of(*values):
        return torch.tensor(values, dtype=torch.int32)

    def forward_backward(cu_seqlens, max_seqlen=4, num_tokens=T, **kwargs):
        '''Forward with the LSE and backward, unvalidated, on fresh leaves.'''
        leaves = [heads(n, tokens=num_tokens).requires_grad_() for n in (Hq, Hk, Hk)]
        out, lse = varlen_attention(*leaves, cu_seqlens, max_seqlen, return_lse=True,
                                    validate=False, **kwargs)
        out.sum().backward()
        assert out.shape == (num_tokens, Hq, D) and lse.shape == (Hq, num_tokens)
        assert all(x.grad.shape == x.shape for x in leaves)

    def kernels_directly(cu_seqlens):
        '''The CPU backends' forward and backward, into preallocated outputs.'''
        for name in ("reference", "native", "cpu_flash"):
            backend = BACKENDS[name]
            out, lse = torch.empty_like(q), torch.empty(Hq, T)
            backend.forward(q, k, v, cu_seqlens, 4, True, 0.5, False, out, lse)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            backend.backward(torch.ones_like(q), q, k, v, out, lse, cu_seqlens, 4, True, 0.5,
                             False, dq, dk, dv)
""")

# name -> (expected exception type name, message fragment, statement). "NoError" means the
# statement must return normally.
CASES = {
    # the valid calls every case below perturbs
    "valid_baseline": ("NoError", "", (
        "attn(); attn(causal=False, return_lse=True, softmax_scale=0.5); "
        "attn(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16()); "
        "attn(q=q.half(), k=k.half(), v=v.half(), max_seqlen=100); "
        "attn(q=heads(4, 256), k=heads(1, 256), v=heads(1, 256)); attn(softmax_scale=1)")),
    # q, k, v: types and dtypes
    "q_not_tensor": ("TypeError", "q must be a torch.Tensor, got list", "attn(q=q.tolist())"),
    "k_none": ("TypeError", "k must be a torch.Tensor, got NoneType", "attn(k=None)"),
    "v_numpy": ("TypeError", "v must be a torch.Tensor, got ndarray", "attn(v=v.numpy())"),
    "q_int": ("TypeError", "q must be float16, bfloat16 or float32, got torch.int64",
              "attn(q=q.long(), k=k.long(), v=v.long())"),
    "k_int32": ("TypeError", "k must be float16, bfloat16 or float32, got torch.int32",
                "attn(k=k.int())"),
    "q_bool": ("TypeError", "q must be float16, bfloat16 or float32, got torch.bool",
               "attn(q=q > 0)"),
    "q_float64": ("TypeError", "q must be float16, bfloat16 or float32, got torch.float64",
                  "attn(q=q.double(), k=k.double(), v=v.double())"),
    "mixed_q_k": ("TypeError", "q, k and v must share a dtype, got torch.float32, torch.float16, torch.float16",
                  "attn(k=k.half(), v=v.half())"),
    "mixed_v": ("TypeError", "q, k and v must share a dtype",
                "attn(q=q.bfloat16(), k=k.bfloat16(), v=v.half())"),
    # shapes
    "q_2d": ("ValueError", "q must be 3-D [T, heads, head_dim], got shape (6, 8)", "attn(q=q[:, 0])"),
    "k_4d": ("ValueError", "k must be 3-D [T, heads, head_dim], got shape (1, 6, 2, 8)",
             "attn(k=k.unsqueeze(0))"),
    "v_1d": ("ValueError", "v must be 3-D", "attn(v=v.flatten())"),
    "kv_heads_mismatch": ("ValueError", "k and v must have the same shape, got (6, 2, 8) and (6, 1, 8)",
                          "attn(v=v[:, :1])"),
    "kv_head_dim_mismatch": ("ValueError", "k and v must have the same shape", "attn(v=heads(Hk, 16))"),
    "kv_tokens_mismatch": ("ValueError", "k and v must have the same shape", "attn(v=v[:5])"),
    "T_mismatch": ("ValueError", "k must have T = q.shape[0] = 6 tokens, got 5",
                   "attn(k=k[:5], v=v[:5])"),
    "T_mismatch_longer": ("ValueError", "k must have T = q.shape[0] = 6 tokens, got 7",
                          "attn(k=heads(Hk, tokens=7), v=heads(Hk, tokens=7))"),
    "head_dim_mismatch": ("ValueError", "k must have head_dim = q.shape[2] = 8, got 4",
                          "attn(k=k[..., :4], v=v[..., :4])"),
    "heads_not_multiple": ("ValueError", "q's heads (4) must be a multiple of k's heads (3)",
                           "attn(k=heads(3), v=heads(3))"),
    "more_kv_heads_than_q": ("ValueError", "q's heads (4) must be a multiple of k's heads (8)",
                             "attn(k=heads(8), v=heads(8))"),
    "zero_kv_heads": ("ValueError", "must be a multiple of k's heads (0)", "attn(k=heads(0), v=heads(0))"),
    "head_dim_0": ("ValueError", "head_dim must be in 1..256, got 0",
                   "attn(q=heads(Hq, 0), k=heads(Hk, 0), v=heads(Hk, 0))"),
    "head_dim_257": ("ValueError", "head_dim must be in 1..256, got 257",
                     "attn(q=heads(Hq, 257), k=heads(Hk, 257), v=heads(Hk, 257))"),
    "head_dim_512": ("ValueError", "head_dim must be in 1..256, got 512",
                     "attn(q=heads(Hq, 512), k=heads(Hk, 512), v=heads(Hk, 512))"),
    # devices (meta stands in for a second device on a CPU-only machine)
    "k_other_device": ("ValueError", "k must be on cpu like q, got meta", "attn(k=k.to('meta'))"),
    "cu_other_device": ("ValueError", "cu_seqlens must be on cpu like q, got meta",
                        "attn(cu_seqlens=cu.to('meta'))"),
    # cu_seqlens: metadata
    "cu_int64": ("TypeError", "cu_seqlens must be torch.int32, got torch.int64; pass cu_seqlens.to(torch.int32)",
                 "attn(cu_seqlens=cu.long())"),
    "cu_float": ("TypeError", "cu_seqlens must be torch.int32, got torch.float32", "attn(cu_seqlens=cu.float())"),
    "cu_list": ("TypeError", "cu_seqlens must be a torch.Tensor, got list", "attn(cu_seqlens=[0, 2, 6])"),
    "cu_2d": ("ValueError", "cu_seqlens must be 1-D [B+1] with at least one element", "attn(cu_seqlens=cu.view(1, 3))"),
    "cu_0d": ("ValueError", "cu_seqlens must be 1-D [B+1]", "attn(cu_seqlens=cu_of(0)[0])"),
    "cu_empty": ("ValueError", "cu_seqlens must be 1-D [B+1] with at least one element (cu_seqlens[0] = 0), "
                 "got shape (0,)",
                 "attn(cu_seqlens=cu[:0])"),
    "cu_empty_unvalidated": ("ValueError", "cu_seqlens must be 1-D [B+1] with at least one element",
                             "attn(cu_seqlens=cu[:0], validate=False)"),
    # cu_seqlens: values
    "cu_first_nonzero": ("ValueError", "cu_seqlens[0] must be 0, got 1", "attn(cu_seqlens=cu_of(1, 2, 6))"),
    "cu_first_negative": ("ValueError", "cu_seqlens[0] must be 0, got -2", "attn(cu_seqlens=cu_of(-2, 2, 6))"),
    "cu_decreasing": ("ValueError", "cu_seqlens must be non-decreasing, but cu_seqlens[1] = 4 > cu_seqlens[2] = 2",
                      "attn(cu_seqlens=cu_of(0, 4, 2, 6))"),
    "cu_decreasing_late": ("ValueError", "cu_seqlens must be non-decreasing, but cu_seqlens[3] = 6 > cu_seqlens[4] = 5",
                           "attn(cu_seqlens=cu_of(0, 1, 1, 6, 5, 6))"),
    "cu_last_too_small": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = 6, got 5",
                          "attn(cu_seqlens=cu_of(0, 2, 5))"),
    "cu_last_too_large": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = 6, got 7",
                          "attn(cu_seqlens=cu_of(0, 2, 7))"),
    "cu_single_zero_with_tokens": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = 6, got 0",
                                   "attn(cu_seqlens=cu_of(0))"),
    # max_seqlen
    "max_seqlen_too_small": ("ValueError", "max_seqlen = 3 is smaller than the longest sequence in cu_seqlens (4); "
                             "pass max_seqlen >= 4", "attn(max_seqlen=3)"),
    "max_seqlen_zero": ("ValueError", "max_seqlen = 0 is smaller than the longest sequence", "attn(max_seqlen=0)"),
    "max_seqlen_float": ("TypeError", "max_seqlen must be a Python int, got float", "attn(max_seqlen=4.0)"),
    "max_seqlen_bool": ("TypeError", "max_seqlen must be a Python int, got bool", "attn(max_seqlen=True)"),
    "max_seqlen_tensor": ("TypeError", "max_seqlen must be a Python int, got Tensor",
                          "attn(max_seqlen=torch.tensor(4))"),
    "max_seqlen_none": ("TypeError", "max_seqlen must be a Python int, got NoneType", "attn(max_seqlen=None)"),
    "max_seqlen_negative": ("ValueError", "max_seqlen must be >= 0, got -1", "attn(max_seqlen=-1)"),
    "max_seqlen_negative_unvalidated": ("ValueError", "max_seqlen must be >= 0, got -5",
                                        "attn(max_seqlen=-5, validate=False)"),
    # backend
    "backend_unknown": ("ValueError", "backend must be 'auto' or one of ['cpu_flash', 'flash_attn', 'native', 'reference', 'torch', 'triton'], got 'flash'",
                        "attn(backend='flash')"),
    "backend_empty": ("ValueError", "backend must be 'auto' or one of", "attn(backend='')"),
    "backend_torch_on_cpu": ("ValueError", "backend 'torch' is not available on cpu: ", "attn(backend='torch')"),
    "backend_flash_attn_on_cpu": ("ValueError", "backend 'flash_attn' is not available on cpu: ",
                                  "attn(backend='flash_attn')"),
    # softmax_scale
    "scale_string": ("TypeError", "softmax_scale must be a real number, got str", "attn(softmax_scale='0.5')"),
    "scale_bool": ("TypeError", "softmax_scale must be a real number, got bool", "attn(softmax_scale=True)"),
    "scale_tensor": ("TypeError", "softmax_scale must be a real number, got Tensor",
                     "attn(softmax_scale=torch.tensor(0.5))"),
    "scale_complex": ("TypeError", "softmax_scale must be a real number, got complex", "attn(softmax_scale=1j)"),
    "scale_inf": ("ValueError", "softmax_scale must be finite, got inf", "attn(softmax_scale=math.inf)"),
    "scale_neg_inf": ("ValueError", "softmax_scale must be finite, got -inf", "attn(softmax_scale=-math.inf)"),
    "scale_nan": ("ValueError", "softmax_scale must be finite, got nan", "attn(softmax_scale=math.nan)"),
    # validate=False: garbage cu_seqlens must not crash (values are unspecified), forward + backward
    "unvalidated_cu_decreasing": ("NoError", "", "forward_backward(cu_of(0, 5, 2, 6))"),
    "unvalidated_cu_huge": ("NoError", "", "forward_backward(cu_of(0, 10**9))"),
    "unvalidated_cu_negative": ("NoError", "", "forward_backward(cu_of(-7, -1, 3, -(2**31)))"),
    "unvalidated_cu_int32_extremes": ("NoError", "", "forward_backward(cu_of(2**31 - 1, -(2**31), 2**31 - 1, 0))"),
    "unvalidated_cu_first_nonzero": ("NoError", "", "forward_backward(cu_of(3, 4, 6))"),
    "unvalidated_cu_last_short": ("NoError", "", "forward_backward(cu_of(0, 2, 3))"),
    "unvalidated_cu_last_long": ("NoError", "", "forward_backward(cu_of(0, 2, 60))"),
    "unvalidated_cu_only_empty_sequences": ("NoError", "", "forward_backward(torch.zeros(4, dtype=torch.int32))"),
    "unvalidated_cu_single_nonzero": ("NoError", "", "forward_backward(cu_of(5))"),
    "unvalidated_max_seqlen_too_small": ("NoError", "", "forward_backward(cu, max_seqlen=1)"),
    "unvalidated_cu_non_causal_bf16": ("NoError", "", (
        "leaves = [heads(n).bfloat16().requires_grad_() for n in (Hq, Hk, Hk)]; "
        "varlen_attention(*leaves, cu_of(0, 9, -3, 6), 2, causal=False, validate=False).sum().backward()")),
    "unvalidated_cu_random_long": ("NoError", "", (
        "n = 3000; "
        "bad = torch.randint(-(2**31), 2**31 - 1, (257,), generator=g, dtype=torch.int64).to(torch.int32); "
        "bad[::5] = torch.randint(0, n + 10, (52,), generator=g).to(torch.int32); "
        "forward_backward(bad, max_seqlen=7, num_tokens=n)")),
    "unvalidated_cu_kernels_directly": ("NoError", "", (
        "kernels_directly(cu_of(0, 5, 2, 6)); kernels_directly(cu_of(0, 10**9)); "
        "kernels_directly(cu_of(-(2**31), 2**31 - 1)); kernels_directly(cu_of(9))")),
}


outcomes, test_bad_input_raises = bad_input_tests(
    PRELUDE, CASES, [n for n, c in CASES.items() if c[0] != "NoError"])


test_call_returns, test_unvalidated_garbage_child_exits_cleanly = no_error_tests(PRELUDE,
                                                                                 CASES)


@pytest.mark.gpu
def test_cuda_device_errors_and_garbage(run_in_subprocess):
    """On CUDA: inputs on different devices are rejected by name; validate=False with garbage
    cu_seqlens does not crash the process (nor fault the device) on the reference backend, whose
    kernels clamp the bounds they read."""
    code = PRELUDE + textwrap.dedent("""
        c = torch.device("cuda")
        qc, kc, vc, cuc = q.to(c), k.to(c), v.to(c), cu.to(c)
        for label, call in (
            ("cu_seqlens", lambda: varlen_attention(qc, kc, vc, cu, 4)),
            ("k", lambda: varlen_attention(qc, k, vc, cuc, 4)),
            ("v", lambda: varlen_attention(qc, kc, v, cuc, 4)),
        ):
            try:
                call()
                sys.exit(f"{label} on the CPU with CUDA q was accepted")
            except ValueError as error:
                assert f"{label} must be on cuda" in str(error), str(error)
        for bad in ([0, 5, 2, 6], [0, 10**9], [-7, -1, 3, -(2**31)], [2**31 - 1, -(2**31), 0], [0, 2, 3]):
            leaves = [x.clone().requires_grad_() for x in (qc, kc, vc)]
            out = varlen_attention(*leaves, torch.tensor(bad, dtype=torch.int32, device=c), 4,
                                   backend="reference", validate=False)
            out.sum().backward()
        torch.cuda.synchronize()
        print("ok")
    """)
    completed = run_in_subprocess(code)
    assert completed.returncode == 0 and completed.stdout.strip().endswith("ok"), completed.stderr[-4000:]
