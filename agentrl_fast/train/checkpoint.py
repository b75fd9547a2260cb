"""Atomic, verified training checkpoints (the Hugging Face exports: :mod:`.export`; the
durable file operations both use: :mod:`.durable`).

The trainer decides what a checkpoint holds; this module writes it so that a crash never leaves a
checkpoint that could be mistaken for a good one, and reads it back only after checking it.

Layout on disk (one directory per checkpoint, named by the zero-padded step)::

    DIRECTORY/
      step-000000040/
        manifest.json      format, version, step, and per entry: file, kind, size, sha256;
                           plus the sha256 of the manifest's own content
        policy.pt          kind "torch": tensors, state dicts, nested dict/list/tuple of tensors
                           and plain Python; torch.save, read by torch.load(weights_only=True)
        memory.bin         kind "bytes": a bytes value written raw (a MemoryStore snapshot)
        progress.json      kind "json": plain data (dict with str keys, list, str, int, finite
                           float, bool, None) that survives a JSON round trip unchanged
        dcp/               kind "dcp" (a torchrun job's, :func:`save_distributed_checkpoint`):
                           models and optimizers written by every rank with
                           torch.distributed.checkpoint; each file's size and sha256 listed
      step-000000060/ ...
      .tmp-step-000000080-4242/    a save in progress (or killed) in process 4242; never read

The kind of each entry is chosen from its value (bytes -> "bytes", exact JSON data -> "json",
anything else -> "torch", checked up front to be readable by ``torch.load(weights_only=True)``).

Saving (:func:`save_checkpoint`): every file is written into ``.tmp-step-<step>-<pid>/`` and
fsynced, then ``manifest.json`` (written last, fsynced), then the temporary directory is fsynced,
renamed to ``step-<step>`` and the parent directory fsynced. Re-saving an existing step swaps the
two directories in one atomic ``renameat2(RENAME_EXCHANGE)`` where the OS offers it; elsewhere the
old one is renamed aside first (a kill between the two renames loses that step, never another).
Checkpoints pruned by ``keep`` and leftovers are renamed to a ``.tmp-`` name before being deleted.

The guarantee: a directory named ``step-<step>`` was complete when it got that name, and every
load verifies it. A ``kill -9`` at any instant leaves the previous checkpoints and either the new
one complete or no directory with its name (only ``.tmp-*`` leftovers, which are ignored and
deleted by the next save once their process is gone).

What is checked at load (:func:`load_checkpoint`), before anything is deserialized: the manifest
is readable JSON of this format and a known version, its own sha256 matches, every entry is
well-formed, the step in the directory name matches the manifest's, and every listed file exists
with the recorded size and sha256. Any failure raises :class:`CheckpointError` (a ``ValueError``)
naming the checkpoint, the file and what is wrong. :func:`latest_checkpoint` returns the newest
checkpoint that passes, logging one message per skipped (partial or corrupt) checkpoint.

Also here: :func:`rng_state` / :func:`set_rng_state` (Python ``random``, NumPy's global
generator, torch CPU and CUDA) so a resumed run continues the same random streams. One writer
per checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from agentrl_fast.train.durable import (as_path, clean_stale_tmp, done_tmp_dir, fsync_and_hash,
                                        fsync_dir, install, new_tmp_dir, remove,
                                        remove_atomically, sha256_file)

__all__ = ["CheckpointError", "save_checkpoint", "save_distributed_checkpoint",
           "load_checkpoint", "latest_checkpoint", "rng_state",
           "set_rng_state", "FORMAT", "FORMAT_VERSION"]

FORMAT = "agentrl_fast.checkpoint"
FORMAT_VERSION = 2  # 2 added the "dcp" entry kind; version 1 checkpoints read unchanged
_READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
_EXTENSIONS = {"torch": ".pt", "bytes": ".bin", "json": ".json", "dcp": ""}
_STEP_DIR = re.compile(r"^step-(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded: incomplete, damaged or of an unknown format.

    ``path`` is the checkpoint directory, ``reason`` what is wrong (naming the file)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")


# ---------------------------------------------------------------------------------------------
# Argument checks.


def _step_name(step: int) -> str:
    return f"step-{step:09d}"


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def _is_exact_json(value) -> bool:
    """True when ``json.loads(json.dumps(value)) == value`` with the same types throughout."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is list:
        return all(_is_exact_json(item) for item in value)
    if kind is dict:
        return all(type(key) is str and _is_exact_json(item) for key, item in value.items())
    return False


