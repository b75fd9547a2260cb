"""Training on several ranks (torchrun, gloo, real processes): 2 ranks equal one process on the
same global batch (FSDP2 and DDP), per-rank token counts within one sub-trace, a 2-rank
checkpoint resumes on 1 and on 2 ranks and continues identically, and a killed rank ends the
job non-zero in bounded time with the rank named, after which ``--resume`` works."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from agentrl_fast.config import ConfigError, RunConfig, apply_overrides
from agentrl_fast.train.distributed import DistributedConfig, World
from agentrl_fast.train.packing import balanced_partition

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def torchrun(ranks: int, *args, timeout=240, **popen):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), *args]  # standalone: a free port of its own
    if popen:
        return subprocess.Popen(command, cwd=ROOT, env=ENV, **popen)
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------------------------------------
# The work split (no process group needed).


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_share_splits_by_tokens_within_one_sequence(size):
    rng = random.Random(size)
    for _ in range(50):
        lengths = [rng.choice([1, 2, 7, 60, 200, rng.randint(1, 300)])
                   for _ in range(rng.randint(0, 40))]
        indices = list(range(100, 100 + len(lengths)))  # shares are indices, not positions
        shares = [World(DistributedConfig(), rank, size, torch.device("cpu")).share(
            indices, lengths) for rank in range(size)]
        assert sorted(i for share in shares for i in share) == indices
        loads = [sum(lengths[i - 100] for i in share) for share in shares]
        assert max(loads) - min(loads) <= max(lengths, default=0)
        assert all(share == sorted(share) for share in shares)
    assert balanced_partition([5, 5, 5], 2) in ([[0, 1], [2]], [[0, 2], [1]], [[0], [1, 2]])


@pytest.mark.parametrize("size, num_tasks, per_task", [(1, 5, 3), (2, 5, 2), (3, 4, 1), (4, 2, 2)])
def test_tasks_and_task_order_round_trip(size, num_tasks, per_task):
    tasks = [f"task-{i}" for i in range(num_tasks)]
    worlds = [World(DistributedConfig(), rank, size, torch.device("cpu")) for rank in range(size)]
    per_rank = [[f"{t}/{k}" for t in w.tasks(tasks) for k in range(per_task)] for w in worlds]
    assert sum(len(w.tasks(tasks)) for w in worlds) == num_tasks
    assert worlds[0].in_task_order(per_rank, num_tasks, per_task) == [
        f"{t}/{k}" for t in tasks for k in range(per_task)]


@pytest.mark.parametrize("overrides, fragment", [
    (["train.distributed.strategy=zero3"],
     "train.distributed: strategy must be one of fsdp, ddp, got 'zero3'"),
    (["train.distributed.mixed_precision=fp8"],
     "train.distributed: mixed_precision must be one of none, bf16, fp16"),
    (["train.distributed.timeout_seconds=0"], "train.distributed: timeout_seconds must be > 0"),
    (["train.distributed.strategy=ddp", "train.distributed.mixed_precision=bf16"],
     "train.distributed: mixed_precision needs strategy='fsdp'"),
])
def test_bad_distributed_config_names_the_field(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        apply_overrides(RunConfig(), overrides)
    assert fragment in str(error.value)


# ---------------------------------------------------------------------------------------------
# 2 ranks = 1 process, on the trainer with a learnable reward (real torchrun, gloo).

WORKER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from test_train import ParityVaultEnvironment, chat_format, policy_for, train_config
    from agentrl_fast.train import Trainer
    from agentrl_fast.train.distributed import (DistributedConfig, World, full_state_dict,
                                                init_world, shutdown)
    # One launch trains once per strategy (comma-separated) in the same process group: a
    # torchrun launch costs ~15 CPU-seconds of imports.
    out, strategies = sys.argv[1], sys.argv[2].split(",")
    group = init_world(DistributedConfig(strategy=strategies[0]))
    for strategy in strategies:
        distributed = DistributedConfig(strategy=strategy)
        world = None if group is None else World(distributed, group.rank, group.size,
                                                 group.device)
        chat = chat_format()
        # critic_lr 1e-3, not the helper's 1e-2: Adam turns the float noise of a gradient
        # element that cancels to ~0 into a step of ~lr, which at 1e-2 exceeds float32 tolerance.
        config = train_config(steps=3, tasks_per_step=3, micro_batch_tokens=240, critic_lr=1e-3,
                              distributed=distributed)
        trainer = Trainer(policy_for(chat), chat, ParityVaultEnvironment(), config,
                          log=lambda *args: None, world=world)
        rows = trainer.train()
        state = {{name: full_state_dict(model, world) for name, model in
                  (("policy", trainer.policy), ("critic", trainer.critic),
                   ("reference", trainer.reference))}}
        if world is None or world.is_main:
            torch.save({{"rows": rows, **state}}, f"{{out}}.{{strategy}}.pt")
    shutdown()
""")

