"""agentrl_fast.integrations.verl against the real verl 0.9.1 (side environment "verl", built by
tools/setup_test_env.sh; under CI=true a missing one fails, elsewhere the tests skip).

verl is not in the main environment, so each test runs one group of checks in the side
environment's python: this file run as a script (``python tests/test_integrations_verl.py
GROUP``), one process per group to pay verl's import (~5-15 s) once. Every check compares
with verl's own functions on the same inputs: random padded batches whose response masks have
holes (multi-turn tool responses), empty rows and odd lengths.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_envs import side_env_python  # noqa: E402

SHAPES = [(1, 1), (3, 17), (8, 113), (16, 203)]


GROUPS = ("lazy", "registries", "override", "actor")  # lazy first: before verl is imported


@pytest.fixture(scope="module")
def side_env_report() -> str:
    """Output of every check group, run in one side-environment process (verl imports once)."""
    python = side_env_python("verl")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([str(python), __file__, *GROUPS], cwd=ROOT, env=env, timeout=240,
                          capture_output=True, text=True)
    return done.stdout + "\n" + done.stderr[-8000:]


def passed(report: str, group: str) -> str:
    assert f"ok {group}\n" in report, f"{group} failed in the verl side environment:\n{report}"
    return report


def test_registries_match_verl(side_env_report):
    passed(side_env_report, "registries")


def test_override_runs_our_gae_inside_compute_advantage(side_env_report):
    report = passed(side_env_report, "override")
    assert re.search(r"our gae ops: [1-9]", report), report


def test_actor_step_with_our_loss_logprobs_and_attention(side_env_report):
    report = passed(side_env_report, "actor")
    for op in ("varlen_attention_forward", "token_logprobs_forward", "linear_token_logprobs_forward"):
        assert f"agentrl_fast::{op}" in report, report


def test_imports_stay_lazy(side_env_report):
    passed(side_env_report, "lazy")


def test_register_names_verl_when_missing():
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed in this environment")
    from agentrl_fast.integrations import verl

    with pytest.raises(ImportError, match="needs the 'verl' package"):
        verl.register()
    with pytest.raises(ImportError, match="needs the 'verl' package"):
        verl.patch_logprobs()


# ---------------------------------------------------------------------------------------------
# Checks run inside the side environment (this file as a script).


def _batch(torch, rows, length, seed):
    """Padded [B, L] tensors with multi-turn response masks: right padding, holes, an empty
    row when B > 2, and a row with a single action token."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (rows,), generator=gen)
    lengths[0] = length
    positions = torch.arange(length)
    mask = (positions < lengths[:, None]) & (torch.rand(rows, length, generator=gen) < 0.75)
    if rows > 2:
        mask[1] = False
        mask[2] = False
        mask[2, length // 2] = True
    mask = mask.float()  # verl passes 0/1 floats from the trainer
    return {
        "mask": mask,
        "rewards": torch.randn(rows, length, generator=gen),
        "values": torch.randn(rows, length, generator=gen),
        "old": torch.randn(rows, length, generator=gen) * 0.5 - 2,
        "delta": torch.randn(rows, length, generator=gen) * 0.3,
        "advantages": torch.randn(rows, length, generator=gen),
        "is_weights": torch.rand(rows, length, generator=gen) * 2,
    }


def _close(torch, ours, theirs, what, rtol=2e-5, atol=2e-6):
    ours, theirs = torch.as_tensor(ours), torch.as_tensor(theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    ok = torch.allclose(ours.double(), theirs.double(), rtol=rtol, atol=atol)
    assert ok, f"{what}: max |diff| {(ours.double() - theirs.double()).abs().max():.3g}"


def _check_gae(torch, core_algos, ours_fn):
    for seed, (rows, length) in enumerate(SHAPES):
        b = _batch(torch, rows, length, seed)
        if b["mask"].sum() < 2:
            continue  # verl's whitening raises below two action tokens
        theirs = core_algos.compute_gae_advantage_return(b["rewards"], b["values"], b["mask"],
                                                         gamma=0.99, lam=0.95)
        ours = ours_fn(token_level_rewards=b["rewards"], values=b["values"],
                       response_mask=b["mask"], gamma=0.99, lam=0.95)
        for name, x, y in zip(("advantages", "returns"), ours, theirs):
            _close(torch, x, y, f"gae {name} {rows}x{length}")  # every position, masked too


def _policy_losses(torch, core_algos, name, b, mode, config, is_weights):
    log_prob = (b["old"] + b["delta"]).requires_grad_()
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=b["old"], log_prob=log_prob, advantages=b["advantages"],
        response_mask=b["mask"].bool(), loss_agg_mode=mode, config=config,
        rollout_is_weights=b["is_weights"] if is_weights else None)
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def _verl_agg_modes(core_algos):
    import inspect

    return set(re.findall(r'"((?:token|seq)-[a-z-]+)"', inspect.getsource(core_algos.agg_loss)))


def check_lazy():
    """With verl and TRL installed, importing agentrl_fast and its integrations imports neither."""
    import importlib

    for module in ("agentrl_fast", "agentrl_fast.ops", "agentrl_fast.integrations.verl",
                   "agentrl_fast.integrations.trl", "agentrl_fast.integrations._padded"):
        importlib.import_module(module)
    loaded = [m for m in sys.modules if m.split(".")[0] in ("verl", "trl")]
    assert not loaded, loaded
    print("ok lazy")


def check_registries():
    import torch
    from omegaconf import OmegaConf
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    from agentrl_fast.integrations import verl as ours
    from agentrl_fast.integrations._padded import VERL_LOSS_AGG_MODES

    adv_before = dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    loss_before = dict(core_algos.POLICY_LOSS_REGISTRY)
    ours.register()
    ours.register()  # idempotent
    assert core_algos.get_adv_estimator_fn("gae") is adv_before["gae"]  # not overridden
    _check_gae(torch, core_algos, core_algos.get_adv_estimator_fn("agentrl_gae"))
    # As verl's trainer calls a registered estimator: no values, gamma/lam from its AlgoConfig.
    b = _batch(torch, 8, 113, 7)
    algo = AlgoConfig(gamma=0.9, lam=0.8)
    got = core_algos.get_adv_estimator_fn("agentrl_gae")(
        token_level_rewards=b["rewards"], response_mask=b["mask"], config=algo, index=None)
    want = core_algos.compute_gae_advantage_return(b["rewards"], torch.zeros_like(b["rewards"]),
                                                   b["mask"], 0.9, 0.8)
    _close(torch, got[0], want[0], "agentrl_gae without values")

    assert set(VERL_LOSS_AGG_MODES) == _verl_agg_modes(core_algos), _verl_agg_modes(core_algos)
    configs = {
        "dict": OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.15,
                                  "clip_ratio_high": 0.28, "clip_ratio_c": 2.0,
                                  "global_batch_info": {}}),
        "actor": ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, clip_ratio=0.25,
                             use_dynamic_bsz=False, rollout_n=1),
        "global": OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
                                    "clip_ratio_c": 3.0, "global_batch_info": {
            "dp_size": 2, "batch_num_tokens": 700, "global_batch_size": 24,
            "loss_scale_factor": 64}}),
    }
    for seed, (rows, length) in enumerate(SHAPES):
        b = _batch(torch, rows, length, 100 + seed)
        for mode in VERL_LOSS_AGG_MODES:
            for config_name, config in configs.items():
                for is_weights in (False, True):
                    what = f"policy loss {mode} {config_name} is_weights={is_weights} {rows}x{length}"
                    theirs = _policy_losses(torch, core_algos, "vanilla", b, mode, config, is_weights)
                    got = _policy_losses(torch, core_algos, "agentrl_ppo", b, mode, config, is_weights)
                    if b["mask"].sum() == 0:  # verl's token-mean is 0/0 = NaN there; ours 0
                        assert got[0] == 0 and not got[1].any(), what
                        continue
                    _close(torch, got[0], theirs[0], what + " loss")
                    _close(torch, got[1], theirs[1], what + " gradient")
                    assert got[2].keys() == theirs[2].keys(), (got[2].keys(), theirs[2].keys())
                    for key in theirs[2]:
                        _close(torch, got[2][key], theirs[2][key], f"{what} {key}", atol=1e-6)
    try:
        _policy_losses(torch, core_algos, "agentrl_ppo", b, "token-mean", None, False)
    except ValueError as error:
        assert "config" in str(error)
    else:
        raise AssertionError("config=None must raise ValueError")

    ours.unregister()
    assert core_algos.ADV_ESTIMATOR_REGISTRY == adv_before
    assert core_algos.POLICY_LOSS_REGISTRY == loss_before
    print("ok registries")


