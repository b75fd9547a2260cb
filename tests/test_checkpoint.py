"""Checkpoints: round trip and exact continuation, newest-valid selection, detection of truncated,
damaged and incomplete checkpoints, leftovers, pruning, replacement, SIGKILL during saves, and
the Hugging Face export."""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl_fast.harness.memory import MemoryStore
from agentrl_fast.train import checkpoint as ckpt
from agentrl_fast.train import durable
from agentrl_fast.train.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint,
                                           rng_state, save_checkpoint, set_rng_state)
from agentrl_fast.train.export import export_pretrained

ROOT = Path(__file__).resolve().parent.parent


def assert_same(actual, expected, where="state"):
    """Equal values with equal types all the way down (tensors: dtype, shape and bits)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def small_state(step: int) -> dict:
    return {"weights": {"w": torch.arange(1000, dtype=torch.float32) + step},
            "memory": bytes([step % 256]) * 100,
            "progress": {"step": step, "data_position": 3 * step}}


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def tmp_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


# ---------------------------------------------------------------------------------------------
# Round trip and continuation.


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_training(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.8 ** epoch)
    return optimizer, scheduler


def train_step(model, optimizer, scheduler):
    """One step whose data comes from all three random streams (torch, numpy, random)."""
    x = torch.randn(4, 8)
    target = float(np.random.standard_normal()) + random.random()
    loss = ((model(x) - target) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def test_round_trip_and_resumed_training_continues_identically(tmp_path):
    torch.manual_seed(0)
    np.random.seed(1)
    random.seed(2)
    model = make_model()
    optimizer, scheduler = make_training(model)
    train_step(model, optimizer, scheduler)
    store = MemoryStore()
    store.namespace("agent-1").write("plan", "open the vault")
    state = {"policy": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "rng": rng_state(), "memory": store.snapshot(),
             "progress": {"step": 1, "data_position": 17, "epoch": 0, "seen": [3, 1, 2]}}
    saved = copy.deepcopy(state)  # training below updates the state dicts' tensors in place
    path = save_checkpoint(tmp_path, 1, state)
    assert path == tmp_path / "step-000000001"

    for _ in range(3):  # the uninterrupted run
        train_step(model, optimizer, scheduler)

    step, loaded = load_checkpoint(path)
    assert step == 1
    assert_same(loaded, saved)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["version"] == ckpt.FORMAT_VERSION
    kinds = {name: (entry["file"], entry["kind"]) for name, entry in manifest["entries"].items()}
    assert kinds == {"policy": ("policy.pt", "torch"), "optimizer": ("optimizer.pt", "torch"),
                     "scheduler": ("scheduler.json", "json"), "rng": ("rng.pt", "torch"),
                     "memory": ("memory.bin", "bytes"), "progress": ("progress.json", "json")}
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["manifest.json"] + [file for file, _ in kinds.values()])
    assert (path / "memory.bin").read_bytes() == saved["memory"]

    # The resumed run: fresh objects (different init and random streams), then the checkpoint.
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    resumed = make_model()
    resumed_optimizer, resumed_scheduler = make_training(resumed)
    resumed.load_state_dict(loaded["policy"])
    resumed_optimizer.load_state_dict(loaded["optimizer"])
    resumed_scheduler.load_state_dict(loaded["scheduler"])
    set_rng_state(loaded["rng"])
    restored_store = MemoryStore()
    restored_store.restore(loaded["memory"])
    assert restored_store.namespace("agent-1").read("plan") == "open the vault"
    for _ in range(3):
        train_step(resumed, resumed_optimizer, resumed_scheduler)

    assert_same(resumed.state_dict(), model.state_dict())
    assert_same(resumed_optimizer.state_dict(), optimizer.state_dict())
    assert resumed_scheduler.state_dict() == scheduler.state_dict()


def test_rng_state_continues_every_stream(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    np.random.standard_normal()  # leaves a cached gaussian in NumPy's legacy state
    save_checkpoint(tmp_path, 0, {"rng": rng_state()})
    expected = (random.random(), np.random.standard_normal(3), torch.randn(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(load_checkpoint(tmp_path / "step-000000000")[1]["rng"])
    actual = (random.random(), np.random.standard_normal(3), torch.randn(3))
    assert actual[0] == expected[0]
    assert np.array_equal(actual[1], expected[1])
    assert torch.equal(actual[2], expected[2])


@pytest.mark.gpu
def test_rng_state_continues_cuda_streams(tmp_path):
    torch.cuda.manual_seed_all(3)
    torch.randn(5, device="cuda")
    save_checkpoint(tmp_path, 0, {"rng": rng_state()})
    expected = torch.randn(5, device="cuda")
    torch.cuda.manual_seed_all(0)
    set_rng_state(load_checkpoint(tmp_path / "step-000000000")[1]["rng"])
    assert torch.equal(torch.randn(5, device="cuda"), expected)


@pytest.mark.gpu
def test_cuda_tensors_load_onto_the_cpu_by_default(tmp_path):
    save_checkpoint(tmp_path, 0, {"t": torch.ones(3, device="cuda")})
    assert load_checkpoint(tmp_path / "step-000000000")[1]["t"].device.type == "cpu"


# ---------------------------------------------------------------------------------------------
# Finding the newest valid checkpoint; damaged and incomplete ones.


def test_latest_checkpoint_picks_the_newest(tmp_path):
    assert latest_checkpoint(tmp_path / "absent", log=pytest.fail) is None
    assert latest_checkpoint(tmp_path, log=pytest.fail) is None
    for step in (5, 40, 12):
        save_checkpoint(tmp_path, step, small_state(step), keep=None)
    path, step, state = latest_checkpoint(tmp_path, log=pytest.fail)
    assert (path, step) == (tmp_path / "step-000000040", 40)
    assert_same(state, small_state(40))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file"])
def test_damaged_file_is_skipped_with_a_message_naming_it(tmp_path, damage):
    save_checkpoint(tmp_path, 20, small_state(20))
    newest = save_checkpoint(tmp_path, 40, small_state(40))
    target = newest / "weights.pt"
    size = target.stat().st_size
    if damage == "truncate":
        with open(target, "r+b") as f:
            f.truncate(size // 2)
        reason = "weights.pt: size mismatch"
    elif damage == "flip":
        flip_byte(target, size // 2)  # same size: only the sha256 can tell
        assert target.stat().st_size == size
        reason = "weights.pt: checksum mismatch"
    else:
        target.unlink()
        reason = "weights.pt: missing"

    messages = []
    path, step, state = latest_checkpoint(tmp_path, log=messages.append)
    assert (path, step) == (tmp_path / "step-000000020", 20)
    assert_same(state, small_state(20))
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"skipping checkpoint {newest}: {reason}"), messages
    assert "trying an older one" in messages[0]
    with pytest.raises(CheckpointError, match=reason) as error:
        load_checkpoint(newest)
    assert error.value.path == newest and isinstance(error.value, ValueError)


def test_damage_is_detected_before_deserializing(tmp_path, monkeypatch):
    newest = save_checkpoint(tmp_path, 1, small_state(1))
    flip_byte(newest / "weights.pt", 100)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called on an unverified checkpoint")

    monkeypatch.setattr(ckpt.torch, "load", refuse)
    with pytest.raises(CheckpointError, match="weights.pt: checksum mismatch"):
        load_checkpoint(newest)


def test_missing_manifest_is_skipped_with_a_message(tmp_path):
    save_checkpoint(tmp_path, 1, small_state(1))
    newest = save_checkpoint(tmp_path, 2, small_state(2))
    (newest / "manifest.json").unlink()
    messages = []
    assert latest_checkpoint(tmp_path, log=messages.append)[1] == 1
    assert messages == [(f"skipping checkpoint {newest}: manifest.json is missing (checkpoint "
                         f"incomplete); trying an older one")]
    # With nothing older left, the message says so and the result is None.
    (tmp_path / "step-000000001" / "weights.pt").unlink()
    messages.clear()
    assert latest_checkpoint(tmp_path, log=messages.append) is None
    assert len(messages) == 2 and messages[1].endswith("no older checkpoint left"), messages


def _edit_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _resealed(edit):
    """An edit followed by a correct manifest checksum (so a deeper check must catch it)."""
    def apply(manifest):
        manifest.pop("manifest_sha256")
        edit(manifest)
        manifest["manifest_sha256"] = ckpt._manifest_digest(manifest)
    return apply


BAD_MANIFESTS = {
    "garbage": (lambda p: (p / "manifest.json").write_bytes(b"\x00{not json"),
                "manifest.json is unreadable"),
    "truncated": (lambda p: (p / "manifest.json").write_bytes(
        (p / "manifest.json").read_bytes()[:40]), "manifest.json is unreadable"),
    "not_a_manifest": (lambda p: (p / "manifest.json").write_text("[1, 2]"),
                       "manifest.json is not a checkpoint manifest"),
    "version": (lambda p: _edit_manifest(p, lambda m: m.update(version=99)),
                "manifest.json has unknown format version 99"),
    "edited_step": (lambda p: _edit_manifest(p, lambda m: m.update(step=8)),
                    "manifest.json: checksum mismatch"),
    "edited_size": (lambda p: _edit_manifest(
        p, lambda m: m["entries"]["weights"].update(size=1)), "manifest.json: checksum mismatch"),
    "renamed_step": (lambda p: _edit_manifest(p, _resealed(lambda m: m.update(step=8))),
                     "directory name says step 7 but manifest.json says step 8"),
    "path_in_entry": (lambda p: _edit_manifest(p, _resealed(
        lambda m: m["entries"]["weights"].update(file="../weights.pt"))),
        "manifest.json has a malformed entry 'weights'"),
}


@pytest.mark.parametrize("bad", sorted(BAD_MANIFESTS))
def test_bad_manifest_raises_checkpoint_error_naming_it(tmp_path, bad):
    path = save_checkpoint(tmp_path, 7, small_state(7))
    damage, fragment = BAD_MANIFESTS[bad]
    damage(path)
    with pytest.raises(CheckpointError, match=fragment) as error:
        load_checkpoint(path)
    assert str(error.value).startswith(f"checkpoint {path}: ")
    messages = []
    assert latest_checkpoint(tmp_path, log=messages.append) is None
    assert len(messages) == 1 and fragment in messages[0] and str(path) in messages[0]


def test_load_of_a_missing_or_non_directory_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step-000000001")
    (tmp_path / "step-000000002").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_checkpoint(tmp_path / "step-000000002")
    messages = []
    assert latest_checkpoint(tmp_path, log=messages.append) is None
    assert messages and "step-000000002: is not a directory" in messages[0]


# ---------------------------------------------------------------------------------------------
# Leftovers, pruning, replacement.


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftover_tmp_dirs_are_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, 1, small_state(1))
    dead = dead_pid()
    stale = tmp_path / f".tmp-step-000000099-{dead}"
    stale.mkdir()
    (stale / "weights.pt").write_bytes(b"half a file")
    own = tmp_path / f".tmp-step-000000098-{os.getpid()}"  # an earlier process with our pid
    own.mkdir()
    alive = tmp_path / f".tmp-step-000000097-{os.getppid()}"  # a live writer: left alone
    alive.mkdir()
    assert latest_checkpoint(tmp_path, log=pytest.fail)[1] == 1
    save_checkpoint(tmp_path, 2, small_state(2))
    assert tmp_dirs(tmp_path) == [alive.name]
    assert latest_checkpoint(tmp_path, log=pytest.fail)[1] == 2


def test_keep_prunes_older_checkpoints(tmp_path):
    for step in range(5):
        save_checkpoint(tmp_path, step, small_state(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]
    for step in range(5, 8):
        save_checkpoint(tmp_path, step, small_state(step), keep=None)
    assert len(list(tmp_path.glob("step-*"))) == 5
    save_checkpoint(tmp_path, 8, small_state(8), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000008"]
    # A step saved below existing ones (a resume from an older checkpoint) is always kept.
    save_checkpoint(tmp_path, 6, small_state(6), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000006"]


@pytest.mark.parametrize("how", ["exchange", "rename_aside"])
def test_resaving_a_step_replaces_it(tmp_path, monkeypatch, how):
    if how == "rename_aside":
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)  # no renameat2
    save_checkpoint(tmp_path, 3, small_state(3))
    old = save_checkpoint(tmp_path, 5, {"weights": torch.zeros(10), "extra": [1, 2]})
    new = save_checkpoint(tmp_path, 5, small_state(5))
    assert new == old and not (new / "extra.json").exists()
    assert_same(load_checkpoint(new), (5, small_state(5)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000005"]
    # Replacing a damaged checkpoint of that step (the resume went back past it) works too.
    flip_byte(new / "weights.pt", 50)
    save_checkpoint(tmp_path, 5, small_state(5))
    assert latest_checkpoint(tmp_path, log=pytest.fail)[1] == 5


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, small_state(1))

    def broken_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 2, small_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]


# ---------------------------------------------------------------------------------------------
# SIGKILL while saving.

CHILD = """
import sys, torch
from agentrl_fast.train.checkpoint import save_checkpoint
directory, first = sys.argv[1], int(sys.argv[2])
base = torch.arange(1_500_000, dtype=torch.float32)  # 6 MB per save, plus 1 MB raw
print("ready", flush=True)
i = 0
while True:
    step = first + i // 2  # every step saved twice: the second save replaces the first
    save_checkpoint(directory, step, {"weights": {"w": base + step},
                                      "memory": bytes([step % 256]) * 1_000_000,
                                      "progress": {"step": step, "data_position": 3 * step}},
                    keep=3)
    i += 1