SAME = ("reward", "success", "tokens", "sub_traces", "policy_loss", "value_loss", "kl_ref",
        "approx_kl", "entropy", "clipfrac", "policy_grad_norm", "critic_grad_norm",
        "logprob_mismatch_max")


@pytest.fixture(scope="module")
def worker_script(tmp_path_factory):
    script = tmp_path_factory.mktemp("worker") / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests")))
    return script


@pytest.fixture(scope="module")
def one_process_run(worker_script):
    """The worker without torchrun (no world: the strategy is not read), shared by the FSDP2 and
    DDP comparisons."""
    out = worker_script.parent / "one"
    subprocess.run([sys.executable, str(worker_script), str(out), "fsdp"], cwd=ROOT, env=ENV,
                   check=True, timeout=240)
    return torch.load(f"{out}.fsdp.pt")


@pytest.fixture(scope="module")
def two_rank_runs(worker_script):
    """One torchrun launch of 2 ranks training under FSDP2, then DDP: (returncode, stderr, out
    prefix)."""
    out = worker_script.parent / "two"
    result = torchrun(2, str(worker_script), str(out), "fsdp,ddp")
    return result.returncode, result.stderr, out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_equal_one_process_on_the_same_global_batch(strategy, one_process_run,
                                                              two_rank_runs):
    returncode, stderr, out = two_rank_runs
    assert returncode == 0, stderr[-3000:]
    a, b = one_process_run, torch.load(f"{out}.{strategy}.pt")
    for row_a, row_b in zip(a["rows"], b["rows"], strict=True):
        for key in SAME:
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-6), key
        # Per-rank token counts differ by at most one sub-trace's length.
        assert row_b["rank_tokens_max"] - row_b["rank_tokens_min"] <= row_b["sub_trace_tokens_max"]
        assert row_b["rank_tokens_min"] > 0
    assert any(abs(row["policy_loss"]) > 1e-6 for row in a["rows"])  # it trained
    # One process runs the fused log-prob op on the unsharded head, FSDP the logits path, and
    # the ranks' gradients are averaged in another order; Adam divides each entry's gradient by
    # its own running scale, so on an entry whose gradient is near zero that rounding becomes
    # up to a few 1e-5 (one embedding entry of 63744 after three steps: 1e-5 under FSDP, 2.4e-5
    # under DDP). A sharding bug moves whole tensors: every entry within rtol 1e-4 / atol 2e-5
    # but at most 4 per tensor, and those within 1e-4.
    for name in ("policy", "critic", "reference"):
        for key, value in a[name].items():
            diff = (b[name][key] - value).abs()
            outside = diff > 2e-5 + 1e-4 * value.abs()
            assert int(outside.sum()) <= 4 and float(diff.max()) <= 1e-4, (
                f"{name} {key}: {int(outside.sum())} of {diff.numel()} entries outside "
                f"rtol 1e-4 / atol 2e-5, largest difference {float(diff.max()):.2e}")
    moved = max(float((a["policy"][k] - a["reference"][k]).abs().max()) for k in a["policy"])
    assert moved > 1e-4  # the comparison is not of two untouched copies


# ---------------------------------------------------------------------------------------------
# The CLI under torchrun: checkpoints across world sizes, a killed rank, --resume.

TINY = ["--no-progress", "--set", "warmstart.steps=0", "--set", "eval.tasks=2",
        "--set", "train.tasks_per_step=4", "--set", "train.rollout.samples_per_task=2",
        "--set", "train.entropy_coef=0.01", "--set", "train.policy_lr=1e-3",
        "--set", "train.checkpoint_every=1", "--set", "train.keep_checkpoints=10"]


def cli_args(run_dir, steps, *extra):
    return ["-m", "agentrl_fast.cli", "train", "--run-dir", str(run_dir), "--steps", str(steps),
            *TINY, *extra]