def check_override():
    import torch
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos, ray_trainer

    from agentrl_fast.integrations import verl as ours

    verl_gae = core_algos.compute_gae_advantage_return
    verl_vanilla = core_algos.get_policy_loss_fn("vanilla")
    b = _batch(torch, 16, 203, 3)
    batch = {"token_level_rewards": b["rewards"], "values": b["values"],
             "response_mask": b["mask"]}

    def compute():
        data = DataProto.from_dict(tensors={k: v.clone() for k, v in batch.items()})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = ray_trainer.compute_advantage(data, "gae", gamma=0.99, lam=0.95,
                                                config=AlgoConfig())
        calls = sum(e.count for e in prof.key_averages() if e.key == "agentrl_fast::gae")
        return out.batch["advantages"], out.batch["returns"], calls

    want_adv, want_ret, verl_calls = compute()
    assert verl_calls == 0
    ours.register(override=True)
    assert core_algos.compute_gae_advantage_return is ours.compute_gae_advantage_return
    assert core_algos.get_adv_estimator_fn("gae") is ours.compute_gae_advantage_return
    assert core_algos.get_policy_loss_fn("vanilla") is ours.agentrl_ppo
    got_adv, got_ret, calls = compute()
    print(f"our gae ops: {calls}")
    assert calls >= 1
    _close(torch, got_adv, want_adv, "compute_advantage advantages")
    _close(torch, got_ret, want_ret, "compute_advantage returns")
    ours.unregister()
    assert core_algos.compute_gae_advantage_return is verl_gae
    assert core_algos.get_adv_estimator_fn("gae") is verl_gae
    assert core_algos.get_policy_loss_fn("vanilla") is verl_vanilla
    assert "agentrl_gae" not in core_algos.ADV_ESTIMATOR_REGISTRY
    assert compute()[2] == 0
    # What a Ray job gets from VERL_USE_EXTERNAL_MODULES=agentrl_fast.integrations.verl_plugin.
    import importlib

    importlib.import_module("agentrl_fast.integrations.verl_plugin")
    assert core_algos.compute_gae_advantage_return is ours.compute_gae_advantage_return
    assert compute()[2] >= 1
    ours.unregister()
    assert core_algos.compute_gae_advantage_return is verl_gae
    print("ok override")