# Exact types torch.load(weights_only=True) reads back (subclasses such as numpy.float64 or a
# namedtuple pickle as their own class, which the weights-only unpickler refuses).
_TORCH_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                 torch.Size, torch.Tensor, torch.nn.Parameter)
_TORCH_CONTAINERS = (dict, OrderedDict, list, tuple, set)


def _check_torch_value(value, where: str) -> None:
    kind = type(value)
    if kind in _TORCH_LEAVES:
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            _check_torch_value(key, f"{where} key {key!r}")
            _check_torch_value(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for i, item in enumerate(value):
            _check_torch_value(item, f"{where}[{i}]")
        return
    hint = ""
    if hasattr(value, "state_dict"):
        hint = "; pass its .state_dict() instead"
    elif kind.__module__ == "numpy":
        hint = "; convert it with torch.from_numpy(...) or .item()"
    raise TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}, which "
                    f"torch.load(weights_only=True) cannot read{hint}; a checkpoint entry holds "
                    f"bytes, JSON data, or tensors/state dicts in dict/list/tuple/set with "
                    f"None/bool/int/float/complex/str/bytes leaves")


def _plan(state) -> list[tuple[str, str, Any]]:
    """(name, kind, value) per entry of ``state``, every check done before touching the disk."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a Mapping from entry name to value, got "
                        f"{type(state).__name__}")
    plan = []
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state keys must be str (they name files), got {name!r}")
        if not _NAME.match(name) or name == "manifest":
            raise ValueError(f"state key {name!r} is not a valid entry name; use 1-128 "
                             f"characters from A-Z a-z 0-9 _ . - (not starting with . or -), "
                             f"other than 'manifest'")
        if isinstance(value, (bytes, bytearray, memoryview)):
            kind = "bytes"
        elif _is_exact_json(value):
            kind = "json"
        else:
            _check_torch_value(value, f"state[{name!r}]")
            kind = "torch"
        plan.append((name, kind, value))
    return plan


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*`` entry, newest first."""
    found = []
    for path in directory.iterdir():
        match = _STEP_DIR.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    found.sort(key=lambda item: (item[0], item[1].name), reverse=True)
    return found


def _manifest_digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Save, load, find.


def save_checkpoint(directory: str | os.PathLike, step: int, state: Mapping[str, Any], *,
                    keep: int | None = 3) -> Path:
    """Write ``state`` as ``directory/step-<step:09d>/`` atomically; return that path.

    One file per entry of ``state`` (see the module docstring for kinds and layout), a
    ``manifest.json`` with each file's size and sha256, everything fsynced before the directory
    gets its final name. An existing checkpoint of the same step is replaced. Afterwards keeps
    the newest ``keep`` checkpoints by step (always including this one; ``None`` keeps all) and
    deletes ``.tmp-*`` leftovers of processes that are gone.
    """
    directory = as_path("directory", directory)
    step = _check_step(step)
    _check_keep(keep)
    plan = _plan(state)
    final, tmp = _start(directory, step)
    try:
        _publish(tmp, final, step, _write_entries(tmp, plan))
    except BaseException:
        remove(tmp)
        raise
    finally:
        done_tmp_dir(tmp)
    _prune(directory, final, keep)
    return final


