"""Bad inputs to GAE: the exception type and a fragment of its message, per case.

Every case runs in a child interpreter, so that a crash (a segfault on a missed check) fails
its test instead of the suite. All cases run in one child, which prints one JSON line per case; if
the child dies, the case it died at is recorded as a crash and the cases after it run in a new
child. ``validate=False`` with garbage ``cu_seqlens`` must not crash: outputs may be
anything there.
"""

import textwrap

import pytest
from error_cases import bad_input_tests, no_error_tests

PRELUDE = textwrap.dedent("""
    import json, math, sys
    import torch
    import agentrl_fast
    from agentrl_fast.ops import gae, gae_padded, whiten

    T = 6
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    mask = torch.tensor([False, True, False, True, True, True])
    r = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 2.0])
    v = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    boot = torch.tensor([0.0, 1.5])
    kw = dict(action_mask=mask, bootstrap_values=boot, gamma=0.99, lam=0.95)

    def with_value(x, i, value):
        x = x.clone()
        x[i] = value
        return x

    def gae_out(rewards=r, values=v, cu_seqlens=cu, action_mask=mask, bootstrap_values=boot,
                gamma=0.99, lam=0.95, validate=True, advantages=None, returns=None):
        advantages = torch.empty(T) if advantages is None else advantages
        returns = torch.empty(T) if returns is None else returns
        torch.ops.agentrl_fast.gae_out(rewards, values, cu_seqlens, action_mask,
                                       bootstrap_values, gamma, lam, validate, advantages, returns)
""")

