"""agentrl_fast.integrations.trl against the real TRL 1.16 (side environment "trl", built by
tools/setup_test_env.sh; under CI=true a missing one fails, elsewhere the test skips).

One CPU GRPOTrainer training step on a tiny Qwen3 (built in code, tokenizer trained in code)
without and with ``patch()``: the per-token log-probs the trainer computes match, the patched
step ran our ``linear_token_logprobs`` op (and the unpatched one did not), and the weights after
the step (plain SGD, so a gradient difference shows one to one) agree. The check runs in the side
environment's python, this file run as a script.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_envs import side_env_python  # noqa: E402


def test_grpo_step_with_our_logprobs_matches_trl():
    python = side_env_python("trl")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([str(python), __file__], cwd=ROOT, env=env, timeout=240,
                          capture_output=True, text=True)
    report = done.stdout + "\n" + done.stderr[-8000:]
    assert done.returncode == 0 and "ok trl\n" in done.stdout, report
    assert "agentrl_fast::linear_token_logprobs_forward" in done.stdout, report


def test_patch_names_trl_when_missing():
    import importlib.util

    import pytest

    if importlib.util.find_spec("trl") is not None:
        pytest.skip("TRL is installed in this environment")
    from agentrl_fast.integrations import trl

    with pytest.raises(ImportError, match="needs the 'trl' package"):
        trl.patch()


# ---------------------------------------------------------------------------------------------
# Run inside the side environment.


def _grpo_step(patched: bool):
    """One GRPOTrainer step; returns (per-token log-probs [B, C], weights after, our op counts)."""
    import tempfile

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from agentrl_fast.envs.tokenizer import build_tokenizer
    from agentrl_fast.integrations import trl as ours
    from agentrl_fast.models.tiny import tiny_qwen3

    (ours.patch if patched else ours.unpatch)()
    prompts = ["count to three", "say hello", "name a color", "add two and two"]
    tokenizer = build_tokenizer(prompts, vocab_size=300)
    torch.manual_seed(0)
    model = tiny_qwen3(len(tokenizer))
    config = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=6, max_steps=1, use_cpu=True,
                        report_to=[], learning_rate=1e-2, optim="sgd", seed=0, beta=0.0,
                        save_strategy="no", logging_steps=1, disable_tqdm=True)

    def reward(completions, **_):
        return [len(text) / 10 for text in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    seen = []
    compute = trainer._get_per_token_logps_and_entropies

    def recording(*args, **kwargs):  # records what the trainer computes, changes nothing
        out = compute(*args, **kwargs)
        seen.append(out[0].detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies = recording
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train()
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("agentrl_fast::")}
    return torch.cat(seen), {n: p.detach().clone() for n, p in model.named_parameters()}, ops


def check_trl():
    from agentrl_fast.integrations import trl as ours

    want_logps, want_weights, want_ops = _grpo_step(patched=False)
    got_logps, got_weights, got_ops = _grpo_step(patched=True)
    ours.unpatch()
    print(f"unpatched ops: {want_ops}\npatched ops: {got_ops}")
    assert not want_ops, want_ops
    assert got_logps.shape == want_logps.shape, (got_logps.shape, want_logps.shape)
    diff = (got_logps - want_logps).abs().max().item()
    print(f"per-token log-probs {tuple(got_logps.shape)}: max |diff| {diff:.3g}")
    assert diff <= 1e-5, diff
    for name, weight in want_weights.items():
        weight_diff = (got_weights[name] - weight).abs().max().item()
        assert weight_diff <= 2e-5, f"{name} after the step: max |diff| {weight_diff:.3g}"
    print("ok trl")


if __name__ == "__main__":
    check_trl()