def save_distributed_checkpoint(directory: str | os.PathLike, step: int, world,
                                sharded: Mapping[str, Any], state: Mapping[str, Any], *,
                                keep: int | None = 3) -> Path:
    """:func:`save_checkpoint` for a ``torchrun`` job; call it on every rank.

    ``sharded`` (state dicts whose tensors may be DTensor shards: models and optimizers) is
    written by all ranks with ``torch.distributed.checkpoint`` into the entry ``dcp/`` (kind
    ``"dcp"``: a folder, every file's size and sha256 in the manifest); ``state`` is rank 0's
    plain entries, as in :func:`save_checkpoint`. Rank 0 installs the directory once every rank's
    files are written, with the same guarantees (atomic name, verified at load). A checkpoint
    written by N ranks loads on M ranks or in one process (``torch.distributed.checkpoint``
    reshards). ``world``: a :class:`~agentrl_fast.train.distributed.World`.
    """
    import torch.distributed.checkpoint as dcp

    step = _check_step(step)
    tmp = final = error = None
    if world.is_main:
        try:
            directory = as_path("directory", directory)
            _check_keep(keep)
            plan = _plan(state)
            if "dcp" in state:
                raise ValueError("state key 'dcp' is the sharded entry's name")
            final, tmp = _start(directory, step)
        except Exception as failure:  # every rank raises, none waits
            error = failure
    world.check(error, "starting the checkpoint")
    tmp = Path(world.broadcast(str(tmp)))
    dcp.save(dict(sharded), checkpoint_id=str(tmp / "dcp"))
    world.barrier()  # every rank's files are complete
    if world.is_main:
        try:
            entries = _write_entries(tmp, plan)
            entries["dcp"] = _folder_entry(tmp / "dcp")
            _publish(tmp, final, step, entries)
        except Exception as failure:
            error = failure
            remove(tmp)
        finally:
            done_tmp_dir(tmp)
        if error is None:
            _prune(directory, final, keep)
    world.check(error, "writing the checkpoint")
    return Path(world.broadcast(str(final)))


def _check_keep(keep) -> None:
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise TypeError(f"keep must be an int or None, got {type(keep).__name__}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (this checkpoint is always kept) or None to "
                             f"keep all, got {keep}")


def _start(directory: Path, step: int) -> tuple[Path, Path]:
    """``(final, tmp)``: the checkpoint's name and its new temporary directory."""
    directory.mkdir(parents=True, exist_ok=True)
    if not directory.is_dir():
        raise ValueError(f"directory {directory} is not a directory")
    final = directory / _step_name(step)
    return final, new_tmp_dir(directory, final.name)


def _write_entries(tmp: Path, plan) -> dict:
    entries = {}
    for name, kind, value in plan:
        file = name + _EXTENSIONS[kind]
        path = tmp / file
        if kind == "torch":
            torch.save(value, path)
        elif kind == "bytes":
            path.write_bytes(value)
        else:
            path.write_bytes(json.dumps(value, ensure_ascii=False, allow_nan=False,
                                        indent=1).encode("utf-8"))
        size, sha256 = fsync_and_hash(path)
        entries[name] = {"file": file, "kind": kind, "size": size, "sha256": sha256}
    return entries


