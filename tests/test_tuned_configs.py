"""The tuning sweep's hand-off (agentrl_fast/kernels/tuned.py): a tuned configuration is what the kernels'
configuration functions return on its GPU only, a stale one (other parameters) is ignored, the
AOT compile list gains every tuned configuration and the sweep's extra candidates, and the
sweep's candidates move one parameter at a time (then its extras). The kernels are loaded by
path, as tests/triton_aot.py loads them (no torch needed)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import triton_aot  # noqa: E402

TUNED_FWD = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}


@pytest.fixture()
def kernels(tmp_path, monkeypatch):
    """(varlen_attention, token_logprobs, tuned) with a tuned file for "GPU X" and that GPU."""
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in triton_aot.load_kernel_modules()}
    path = tmp_path / "tuned_configs.json"
    path.write_text(json.dumps({
        "GPU X": {"varlen_attention_forward": {"bf16_d64": TUNED_FWD,
                                               "bf16_d128": {"BLOCK_M": 64}},  # stale keys
                  "token_logprobs": {"block1024": {"BLOCK_V": 2048, "num_warps": 8}}},
        "GPU Y": {"varlen_attention_backward": {"fp16_d128": {
            "BLOCK": 32, "STEP": 32, "num_warps": 4, "num_stages": 1}}}}))
    monkeypatch.setenv("AGENTRL_FAST_TUNED_CONFIGS", str(path))
    tuned = modules["tuned"]
    monkeypatch.setattr(tuned, "device_name", lambda: "GPU X")
    return modules["varlen_attention"], modules["token_logprobs"], tuned


def test_tuned_configs_apply_on_their_gpu_only(kernels, monkeypatch):
    attention, logprobs, tuned = kernels
    assert attention.forward_config("bf16", 64) == TUNED_FWD
    assert attention.forward_config("bf16", 60) == TUNED_FWD  # padded to 64
    assert attention.forward_config("fp16", 64) == attention.default_forward_config("fp16", 64)
    # a tuned entry whose parameters are not the kernel's (a stale sweep) is ignored
    assert attention.forward_config("bf16", 128) == attention.default_forward_config("bf16", 128)
    assert logprobs.block_config(8192) == (2048, 8)
    assert logprobs.block_config(151936) == (4096, 8)  # not tuned: the default
    monkeypatch.setattr(tuned, "device_name", lambda: "GPU Z")
    assert attention.forward_config("bf16", 64) == attention.default_forward_config("bf16", 64)
    assert logprobs.block_config(8192) == (1024, 4)
    monkeypatch.setattr(tuned, "device_name", lambda: None)  # CPU / interpreter: never tuned
    assert attention.forward_config("bf16", 64) == attention.default_forward_config("bf16", 64)
    with tuned.forced("varlen_attention_forward", "bf16_d64", TUNED_FWD):  # the sweep's way
        assert attention.forward_config("bf16", 64) == TUNED_FWD
    assert attention.forward_config("bf16", 64) != TUNED_FWD


def test_aot_compiles_every_tuned_configuration(kernels, monkeypatch):
    attention, logprobs, tuned = kernels
    monkeypatch.setattr(tuned, "device_name", lambda: None)  # AOT compiles run without a GPU
    specs = list(attention.aot_specs()) + list(logprobs.aot_specs())
    by_name = {s["name"]: s for s in triton_aot.with_tuned_variants(specs, tuned)}
    for name in ("varlen_attention_forward_bf16_d64_tuned0",
                 "varlen_attention_forward_bf16_d64_odd_tuned0"):
        spec = by_name[name]
        assert spec["constexprs"]["BLOCK_M"] == 64 and spec["constexprs"]["BLOCK_N"] == 128
        assert (spec["num_warps"], spec["num_stages"]) == (8, 2)
    # other GPUs' tunings too (the launcher on that GPU picks them)
    spec = by_name["varlen_attention_backward_fp16_d128_tuned0"]
    assert spec["constexprs"]["BLOCK"] == 32 and spec["num_warps"] == 4
    for dtype in ("bf16", "fp16", "fp32"):
        assert by_name[f"token_logprobs_forward_{dtype}_block1024_tuned0"]["constexprs"][
            "BLOCK_V"] == 2048
        assert by_name[f"token_logprobs_backward_{dtype}_block1024_entropy_tuned0"][
            "num_warps"] == 8
    # the stale entry (a parameter the kernel lacks) adds nothing
    assert "varlen_attention_forward_bf16_d128_tuned0" not in by_name
    # forward (even, odd); backward (even, odd) x (atomic dq, deterministic) dk/dv kernels;
    # token_logprobs 3 dtypes x fwd/bwd x entropy
    assert len(by_name) == len(specs) + 2 + 4 + 12


def test_tuned_write_merges(tmp_path):
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in triton_aot.load_kernel_modules()}
    tuned, path = modules["tuned"], tmp_path / "t.json"
    tuned.write("GPU X", "token_logprobs", "block1024", {"BLOCK_V": 2048, "num_warps": 8},
                path=path)
    tuned.write("GPU X", "token_logprobs", "block4096", {"BLOCK_V": 4096, "num_warps": 16},
                path=path)
    data = json.loads(path.read_text())
    assert set(data["GPU X"]["token_logprobs"]) == {"block1024", "block4096"}


def test_sweep_candidates_move_one_parameter_at_a_time():
    from tune_kernels import candidates

    default = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    got = candidates(default)
    assert got[0] == default and len(got) == len({json.dumps(c, sort_keys=True) for c in got})
    for config in got[1:]:
        assert sum(config[k] != default[k] for k in default) == 1
    assert {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3} in got
    assert candidates(default, limit=2) == got[:2]


def test_sweep_skips_and_extra_candidates():
    import tune_kernels

    target = next(t for t in tune_kernels.TARGETS
                  if (t.op, t.key) == ("varlen_attention_backward", "bf16_d64"))
    default = {"BLOCK": 64, "STEP": 64, "num_warps": 4, "num_stages": 1}
    got = tune_kernels.candidates(default, target=target)
    assert got[0] == default and len(got) == len({json.dumps(c, sort_keys=True) for c in got})
    moves = [c for c in got[1:] if sum(c[k] != default[k] for k in default) == 1]
    assert {**default, "BLOCK": 32} not in got and {**default, "BLOCK": 128} not in got
    assert {**default, "num_stages": 2} in moves and {**default, "num_warps": 8} in moves
    extras = got[1 + len(moves):]  # after the coordinate moves, several parameters moved
    assert extras == tune_kernels.extra_configs(target.op, target.key, default)
    assert extras and all(c["num_stages"] > 1 and sum(c[k] != default[k] for k in default) > 1
                          for c in extras)
    # an extra naming a parameter the kernel lacks is dropped
    assert tune_kernels.extra_configs(target.op, target.key, {"BLOCK": 128}) == []
    plain = tune_kernels.candidates(default)  # no target: no skips, no extras
    assert {**default, "BLOCK": 32} in plain
    assert all(sum(c[k] != default[k] for k in default) == 1 for c in plain[1:])
    assert all(len(t) <= 3 for t in tune_kernels.EXTRA.values())


def test_no_backward_candidate_stores_ds_with_a_narrow_swizzle():
    """STEP below 64 stores the atomic dq's dS^T with a narrow swizzle (wrong or crashing on the
    H200; tests/triton_aot.py's narrow_mma_stores): no backward candidate of the sweep has one."""
    import tune_kernels

    for target in tune_kernels.TARGETS:
        if target.kind == "attention_backward":
            default = tune_kernels.default_config(target)
            assert all(c["STEP"] >= 64
                       for c in tune_kernels.candidates(default, target=target)), target
    # D 128: its default, then the stage moves; 32 or 128 keys and 4 warps are skipped
    target = next(t for t in tune_kernels.TARGETS
                  if (t.op, t.key) == ("varlen_attention_backward", "bf16_d128"))
    default = tune_kernels.default_config(target)
    got = tune_kernels.candidates(default, target=target)
    assert got == [default] + [{**default, "num_stages": n} for n in (1, 3)], got


def test_aot_compiles_the_sweep_extras():
    import tune_kernels

    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in triton_aot.load_kernel_modules()}
    specs = list(modules["varlen_attention"].aot_specs())
    extras = triton_aot.sweep_extras()
    assert extras == tune_kernels.EXTRA
    out = triton_aot.with_sweep_extras(specs, extras)
    added = {s["name"]: s for s in out[len(specs):]}
    # only for the launch the sweep times (atomic dq, even head dim), not its relatives
    assert len(added) == sum(len(v) for v in extras.values())
    base = {s["name"]: s for s in specs}
    for (op, key), configs in extras.items():
        spec = base[f"{op}_{key}"]
        for index, config in enumerate(configs):
            variant = added[f"{op}_{key}_sweep{index}"]
            assert variant["allow_spills"] is False  # a hot launch: a spill fails the compile test
            merged = {**spec["constexprs"], **{k: v for k, v in config.items()
                                               if k in spec["constexprs"]}}
            assert variant["constexprs"] == merged
            assert variant["num_stages"] == config.get("num_stages", spec["num_stages"])
            assert variant["num_warps"] == config.get("num_warps", spec["num_warps"])