# name -> (expected exception type name, message fragment, statement). "NoError" means the
# statement must return normally.
CASES = {
    # the valid call every case below perturbs
    "valid_baseline": ("NoError", "", "gae(r, v, cu, **kw); gae_out()"),
    # cu_seqlens
    "cu_int64": ("TypeError", "cu_seqlens must be int32", "gae(r, v, cu.long(), **kw)"),
    "cu_float": ("TypeError", "cu_seqlens must be int32", "gae(r, v, cu.float(), **kw)"),
    "cu_0d": ("ValueError", "cu_seqlens must be 1-D", "gae(r, v, torch.tensor(0, dtype=torch.int32))"),
    "cu_2d": ("ValueError", "cu_seqlens must be 1-D", "gae(r, v, cu.view(1, 3), **kw)"),
    "cu_empty": ("ValueError", "cu_seqlens must be 1-D [B+1] with at least one element",
                 "gae(r, v, torch.zeros(0, dtype=torch.int32))"),
    "cu_first_nonzero": ("ValueError", "cu_seqlens[0] must be 0, got 1",
                         "gae(r, v, torch.tensor([1, 2, 6], dtype=torch.int32), **kw)"),
    "cu_first_negative": ("ValueError", "cu_seqlens[0] must be 0",
                          "gae(r, v, torch.tensor([-1, 2, 6], dtype=torch.int32), **kw)"),
    "cu_decreasing": ("ValueError", "cu_seqlens must be non-decreasing, but cu_seqlens[1] = 4 > cu_seqlens[2] = 2",
                      "gae(r, v, torch.tensor([0, 4, 2, 6], dtype=torch.int32))"),
    "cu_last_too_small": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = rewards.shape[0] = 6, got 5",
                          "gae(r, v, torch.tensor([0, 2, 5], dtype=torch.int32), **kw)"),
    "cu_last_too_large": ("ValueError", "cu_seqlens[-1] must equal the number of tokens T = rewards.shape[0] = 6, got 7",
                          "gae(r, v, torch.tensor([0, 2, 7], dtype=torch.int32), **kw)"),
    "cu_no_sequences_with_tokens": ("ValueError", "cu_seqlens[-1] must equal the number of tokens",
                                    "gae(r, v, torch.zeros(1, dtype=torch.int32))"),
    "cu_not_a_tensor": ("TypeError", "cu_seqlens must be a torch.Tensor", "gae(r, v, [0, 2, 6], **kw)"),
    # rewards
    "rewards_int": ("TypeError", "rewards must be float32, float64, float16 or bfloat16",
                    "gae(r.long(), v, cu, **kw)"),
    "rewards_bool": ("TypeError", "rewards must be float32, float64, float16 or bfloat16",
                     "gae(r != 0, v, cu, **kw)"),
    "rewards_0d": ("ValueError", "rewards must be 1-D", "gae(torch.tensor(0.0), torch.tensor(0.0), cu)"),
    "rewards_2d": ("ValueError", "rewards must be 1-D", "gae(r.view(2, 3), v.view(2, 3), cu, **kw)"),
    "rewards_list": ("TypeError", "rewards must be a torch.Tensor", "gae(r.tolist(), v, cu, **kw)"),
    # values
    "values_int": ("TypeError", "values must be float32, float64, float16 or bfloat16",
                   "gae(r, v.int(), cu, **kw)"),
    "values_too_short": ("ValueError", "values must have T = rewards.shape[0] = 6",
                         "gae(r, v[:5], cu, **kw)"),
    "values_too_long": ("ValueError", "values must have T = rewards.shape[0] = 6",
                        "gae(r, torch.cat([v, v]), cu, **kw)"),
    "values_2d": ("ValueError", "values must be 1-D", "gae(r, v.view(6, 1), cu, **kw)"),
    "values_not_a_tensor": ("TypeError", "values must be a torch.Tensor", "gae(r, 0.5, cu, **kw)"),
    # action_mask
    "mask_uint8": ("TypeError", "action_mask must be bool", "gae(r, v, cu, action_mask=mask.to(torch.uint8))"),
    "mask_int64": ("TypeError", "action_mask must be bool", "gae(r, v, cu, action_mask=mask.long())"),
    "mask_float": ("TypeError", "action_mask must be bool", "gae(r, v, cu, action_mask=mask.float())"),
    "mask_too_short": ("ValueError", "action_mask must have T = rewards.shape[0] = 6",
                       "gae(r, v, cu, action_mask=mask[:5])"),
    "mask_too_long": ("ValueError", "action_mask must have T = rewards.shape[0] = 6",
                      "gae(r, v, cu, action_mask=torch.cat([mask, mask]))"),
    "mask_2d": ("ValueError", "action_mask must be 1-D", "gae(r, v, cu, action_mask=mask.view(2, 3))"),
    "mask_list": ("TypeError", "action_mask must be a torch.Tensor",
                  "gae(r, v, cu, action_mask=mask.tolist())"),
    # bootstrap_values
    "boot_too_short": ("ValueError", "bootstrap_values must be 1-D [B] with B = len(cu_seqlens) - 1 = 2",
                       "gae(r, v, cu, action_mask=mask, bootstrap_values=boot[:1])"),
    "boot_too_long": ("ValueError", "bootstrap_values must be 1-D [B] with B = len(cu_seqlens) - 1 = 2",
                      "gae(r, v, cu, action_mask=mask, bootstrap_values=torch.zeros(3))"),
    "boot_per_token": ("ValueError", "bootstrap_values must be 1-D [B]",
                       "gae(r, v, cu, action_mask=mask, bootstrap_values=torch.zeros(T))"),
    "boot_2d": ("ValueError", "bootstrap_values must be 1-D [B]",
                "gae(r, v, cu, action_mask=mask, bootstrap_values=boot.view(1, 2))"),
    "boot_int": ("TypeError", "bootstrap_values must be float32, float64, float16 or bfloat16",
                 "gae(r, v, cu, action_mask=mask, bootstrap_values=boot.long())"),
    # gamma and lam
    "gamma_negative": ("ValueError", "gamma must be in [0, 1]", "gae(r, v, cu, action_mask=mask, gamma=-0.1)"),
    "gamma_above_one": ("ValueError", "gamma must be in [0, 1]", "gae(r, v, cu, action_mask=mask, gamma=1.0001)"),
    "gamma_nan": ("ValueError", "gamma must be in [0, 1]", "gae(r, v, cu, action_mask=mask, gamma=math.nan)"),
    "gamma_inf": ("ValueError", "gamma must be in [0, 1]", "gae(r, v, cu, action_mask=mask, gamma=math.inf)"),
    "gamma_string": ("TypeError", "gamma must be a real number", "gae(r, v, cu, action_mask=mask, gamma='0.99')"),
    "gamma_none": ("TypeError", "gamma must be a real number", "gae(r, v, cu, action_mask=mask, gamma=None)"),
    "gamma_tensor": ("TypeError", "gamma must be a real number",
                     "gae(r, v, cu, action_mask=mask, gamma=torch.tensor(0.9))"),
    "lam_negative": ("ValueError", "lam must be in [0, 1]", "gae(r, v, cu, action_mask=mask, lam=-1e-9)"),
    "lam_above_one": ("ValueError", "lam must be in [0, 1]", "gae(r, v, cu, action_mask=mask, lam=2.0)"),
    "lam_nan": ("ValueError", "lam must be in [0, 1]", "gae(r, v, cu, action_mask=mask, lam=math.nan)"),
    "lam_string": ("TypeError", "lam must be a real number", "gae(r, v, cu, action_mask=mask, lam='1')"),
    "op_gamma_above_one": ("ValueError", "gamma must be in [0, 1]",
                           "torch.ops.agentrl_fast.gae(r, v, cu, mask, boot, 1.5, 0.9)"),
    "op_lam_negative": ("ValueError", "lam must be in [0, 1]",
                        "torch.ops.agentrl_fast.gae(r, v, cu, mask, boot, 0.9, -0.5)"),
    # non-finite inputs
    "rewards_inf": ("ValueError", "rewards must be finite, found inf at token 3", "gae(with_value(r, 3, math.inf), v, cu, **kw)"),
    "rewards_neg_inf": ("ValueError", "rewards must be finite", "gae(with_value(r, 5, -math.inf), v, cu, **kw)"),
    "rewards_nan": ("ValueError", "rewards must be finite, found nan at token 1", "gae(with_value(r, 1, math.nan), v, cu, **kw)"),
    "rewards_nan_on_non_action": ("ValueError", "rewards must be finite",
                                  "gae(with_value(r, 0, math.nan), v, cu, **kw)"),
    "rewards_inf_bf16": ("ValueError", "rewards must be finite",
                         "gae(with_value(r, 3, math.inf).bfloat16(), v.bfloat16(), cu, **kw)"),
    "values_inf": ("ValueError", "values must be finite", "gae(r, with_value(v, 2, math.inf), cu, **kw)"),
    "values_nan": ("ValueError", "values must be finite, found nan at token 4", "gae(r, with_value(v, 4, math.nan), cu, **kw)"),
    "values_nan_fp16": ("ValueError", "values must be finite",
                        "gae(r.half(), with_value(v, 4, math.nan).half(), cu, **kw)"),
    "boot_inf": ("ValueError", "bootstrap_values must be finite, found inf at sequence 1",
                 "gae(r, v, cu, action_mask=mask, bootstrap_values=with_value(boot, 1, math.inf))"),
    "boot_nan": ("ValueError", "bootstrap_values must be finite",
                 "gae(r, v, cu, action_mask=mask, bootstrap_values=with_value(boot, 0, math.nan))"),
    # rewards on non-action tokens
    "reward_on_prompt_token": ("ValueError", "rewards on non-action tokens: rewards[0] = 1 but action_mask[0] is False",
                               "gae(with_value(r, 0, 1.0), v, cu, **kw)"),
    "reward_on_observation_token": ("ValueError", "rewards on non-action tokens",
                                    "gae(with_value(r, 2, -0.25), v, cu, **kw)"),
    "reward_on_non_action_fp16": ("ValueError", "rewards on non-action tokens",
                                  "gae(with_value(r, 2, 1e-3).half(), v.half(), cu, **kw)"),
    # gae_out's outputs
    "out_adv_float64": ("TypeError", "advantages must be",
                        "gae_out(advantages=torch.empty(T, dtype=torch.float64))"),
    "out_ret_bfloat16": ("TypeError", "returns must be",
                         "gae_out(returns=torch.empty(T, dtype=torch.bfloat16))"),
    "out_float32_for_float64_inputs": ("TypeError", "advantages must be",
                                       "gae_out(rewards=r.double(), values=v.double())"),
    "out_adv_too_short": ("ValueError", "advantages must be 1-D [T] with T = 6",
                          "gae_out(advantages=torch.empty(5))"),
    "out_ret_too_long": ("ValueError", "returns must be 1-D [T] with T = 6",
                         "gae_out(returns=torch.empty(7))"),
    "out_adv_2d": ("ValueError", "advantages must be 1-D [T]", "gae_out(advantages=torch.empty(2, 3))"),
    "out_not_contiguous": ("ValueError", "advantages must be contiguous",
                           "gae_out(advantages=torch.empty(T, 2)[:, 0])"),
    "out_same_tensor": ("ValueError", "advantages and returns must be different tensors",
                        "out = torch.empty(T); gae_out(advantages=out, returns=out)"),
    "out_inputs_checked_too": ("ValueError", "cu_seqlens[-1] must equal the number of tokens",
                               "gae_out(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))"),
    # gae_padded and whiten
    "padded_rewards_1d": ("ValueError", "rewards must be 2-D",
                          "gae_padded(r, v, mask, gamma=1.0, lam=1.0)"),
    "padded_mask_shape": ("ValueError", "mask must have the shape of rewards",
                          "gae_padded(r.view(2, 3), v.view(2, 3), mask.view(3, 2), gamma=1.0, lam=1.0)"),
    "padded_reward_on_masked": ("ValueError", "rewards on non-action tokens",
                                "gae_padded(r.view(2, 3), v.view(2, 3), torch.zeros(2, 3), gamma=1.0, lam=1.0)"),
    "whiten_mask_not_bool": ("TypeError", "action_mask must be bool", "whiten(r, mask.float())"),
    "whiten_shape": ("ValueError", "action_mask must have the shape of advantages",
                     "whiten(r, mask[:5])"),
    "whiten_int_advantages": ("TypeError", "advantages must be floating point",
                              "whiten(r.long(), mask)"),
    # validate=False: garbage cu_seqlens must not crash (values are unspecified)
    "unvalidated_cu_decreasing": ("NoError", "",
                                  "gae(r, v, torch.tensor([0, 5, 2, 6], dtype=torch.int32), validate=False)"),
    "unvalidated_cu_huge": ("NoError", "",
                            "gae(r, v, torch.tensor([0, 10**9], dtype=torch.int32), "
                            "bootstrap_values=torch.zeros(1), validate=False)"),
    "unvalidated_cu_negative": ("NoError", "",
                                "gae(r, v, torch.tensor([-7, -1, 3, -(2**31)], dtype=torch.int32), "
                                "action_mask=mask, bootstrap_values=torch.ones(3), validate=False)"),
    "unvalidated_cu_int32_extremes": ("NoError", "",
                                      "gae(r, v, torch.tensor([2**31 - 1, -(2**31), 2**31 - 1, 0], "
                                      "dtype=torch.int32), validate=False)"),
    "unvalidated_cu_last_short": ("NoError", "",
                                  "gae(r, v, torch.tensor([0, 2, 3], dtype=torch.int32), validate=False)"),
    "unvalidated_cu_empty_sequences_only": ("NoError", "",
                                            "gae(r, v, torch.zeros(4, dtype=torch.int32), validate=False)"),
    "unvalidated_cu_random_long": ("NoError", "", (
        "g = torch.Generator().manual_seed(0); n = 70_000; "
        "bad = torch.randint(-(2**31), 2**31 - 1, (513,), generator=g, dtype=torch.int64).to(torch.int32); "
        "bad[::7] = torch.randint(0, n + 10, (74,), generator=g).to(torch.int32); "
        "gae(torch.randn(n), torch.randn(n), bad, action_mask=torch.rand(n, generator=g) < 0.5, "
        "bootstrap_values=torch.randn(512), gamma=0.9, lam=0.9, validate=False)")),
    "unvalidated_cu_gae_out": ("NoError", "",
                               "gae_out(cu_seqlens=torch.tensor([0, 9, 1], dtype=torch.int32), validate=False)"),
    "unvalidated_non_finite_and_off_action_rewards": ("NoError", "", (
        "gae(with_value(with_value(r, 0, math.nan), 1, math.inf), with_value(v, 2, -math.inf), cu, "
        "action_mask=mask, bootstrap_values=with_value(boot, 0, math.nan), validate=False)")),
}