"""


def expected_big(step: int) -> dict:
    return {"weights": {"w": torch.arange(1_500_000, dtype=torch.float32) + step},
            "memory": bytes([step % 256]) * 1_000_000,
            "progress": {"step": step, "data_position": 3 * step}}


def test_sigkill_during_saves_leaves_only_verified_checkpoints(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    save_checkpoint(tmp_path, 0, expected_big(0))
    first = 1
    mid_save = 0
    for kill in range(5):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(first)],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            time.sleep(rng.uniform(0.05, 0.6))
            child.send_signal(signal.SIGKILL)
            _, err = child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        context = f"seed {seed}, kill {kill}"
        assert child.returncode == -signal.SIGKILL, f"{context}: child ended early\n{err}"
        mid_save += bool(tmp_dirs(tmp_path))
        steps = sorted(int(p.name[5:]) for p in tmp_path.glob("step-*"))
        assert steps and steps[-1] >= first - 1, f"{context}: {steps}"
        for step in steps:  # every directory with a final name is complete and verifies
            loaded_step, state = load_checkpoint(tmp_path / f"step-{step:09d}")
            assert loaded_step == step, context
            assert_same(state, expected_big(step), context)
        _, step, _ = latest_checkpoint(tmp_path, log=pytest.fail)
        assert step == steps[-1], context
        first = step + 1
    save_checkpoint(tmp_path, first, expected_big(first))  # cleans the dead children's leftovers
    assert tmp_dirs(tmp_path) == []
    assert len(list(tmp_path.glob("step-*"))) == 3
    print(f"seed {seed}: {mid_save} of 5 kills left a save in progress")


# ---------------------------------------------------------------------------------------------
# Bad arguments.


def test_bad_arguments_raise_before_writing(tmp_path):
    with pytest.raises(TypeError, match="step must be an int, got float"):
        save_checkpoint(tmp_path, 1.0, {})
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        save_checkpoint(tmp_path, -1, {})
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save_checkpoint(tmp_path, 1, {}, keep=0)
    with pytest.raises(TypeError, match="state must be a Mapping"):
        save_checkpoint(tmp_path, 1, [("a", 1)])
    with pytest.raises(ValueError, match="state key '../x' is not a valid entry name"):
        save_checkpoint(tmp_path, 1, {"../x": 1})
    with pytest.raises(ValueError, match="state key 'manifest' is not a valid entry name"):
        save_checkpoint(tmp_path, 1, {"manifest": 1})
    with pytest.raises(TypeError, match=r"state\['policy'\] is a torch.nn.modules.linear.Linear"
                                        r".*pass its .state_dict\(\) instead"):
        save_checkpoint(tmp_path, 1, {"policy": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match=r"state\['x'\]\['a'\]\[1\] is a numpy.float64"):
        save_checkpoint(tmp_path, 1, {"x": {"a": [torch.ones(1), np.float64(1.0)]}})
    with pytest.raises(TypeError, match="directory must be a str or os.PathLike"):
        save_checkpoint(None, 1, {})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="state is not from rng_state"):
        set_rng_state({"torch": torch.get_rng_state()})
    with pytest.raises(TypeError, match="model must have save_pretrained"):
        export_pretrained(torch.nn.Linear(2, 2), tmp_path / "export")


def test_json_and_torch_kinds_keep_exact_types(tmp_path):
    state = {"tuple": (1, 2), "nan": float("nan"), "int_keys": {1: "a"}, "empty": {},
             "plain": {"a": [1, 2.5, None, True, "é"]}, "blob": bytearray(b"\x00\x01")}
    path = save_checkpoint(tmp_path, 0, state)
    kinds = {n: e["kind"] for n, e in json.loads((path / "manifest.json").read_text())["entries"]
             .items()}
    assert kinds == {"tuple": "torch", "nan": "torch", "int_keys": "torch", "empty": "json",
                     "plain": "json", "blob": "bytes"}
    _, loaded = load_checkpoint(path)
    assert loaded["tuple"] == (1, 2) and type(loaded["tuple"]) is tuple
    assert loaded["nan"] != loaded["nan"] and loaded["int_keys"] == {1: "a"}
    assert loaded["plain"] == state["plain"] and loaded["empty"] == {}
    assert loaded["blob"] == b"\x00\x01" and type(loaded["blob"]) is bytes


# ---------------------------------------------------------------------------------------------
# Hugging Face export.


def test_export_pretrained_loads_back_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from agentrl_fast.envs.tokenizer import build_tokenizer

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    tokenizer = build_tokenizer(vocab_size=300)
    target = tmp_path / "export" / "policy"
    assert export_pretrained(model, target, tokenizer=tokenizer) == target
    assert list(target.glob("*.safetensors")) and not list(target.glob("*.bin"))
    assert tmp_dirs(target.parent) == []

    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(target).eval()
        assert type(loaded) is Qwen3ForCausalLM
        assert torch.equal(loaded(ids).logits, expected)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(target)
    text = "<tool_call>{\"name\": \"x\"}</tool_call>"
    assert reloaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]

    # A second export replaces the first completely.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5)
        expected = model(ids).logits
    export_pretrained(model, target)
    assert not (target / "tokenizer.json").exists() and tmp_dirs(target.parent) == []
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(target)(ids).logits, expected)
