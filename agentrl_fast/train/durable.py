"""Durable files for checkpoints: fsync, sha256 while writing, atomic installation of a
directory (``renameat2(RENAME_EXCHANGE)`` where the kernel has it), removal that never leaves a
half-deleted directory under its final name, and temporary directories a crashed writer left
behind cleaned up by pid."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import sys
import threading
from pathlib import Path

TMP_PREFIX = ".tmp-"
_TMP_PID = re.compile(r"-(\d+)$")
_CHUNK = 1 << 20

# Temporary directories this process is writing right now (never cleaned as stale).
_IN_PROGRESS: set[Path] = set()
_IN_PROGRESS_LOCK = threading.Lock()



def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_and_hash(path: Path) -> tuple[int, str]:
    """Flush a written file to disk; return its size and sha256 (read back from the file)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def remove(path: Path) -> None:
    """Delete a file or directory tree; a missing one is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def remove_atomically(path: Path) -> None:
    """Take ``path`` out of the visible names in one rename, then delete it."""
    doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    remove(doomed)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def install(tmp: Path, final: Path) -> None:
    """Give the complete directory ``tmp`` the name ``final``, replacing any existing one."""
    parent = final.parent
    if not os.path.lexists(final):
        try:
            os.rename(tmp, final)
            fsync_dir(parent)
            return
        except OSError as error:  # appeared meanwhile (non-empty): replace it below
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
    if _exchange(tmp, final):  # the new one is in place; ``tmp`` now holds the old one
        fsync_dir(parent)
        remove(tmp)
        return
    aside = parent / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
    remove(aside)
    os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(parent)
    remove(aside)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def new_tmp_dir(parent: Path, final_name: str) -> Path:
    tmp = parent / f"{TMP_PREFIX}{final_name}-{os.getpid()}"
    remove(tmp)  # a leftover of this pid (an earlier process with the same pid, or a failure)
    tmp.mkdir()
    with _IN_PROGRESS_LOCK:
        _IN_PROGRESS.add(tmp)
    return tmp


def done_tmp_dir(tmp: Path) -> None:
    with _IN_PROGRESS_LOCK:
        _IN_PROGRESS.discard(tmp)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return True
    return True


def clean_stale_tmp(directory: Path) -> None:
    """Delete ``.tmp-*`` leftovers of dead processes (and of this pid, unless being written)."""
    me = os.getpid()
    for path in directory.iterdir():
        if not path.name.startswith(TMP_PREFIX):
            continue
        match = _TMP_PID.search(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        with _IN_PROGRESS_LOCK:
            busy = path in _IN_PROGRESS
        if busy or (pid != me and _pid_alive(pid)):
            continue
        remove(path)


def as_path(what: str, value) -> Path:
    """``value`` (a str or os.PathLike, not empty) as a Path; ``what`` names the argument."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike, got {type(value).__name__}")
    path = Path(value)
    if not str(path):
        raise ValueError(f"{what} must be a non-empty path")
    return path