def _folder_entry(folder: Path) -> dict:
    """A ``"dcp"`` entry: every file under ``folder`` (fsynced) with its size and sha256; the
    entry's own size and sha256 are the total and the digest of that listing."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size, sha256 = fsync_and_hash(path)
        files[path.relative_to(folder).as_posix()] = {"size": size, "sha256": sha256}
    for sub in sorted({folder, *(p for p in folder.rglob("*") if p.is_dir())}):
        fsync_dir(sub)
    return {"file": folder.name, "kind": "dcp", "size": sum(f["size"] for f in files.values()),
            "sha256": _listing_digest(files), "files": files}


def _listing_digest(files: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode("utf-8")).hexdigest()


def _publish(tmp: Path, final: Path, step: int, entries: dict) -> None:
    """Write the manifest (last), fsync and install ``tmp`` as ``final``."""
    body = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "entries": entries}
    manifest = dict(body, manifest_sha256=_manifest_digest(body))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    fsync_and_hash(tmp / MANIFEST)
    fsync_dir(tmp)
    install(tmp, final)


def _prune(directory: Path, final: Path, keep: int | None) -> None:
    if keep is not None:
        older = [path for s, path in _step_dirs(directory) if path != final]
        for path in older[keep - 1:]:
            remove_atomically(path)
    clean_stale_tmp(directory)


def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    try:
        text = manifest_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(path, f"{MANIFEST} is missing (checkpoint incomplete)") from None
    except OSError as error:
        raise CheckpointError(path, f"{MANIFEST} is unreadable ({error})") from None
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(path, f"{MANIFEST} is unreadable (not valid JSON: {error}; file "
                                    f"damaged or partially written)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(path, f"{MANIFEST} is not a checkpoint manifest (expected "
                                    f"format {FORMAT!r})")
    version = manifest.get("version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointError(path, f"{MANIFEST} has unknown format version {version!r}; this "
                                    f"agentrl_fast reads versions "
                                    f"{', '.join(map(str, _READABLE_VERSIONS))}")
    recorded = manifest.pop("manifest_sha256", None)
    if recorded != _manifest_digest(manifest):
        raise CheckpointError(path, f"{MANIFEST}: checksum mismatch (file damaged or edited)")
    step = manifest.get("step")
    entries = manifest.get("entries")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 \
            or not isinstance(entries, dict):
        raise CheckpointError(path, f"{MANIFEST} is malformed (step or entries)")
    for name, entry in entries.items():
        ok = (isinstance(entry, dict) and _NAME.match(name) and name != "manifest"
              and entry.get("kind") in _EXTENSIONS
              and entry.get("file") == name + _EXTENSIONS[entry.get("kind")]
              and type(entry.get("size")) is int and entry["size"] >= 0
              and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])
              and (entry.get("kind") != "dcp" or _well_formed_listing(entry.get("files"))))
        if not ok:
            raise CheckpointError(path, f"{MANIFEST} has a malformed entry {name!r}: {entry!r}")
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(path, f"directory name says step {int(match.group(1))} but "
                                    f"{MANIFEST} says step {step}")
    return manifest


def _well_formed_listing(files) -> bool:
    return isinstance(files, dict) and all(
        isinstance(name, str) and name and not name.startswith("/") and ".." not in name.split("/")
        and isinstance(f, dict) and type(f.get("size")) is int and f["size"] >= 0
        and isinstance(f.get("sha256"), str) and _SHA256.match(f["sha256"])
        for name, f in files.items())


def _files_to_check(entries: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """``(path relative to the checkpoint, {size, sha256})`` of every file the entries list (a
    "dcp" entry: each file of its folder)."""
    out = []
    for entry in entries.values():
        if entry["kind"] == "dcp":
            out += [(f"{entry['file']}/{name}", f) for name, f in entry["files"].items()]
        else:
            out.append((entry["file"], entry))
    return out


def _verify(path: Path) -> dict:
    """The manifest, after checking it and every file's size and sha256."""
    manifest = _read_manifest(path)
    entries = manifest["entries"]
    for name, entry in entries.items():
        if entry["kind"] == "dcp" and (_listing_digest(entry["files"]) != entry["sha256"] or sum(
                f["size"] for f in entry["files"].values()) != entry["size"]):
            raise CheckpointError(path, f"{entry['file']}/: the listing does not match its "
                                        f"checksum or total size in {MANIFEST}")
        if entry["kind"] == "dcp" and (path / entry["file"]).is_dir():
            unlisted = sorted(p.relative_to(path / entry["file"]).as_posix()
                              for p in (path / entry["file"]).rglob("*")
                              if p.is_file() and p.relative_to(path / entry["file"]).as_posix()
                              not in entry["files"])
            if unlisted:
                raise CheckpointError(path, f"{entry['file']}/{unlisted[0]}: not listed in "
                                            f"{MANIFEST}")
    checked = _files_to_check(entries)
    for file, entry in checked:  # cheap checks first: existence and size
        try:
            size = os.stat(path / file).st_size
        except FileNotFoundError:
            raise CheckpointError(path, f"{file}: missing (listed in {MANIFEST})") from None
        except OSError as error:
            raise CheckpointError(path, f"{file}: unreadable ({error})") from None
        if size != entry["size"]:
            raise CheckpointError(path, f"{file}: size mismatch: {size} bytes on disk, "
                                        f"{MANIFEST} says {entry['size']} (file truncated, "
                                        f"damaged or partially written)")
    for file, entry in checked:
        try:
            sha256 = sha256_file(path / file)
        except OSError as error:
            raise CheckpointError(path, f"{file}: unreadable ({error})") from None
        if sha256 != entry["sha256"]:
            raise CheckpointError(path, f"{file}: checksum mismatch (file damaged or partially "
                                        f"written)")
    return manifest