outcomes, test_bad_input_raises = bad_input_tests(
    PRELUDE, CASES, [n for n, c in CASES.items() if c[0] != "NoError"])


test_call_returns, test_unvalidated_garbage_child_exits_cleanly = no_error_tests(PRELUDE,
                                                                                 CASES)


@pytest.mark.gpu
def test_cuda_device_errors_and_garbage(run_in_subprocess):
    """On CUDA: inputs on different devices are rejected by name; validate=False with garbage
    cu_seqlens does not crash the process (nor fault the device)."""
    code = PRELUDE + textwrap.dedent("""
        c = torch.device("cuda")
        rc, vc, cuc, mc, bc = r.to(c), v.to(c), cu.to(c), mask.to(c), boot.to(c)
        for label, call in (
            ("cu_seqlens", lambda: gae(rc, vc, cu, action_mask=mc)),
            ("values", lambda: gae(rc, v, cuc)),
            ("action_mask", lambda: gae(rc, vc, cuc, action_mask=mask)),
            ("bootstrap_values", lambda: gae(rc, vc, cuc, action_mask=mc, bootstrap_values=boot)),
        ):
            try:
                call()
                sys.exit(f"{label} on the CPU with CUDA rewards was accepted")
            except ValueError as error:
                assert f"{label} must be on" in str(error), str(error)
        g = torch.Generator().manual_seed(0)
        n = 3 * 2048 * 64 + 5
        for bad in ([0, 5, 2, 6], [0, 10**9], [-7, -1, 3, -(2**31)], [2**31 - 1, -(2**31), 0]):
            gae(rc, vc, torch.tensor(bad, dtype=torch.int32, device=c), validate=False)
        for _ in range(3):
            bad = torch.randint(-(2**31), 2**31 - 1, (513,), generator=g, dtype=torch.int64)
            bad[::7] = torch.randint(0, n + 10, (74,), generator=g)
            gae(torch.randn(n, device=c), torch.randn(n, device=c), bad.to(torch.int32).to(c),
                bootstrap_values=torch.randn(512, device=c), gamma=0.9, lam=0.9, validate=False)
        torch.cuda.synchronize()
        print("ok")
    """)
    completed = run_in_subprocess(code)
    assert completed.returncode == 0 and completed.stdout.strip().endswith("ok"), completed.stderr[-4000:]