# verl's actor (FSDPEngineWithLMHead) needs an accelerator: verl 0.9.1's platform registry has
# CUDA, NPU and ROCm only and falls back to CUDA, so the engine's __init__ (device mesh) and
# forward_step (micro_batch.to(get_device_id())) fail on the CPU. The check runs the body of
# forward_step on the CPU instead, with verl's own code at every step: left_right_2_no_padding,
# the engine's prepare_model_inputs / prepare_model_outputs (its remove-padding path, on an
# FSDPEngineWithLMHead whose __init__ and FSDP wrapping are skipped), verl's own
# patch_forward_with_backends for the fused path, and verl's actor loss (workers.utils.losses
# .ppo_loss: policy loss through the registry, entropy), then backward and an optimizer step.


def _actor_batch(torch, rows=4, prompt=7, response=11, vocab=97, seed=0):
    """A verl trainer batch (left-padded prompts, right-padded responses, response mask with
    holes) turned into verl's no-padding TensorDict by verl's own left_right_2_no_padding."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, prompt + 1, (rows,), generator=gen)
    response_lens = torch.randint(1, response + 1, (rows,), generator=gen)
    response_lens[0] = response
    prompt_mask = (torch.arange(prompt) >= prompt - prompt_lens[:, None]).long()
    response_valid = (torch.arange(response) < response_lens[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_valid], 1)
    prompts = torch.randint(0, vocab, (rows, prompt), generator=gen)
    responses = torch.randint(0, vocab, (rows, response), generator=gen)
    mask = (response_valid.bool() & (torch.rand(rows, response, generator=gen) < 0.8)).float()
    data = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask, "advantages": torch.randn(rows, response, generator=gen),
        "old_log_probs": torch.randn(rows, response, generator=gen) * 0.1 - 4.6,
    }, batch_size=rows)
    data = left_right_2_no_padding(data)
    for key, value in dict(temperature=1.0, use_remove_padding=True, calculate_entropy=True,
                           dp_size=1, batch_num_tokens=int(mask.sum()),
                           global_batch_size=None).items():
        tu.assign_non_tensor_data(data, key, value)
    return data


def _actor_step(torch, attention, fused, loss_mode):
    """One actor update; returns (log_probs, entropy, loss, grads, metrics, our op counts)."""
    import verl.utils.torch_functional as verl_F
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils import losses

    from agentrl_fast.models.tiny import tiny_qwen3

    model = tiny_qwen3(97)
    model.set_attn_implementation(attention)
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.module, engine.engine_config = model, FSDPEngineConfig(strategy="fsdp")
    engine.pad_to_length, engine.use_ulysses_sp = False, False
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits  # what __init__ reads
    original_forward = type(model).forward
    if fused:  # what the engine's _build_module does with use_fused_kernels, impl_backend=torch
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
                         rollout_n=1, loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01,
                         policy_loss={"loss_mode": loss_mode})
    try:
        micro_batch = _actor_batch(torch)
        tu.assign_non_tensor_data(micro_batch, "use_fused_kernels", fused)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            inputs, output_args = engine.prepare_model_inputs(micro_batch)
            raw = engine.module(**inputs, use_cache=False)
            output = engine.prepare_model_outputs(raw, output_args, micro_batch, None)
            loss, metrics = losses.ppo_loss(config, output, micro_batch)
            loss.backward()
        before = model.lm_head.weight.detach().clone()
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        assert not torch.equal(before, model.lm_head.weight), "the optimizer step changed nothing"
    finally:
        type(model).forward = original_forward
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("agentrl_fast::")}
    grads = {name: p.grad for name, p in model.named_parameters()}
    return (output["log_probs"].values().detach(), output["entropy"].values().detach(),
            loss.detach(), grads, metrics, ops)


def check_actor():
    import torch

    from agentrl_fast.integrations import verl as ours

    want = _actor_step(torch, "sdpa", fused=False, loss_mode="vanilla")
    assert not want[5], want[5]
    ours.register(override=True)
    ours.patch_logprobs()
    try:
        for fused in (False, True):
            got = _actor_step(torch, "agentrl_varlen", fused=fused, loss_mode="agentrl_ppo")
            print(f"actor fused={fused} our ops: {got[5]}")
            for name, x, y in zip(("log_probs", "entropy", "loss"), got, want):
                _close(torch, x, y, f"actor fused={fused} {name}", atol=2e-5)
            for name in want[3]:
                _close(torch, got[3][name], want[3][name], f"actor fused={fused} grad {name}",
                       rtol=1e-4, atol=1e-5)
            assert got[4].keys() == want[4].keys(), (got[4].keys(), want[4].keys())
    finally:
        ours.unregister()
    from verl.workers.engine.fsdp import transformer_impl

    assert transformer_impl.logprobs_from_logits.__module__ == "verl.utils.torch_functional"
    print("ok actor")


def main(groups: list[str]) -> int:
    """Run each group; print ``ok GROUP`` or its traceback; non-zero exit if any failed."""
    import traceback

    failed = 0
    for group in groups:
        try:
            globals()[f"check_{group}"]()
        except Exception:  # report every group, not just the first failure
            failed += 1
            print(f"FAILED {group}:\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