def load_checkpoint(path: str | os.PathLike, *, map_location="cpu") -> tuple[int, dict]:
    """``(step, state)`` of the checkpoint directory ``path``, verified before deserializing.

    Raises :class:`CheckpointError` naming the file and the problem for a missing or unreadable
    manifest, an unknown format version, a missing file, a size or sha256 mismatch. Tensors
    are loaded onto ``map_location`` (default ``"cpu"``; ``None`` keeps the saved devices).
    """
    path = as_path("path", path)
    if not path.exists():
        raise CheckpointError(path, "does not exist")
    if not path.is_dir():
        raise CheckpointError(path, "is not a directory")
    manifest = _verify(path)
    state = {}
    for name, entry in manifest["entries"].items():
        file = path / entry["file"]
        try:
            if entry["kind"] == "dcp":  # the folder, for torch.distributed.checkpoint.load
                state[name] = file
            elif entry["kind"] == "torch":
                state[name] = torch.load(file, map_location=map_location, weights_only=True)
            elif entry["kind"] == "bytes":
                state[name] = file.read_bytes()
            else:
                state[name] = json.loads(file.read_bytes())
        except Exception as error:  # verified, yet unreadable: wrong writer or changed meanwhile
            raise CheckpointError(path, f"{entry['file']}: verified but cannot be read "
                                        f"({type(error).__name__}: {error})") from error
    return manifest["step"], state


def latest_checkpoint(directory: str | os.PathLike, *, log: Callable[[str], Any] = print,
                      map_location="cpu") -> tuple[Path, int, dict] | None:
    """The newest checkpoint in ``directory`` that verifies: ``(path, step, state)``, or None.

    Checkpoints are tried newest step first; each one that fails verification is skipped (never
    loaded) with one ``log`` message naming it, the file and the reason. ``.tmp-*`` directories
    are ignored. A missing ``directory`` gives None (a fresh run).
    """
    directory = as_path("directory", directory)
    if not callable(log):
        raise TypeError(f"log must be callable (for example print), got {type(log).__name__}")
    if not directory.exists():
        return None
    if not directory.is_dir():
        raise ValueError(f"directory {directory} is not a directory")
    candidates = _step_dirs(directory)
    for i, (_, path) in enumerate(candidates):
        try:
            step, state = load_checkpoint(path, map_location=map_location)
        except CheckpointError as error:
            then = "trying an older one" if i + 1 < len(candidates) else "no older checkpoint left"
            log(f"skipping checkpoint {path}: {error.reason}; {then}")
            continue
        return path, step, state
    return None


# ---------------------------------------------------------------------------------------------
# Random number generator states.


def rng_state() -> dict:
    """The states of Python's ``random``, NumPy's global generator, torch's CPU generator and
    (when CUDA is available) every CUDA device's generator, as a checkpoint entry."""
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the generators from :func:`rng_state` (as saved and loaded by a checkpoint).

    CUDA states are restored for the devices present (none without CUDA); the others must all be
    there."""
    import numpy as np

    if not isinstance(state, Mapping):
        raise TypeError(f"state must be the dict from rng_state(), got {type(state).__name__}")
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    unknown = [key for key in state if key not in ("python", "numpy", "torch", "cuda")]
    if missing or unknown:
        raise ValueError(f"state is not from rng_state(): missing {missing}, unknown {unknown}; "
                         f"pass the dict rng_state() returned")
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    saved = state["numpy"]
    np.random.set_state((saved["bit_generator"],
                         np.asarray(torch.as_tensor(saved["keys"]).cpu().numpy(), dtype=np.uint32),
                         int(saved["pos"]), int(saved["has_gauss"]),
                         float(saved["cached_gaussian"])))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(list(state["cuda"])[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(cuda_state, dtype=torch.uint8).cpu(), device)