def exported(run_dir):
    from safetensors.torch import load_file
    return load_file(str(run_dir / "export" / "policy" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """``(run_dir, exported policy)``: 3 steps on 2 ranks, a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("two-rank") / "straight"
    result = torchrun(2, *cli_args(run_dir, 3))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, exported(run_dir)


def resumable_copy(straight_dir: Path, to: Path) -> Path:
    """A copy of the straight run stopped after step 2 (no step 3, no export)."""
    import shutil
    shutil.copytree(straight_dir, to, ignore=shutil.ignore_patterns("step-000000003", "export"))
    return to


def assert_same_policy(run_dir: Path, expected: dict) -> None:
    got = exported(run_dir)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=2e-6, msg=key)


@pytest.mark.slow
def test_a_two_rank_checkpoint_is_sharded_and_evaluates(straight):
    run_dir, _ = straight
    manifest = json.loads((run_dir / "checkpoints" / "step-000000002" / "manifest.json")
                          .read_text())
    assert manifest["entries"]["dcp"]["kind"] == "dcp" and manifest["entries"]["dcp"]["files"]
    evaluated = subprocess.run([sys.executable, "-m", "agentrl_fast.cli", "eval", "--run-dir",
                                str(run_dir), "--tasks", "2"], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "| step-000000003 | 2 |" in evaluated.stdout


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 1])
def test_a_two_rank_checkpoint_resumes_on_one_and_two_ranks_identically(straight, tmp_path,
                                                                         ranks):
    run_dir, expected = straight
    resumed = resumable_copy(run_dir, tmp_path / f"on-{ranks}")
    result = torchrun(ranks, *cli_args(resumed, 3, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoints' / 'step-000000002'}" in result.stdout
    assert_same_policy(resumed, expected)
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]  # none redone


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_in_one_process_without_torchrun(straight, tmp_path):
    run_dir, expected = straight
    single = resumable_copy(run_dir, tmp_path / "single")
    result = subprocess.run([sys.executable, *cli_args(single, 3, "--resume")], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_policy(single, expected)


@pytest.mark.slow
def test_a_damaged_or_unlisted_checkpoint_file_skips_that_checkpoint(straight, tmp_path):
    """Every file of the dcp/ folder is verified at load: a damaged or an unlisted one makes
    that checkpoint skipped, with the file named."""
    import shutil
    from agentrl_fast.train.checkpoint import latest_checkpoint
    damaged = tmp_path / "damaged"
    shutil.copytree(straight[0] / "checkpoints", damaged)
    shard = sorted((damaged / "step-000000003" / "dcp").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (damaged / "step-000000002" / "dcp" / "stray.distcp").write_bytes(b"x")
    messages = []
    path, step, state = latest_checkpoint(damaged, log=messages.append)
    assert step == 1 and path.name == "step-000000001"
    assert f"dcp/{shard.name}: checksum mismatch" in messages[0]
    assert "dcp/stray.distcp: not listed in manifest.json" in messages[1]


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the worker with ``RANK=rank`` among ``parent``'s children."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_a_killed_rank_ends_the_job_non_zero_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "torchrun.log", "w")
    job = torchrun(2, *cli_args(run_dir, 50), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while not (run_dir / "checkpoints" / "step-000000002").exists():
        assert job.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint within 180 s"
        time.sleep(0.2)
    victim = _rank_pid(job.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    try:
        job.wait(timeout=90)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job hung after a rank died")
    log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert job.returncode != 0
    assert time.time() - killed_at < 90
    assert "rank      : 1" in output and "SIGKILL" in output, output[-3000:]
    done = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert done and done[-1] < 50
    result = torchrun(2, *cli_args(run_dir, done[-1] + 1, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(step {done[-1]})" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("eval success: ")


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    result = subprocess.run([sys.executable, *cli_args(tmp_path / "new", 1, "--resume")],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--resume: no complete checkpoint in" in result.stderr


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_trains(tmp_path):
    """FSDP2 with bf16 parameters in forward/backward (float32 reductions and master weights):
    it runs on gloo, its losses are finite and the exported float32 policy moved."""
    run_dir = tmp_path / "bf16"
    result = torchrun(2, *cli_args(run_dir, 2, "--set", "train.distributed.mixed_precision=bf16"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2 and all(torch.isfinite(torch.tensor(r["policy_loss"])) for r in train)
    assert any(r["policy_grad_norm"] > 0 for r in train)
    from agentrl_fast.config import load_config
    from agentrl_fast.train.run import build
    _, _, initial = build(load_config(run_dir / "config.yaml"))
    final = exported(run_dir)
    assert all(final[k].dtype == torch.float32 for k in final)
    assert max(float((final[k] - v).abs().max()) for k, v in initial.state_dict().items()
               if k in final) > 1e-4
