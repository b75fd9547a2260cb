"""The `agentrl-fast` CLI end to end with a tiny step count (a real child process), its run
folder, `eval`, and bad configurations failing at start with the field named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl_fast.config import (ConfigError, RunConfig, apply_overrides,
                                 load_config, to_dict)

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--set", "warmstart.demos=8", "--set", "warmstart.steps=5", "--set", "eval.tasks=6",
        "--set", "warmstart.check_every=2", "--set", "warmstart.check_tasks=3",
        "--set", "train.tasks_per_step=2", "--set", "train.rollout.samples_per_task=2"]


def cli(*args, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, "-m", "agentrl_fast.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_train_end_to_end_leaves_a_complete_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    result = cli("train", "--steps", "2", "--run-dir", str(run_dir), "--no-progress", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("eval success: ") and "(warm-start: " in last
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("train") == 2 and kinds.count("eval") == 2 and "warmstart" in kinds
    # The warm-start's validation checks (every 2 steps; 5 steps cannot reach 0.4 success).
    assert [r["sft_step"] for r in rows if "sft_loss" in r] == [1, 2, 3, 4, 5]
    assert [r["sft_step"] for r in rows if "check_success" in r] == [2, 4]
    train_row = next(r for r in rows if r["kind"] == "train")
    for key in ("reward", "success", "approx_kl", "clipfrac", "tokens_per_second"):
        assert key in train_row
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "checkpoints" / "step-000000002" / "manifest.json").exists()
    assert (run_dir / "export" / "policy" / "config.json").exists()
    summary = (run_dir / "summary.txt").read_text()
    assert "final_success:" in summary and "warmstart_success:" in summary
    assert "seconds:" in summary and "rl_seconds:" in summary
    assert load_config(run_dir / "config.yaml").train.steps == 2
    # eval of the run's latest checkpoint prints a table.
    evaluated = cli("eval", "--run-dir", str(run_dir), "--tasks", "4")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "| step-000000002 | 4 |" in evaluated.stdout
    # Running again on the folder is an error naming both choices; --resume continues from the
    # checkpoints: no second warm-start, no step redone.
    refused = cli("train", "--steps", "3", "--run-dir", str(run_dir), "--no-progress", *TINY)
    assert refused.returncode != 0
    assert "holds checkpoints of an earlier run: continue it with --resume" in refused.stderr
    again = cli("train", "--steps", "3", "--run-dir", str(run_dir), "--no-progress", "--resume",
                *TINY)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "warm-start: " not in again.stdout.split("eval success")[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    # A new run from the saved warm-start: no demonstrations, no supervised steps, the same
    # policy (the same warm-start evaluation).
    from agentrl_fast.cli import main
    assert main(["train", "--steps", "1", "--run-dir", str(tmp_path / "loaded"), "--no-progress",
                 *TINY, "--set", f"warmstart.load={run_dir / 'warmstart.pt'}"]) == 0
    assert (json.loads((tmp_path / "loaded" / "warmstart.json").read_text())
            == json.loads((run_dir / "warmstart.json").read_text()))
    rows = [json.loads(line)
            for line in (tmp_path / "loaded" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "warmstart"]


@pytest.mark.parametrize("args, fragment", [
    (["--set", "train.algo=dpo"], "train: algo must be one of ppo, grpo"),
    (["--set", "train.rollout.context_budget=-5"], "context_budget must be an int >= 1"),
    (["--set", "train.rollout.context_budget=60"],
     "train.rollout.context_budget (60) is smaller than the system prompt"),
    (["--set", "train.stepz=3"], "train.stepz: unknown field"),
    (["--set", "train.steps=many"], "train.steps: expected int"),
    (["--set", "eval.tasks=500"], "eval.tasks (500) exceeds env.eval_size"),
    (["--config", "nowhere.yaml"], "config file nowhere.yaml does not exist"),
    (["--set", "train.rollout.max_turns=2", "--set", "warmstart.demos=4"],
     "warmstart.demos: the expert solved none of 4 tasks"),
    (["--set", "warmstart.expert_read_probability=1.5"],
     "warmstart.expert_read_probability must be in [0, 1], got 1.5"),
    (["--set", "warmstart.expert_careless_vaults=-0.1"],
     "warmstart.expert_careless_vaults must be in [0, 1], got -0.1"),
    (["--set", "env.error_penalty=-0.5"], "env.error_penalty must be in [0, 1], got -0.5"),
    (["--set", "warmstart.target_success=0"],
     "warmstart.target_success must be in (0, 1] (or null), got 0"),
    (["--set", "warmstart.check_every=0"],
     "warmstart.check_every and warmstart.check_tasks must be >= 1, got 0 and 50"),
    (["--set", "warmstart.confirm_checks=0"], "warmstart.confirm_checks must be >= 1, got 0"),
    (["--set", "warmstart.fine_check_every=0"], "warmstart.fine_check_every must be >= 1, got 0"),
    (["--set", "warmstart.fine_check_from=1.5"],
     "warmstart.fine_check_from must be in [0, 1], got 1.5"),
    (["--set", "warmstart.max_fine_steps=0"],
     "warmstart.max_fine_steps must be >= 1 (or null), got 0"),
    (["--set", "warmstart.load=nowhere.pt"], "warmstart.load: no such file 'nowhere.pt'"),
    (["--set", f"warmstart.load={ROOT / 'README.md'}"],
     "warmstart.load: '" + str(ROOT / "README.md") + "' is not a state dict of this run's model"),
    (["--set", "warmstart.check_tasks=60"],
     "eval.tasks (200) + warmstart.check_tasks (60) exceed env.eval_size (250)"),
    (["--set", "eval.every=0"], "eval.every must be >= 1 (or null: off), got 0"),
    (["--set", "eval.every=5", "--set", "eval.every_tasks=300"],
     "eval.every_tasks must be in [1, eval.tasks (200)]"),
    (["--algo", "grpo", "--set", "train.rollout.samples_per_task=1"],
     "train.rollout.samples_per_task must be >= 2 with GRPO's advantages"),
])
def test_bad_configuration_fails_at_start_naming_the_field(args, fragment, tmp_path, capsys):
    # In this process: `main` is what the console script runs (the child-process path is
    # test_tokenizer_without_the_chat_tokens_is_refused's and the end-to-end test's).
    from agentrl_fast.cli import main
    returncode = main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress", *args])
    output = capsys.readouterr()
    assert returncode == 2, output.out + output.err
    assert fragment in output.err, output.err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


@pytest.mark.parametrize("successes, confirm, stops", [
    ([], 1, False), ([0.4], 1, True), ([0.1, 0.39], 1, False),
    ([0.1, 0.4], 2, False),  # the first check past the target is not confirmed yet
    ([0.1, 0.4, 0.5], 2, True), ([0.4, 0.3, 0.4], 2, False), ([0.4, 0.3, 0.4, 0.42], 2, True),
    ([0.5, 0.5], 3, False), ([0.2, 0.5, 0.5, 0.6], 3, True),
])
def test_warm_start_stops_after_confirm_checks_in_a_row_reach_the_target(successes, confirm,
                                                                         stops):
    from agentrl_fast.train.run import target_confirmed
    assert target_confirmed(successes, 0.4, confirm) is stops


@pytest.mark.parametrize("successes, interval", [
    ([], 25), ([0.0, 0.08], 25), ([0.0, 0.1], 5), ([0.16, 0.02], 5), ([0.74], 5),
])
def test_checks_come_finer_once_the_supervised_transition_begins(successes, interval):
    from agentrl_fast.config import WarmStartConfig
    from agentrl_fast.train.run import check_interval
    warmstart = WarmStartConfig(check_every=25, fine_check_every=5, fine_check_from=0.1)
    assert check_interval(successes, warmstart) == interval


@pytest.mark.parametrize("successes, cap, stops", [
    ([0.0, 0.1], 50, False),  # no check reached fine_check_from (0.2)
    ([0.0, 0.2, 0.3], 50, False),  # steps 50, 55, 60: 10 steps past the first fine check
    ([0.0] + [0.2] * 11, 50, True),  # the check at 105 is 50 steps past 55
    ([0.0, 0.3] + [0.1] * 10, 50, True),  # a drop below fine_check_from does not restart it
    ([0.0] + [0.2] * 11, None, False),
])
def test_warm_start_ends_max_fine_steps_after_the_first_fine_check(successes, cap, stops):
    from agentrl_fast.config import WarmStartConfig
    from agentrl_fast.train.run import fine_steps_spent
    warmstart = WarmStartConfig(fine_check_from=0.2, max_fine_steps=cap)
    checks = [{"sft_step": 50 + 5 * i, "check_success": s} for i, s in enumerate(successes)]
    assert fine_steps_spent(checks, warmstart) is stops


def test_warm_start_runs_its_checks_on_the_schedule():
    """The real warm-start (tiny budget): coarse checks until one reaches fine_check_from (0 here:
    the first does), then one every fine_check_every steps."""
    from agentrl_fast.train.run import build, expert_demonstrations, warm_start
    config = apply_overrides(RunConfig(), [
        "warmstart.demos=4", "warmstart.steps=7", "warmstart.check_every=3",
        "warmstart.check_tasks=2", "warmstart.fine_check_every=2",
        "warmstart.fine_check_from=0.0", "warmstart.batch_sequences=4"])
    environment, chat, policy = build(config)
    demos = expert_demonstrations(config, chat, environment)
    logged = []
    losses, checks = warm_start(config, policy, chat, environment, demos, log=logged.append)
    assert len(losses) == 7  # 7 steps cannot reach 0.4 success twice
    assert [c["sft_step"] for c in checks] == [3, 5, 7]
    assert [row for row in logged if "check_success" in row] == checks


def test_tokenizer_without_the_chat_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path / "tok")
    result = cli("train", "--run-dir", str(tmp_path / "run"), "--no-progress", "--set",
                 f"model.tokenizer={tmp_path / 'tok'}", timeout=120)
    assert result.returncode == 2
    assert "model.tokenizer: the tokenizer lacks Qwen3's chat tokens ['<|im_start|>'" in result.stderr
    assert "resize_token_embeddings" in result.stderr


def test_config_files_and_overrides():
    assert load_config(ROOT / "configs" / "default.yaml") == RunConfig()
    grpo = load_config(ROOT / "configs" / "grpo.yaml")
    assert grpo.train.algo == "grpo" and grpo.train.loss_aggregation == "rollout-mean"
    assert grpo.train.steps == RunConfig().train.steps  # the same budget
    config = apply_overrides(RunConfig(), ["train.rollout.sampling.temperature=0.9",
                                                "seed=3", "model.tokenizer=null"])
    assert config.train.rollout.sampling.temperature == 0.9 and config.seed == 3
    assert isinstance(to_dict(config), dict) and isinstance(config, RunConfig)
    with pytest.raises(ConfigError, match="expected field=value"):
        apply_overrides(config, ["train.steps"])


def test_critic_warmup_and_periodic_eval_rows_and_resume(tmp_path):
    """A PPO run with one rollout per task (that it learns: test_train), critic_warmup_steps=1
    and eval.every=1: a critic_warmup row (its own step numbering) before the RL steps, an eval
    row on eval.every_tasks tasks after every RL step but the last, the periodic evaluations'
    share of the run in the summary; resumed, the warm-up is not redone."""
    from agentrl_fast.train.run import train_run
    overrides = [item for item in TINY if item != "--set"] + [
        "train.rollout.samples_per_task=1", "train.tasks_per_step=4",
        "train.critic_warmup_steps=1", "eval.every=1", "eval.every_tasks=2", "train.steps=2",
        "warmstart.steps=2", "warmstart.target_success=null", f"run_dir={tmp_path / 'run'}"]
    config = apply_overrides(RunConfig(), overrides)
    summary = train_run(config, progress=False, print_fn=lambda *args: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["kind"] for r in rows if r["kind"] != "warmstart"] == [
        "eval", "critic_warmup", "train", "eval", "train", "eval"]
    periodic = [r for r in rows if r.get("eval_tasks")]
    assert [(r["step"], r["eval_tasks"]) for r in periodic] == [(1, 2)]
    assert summary["steps"] == 2 and 0 < summary["periodic_eval_share"] < 1
    assert summary["periodic_eval_seconds"] == pytest.approx(periodic[0]["eval_seconds"])
    train_run(apply_overrides(config, ["train.steps=3"]), progress=False,
              print_fn=lambda *args: None, resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "critic_warmup"] == [1]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
