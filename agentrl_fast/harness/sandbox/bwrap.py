"""The bubblewrap command line around one sandboxed run (:mod:`.sandbox` runs it).

What the program sees: new PID, network, IPC, UTS and cgroup namespaces and a new user
namespace; a root of its own holding, read-only, only the system directories (``/usr`` and its
``/bin``, ``/lib*``, ``/sbin`` links) and the base interpreter's prefix (plus the paths the
caller names); its own ``/proc`` (its own processes only) and a minimal ``/dev``; a fresh
size-capped ``tmpfs`` as ``/tmp`` (the working directory) and ``/dev/shm``. Not the trainer's
working directory, home, run folder, virtual environment, ``/etc`` or network.

The uid. As root, ``RLIMIT_NPROC`` is not enforced, and a user namespace mapped onto root is
still root to the kernel's counters. So when the trainer is root, bwrap runs privileged (it needs
no user namespace of its own) keeping only ``CAP_SETUID``/``CAP_SETGID``, and the launcher inside
sets ``RLIMIT_NPROC``, drops to a fresh unprivileged uid (:func:`sandbox_uid`, random per run so
that concurrent runs do not share a process count) and then enters a new user namespace that
shows that uid as :data:`INNER_UID`. A trainer that is not root (or is the root of a rootless
container) already is unprivileged: bwrap makes the user namespace itself (``--unshare-user``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import Iterable

INNER_UID = 1000
"""The uid (and gid) the program sees inside the sandbox, whatever the uid outside."""

SCRATCH_MB = 128
"""Size of each fresh ``tmpfs`` (``/tmp``, the working directory, and ``/dev/shm``)."""

# Fresh uids for root's sandboxes: a range no login or container mapping normally uses.
_UID_BASE, _UID_RANGE = 1_500_000_000, 1 << 24
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def bwrap_path() -> str | None:
    """The ``bwrap`` executable on the trainer's ``PATH``, or ``None``."""
    return shutil.which("bwrap")


def _is_host_root() -> bool:
    """Root of the host's user namespace (not the root of a rootless container, which is an
    ordinary uid outside and cannot take on unmapped uids)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return [line.split() for line in f] == [["0", "0", "4294967295"]]
    except OSError:
        return False


def sandbox_uid() -> int:
    """A fresh unprivileged uid for one run of a root trainer (-1 when the trainer is not
    root and so has no uid to drop)."""
    return _UID_BASE + secrets.randbelow(_UID_RANGE) if _is_host_root() else -1


def interpreter_paths() -> list[str]:
    """The base interpreter's prefix (and exec prefix): what ``python -I -S`` needs besides the
    system libraries. A virtual environment's own prefix is not in it."""
    return sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)})


def base_python() -> str:
    """The base interpreter (the one a virtual environment was made from), which runs inside
    the sandbox without the trainer's virtual environment."""
    if sys.prefix == sys.base_prefix:
        return sys.executable
    real = os.path.realpath(sys.executable)
    if real.startswith(os.path.realpath(sys.base_prefix) + os.sep):
        return real
    return os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}."
                                                f"{sys.version_info[1]}")


def _system_mounts() -> list[str]:
    args = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _bind_mounts(paths: Iterable[str], made: set[str], bind: str = "--ro-bind") -> list[str]:
    """Read-only binds (``bind="--bind"``: writable ones) at their own paths. bwrap makes missing
    parents mode 0700, which an unprivileged uid cannot cross, so each parent is made first as
    0755 (and stays empty)."""
    args = []
    for path in paths:
        parents = []
        parent = os.path.dirname(path)
        while parent not in ("/", ""):
            parents.append(parent)
            parent = os.path.dirname(parent)
        for parent in reversed(parents):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += [bind, path, path]
    return args


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without those already visible: under a system directory or another path."""
    covered = tuple(d + "/" for d in _SYSTEM_DIRS)
    kept: list[str] = []
    for path in sorted(set(paths)):
        if not (path + "/").startswith(covered) and not any(
                path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def bwrap_command(bwrap: str, inner: list[str], *, uid: int, cwd: str | None,
                  read_only_paths: Iterable[str] = (),
                  writable_paths: Iterable[str] = ()) -> list[str]:
    """``bwrap`` options then ``inner`` (the launcher and the program). ``uid``: from
    :func:`sandbox_uid` (-1: unprivileged trainer, bwrap makes the user namespace); ``cwd``: a
    host directory bound read-only as the working directory (``None``: the fresh ``/tmp``),
    writable when it is one of ``writable_paths`` (host directories bound writable, after the
    read-only ones: an MCP server's rollout folder)."""
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if uid >= 0:  # root: privileged bwrap; the launcher drops to `uid` and makes the user ns
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--uid", str(INNER_UID), "--gid", str(INNER_UID),
                 "--cap-drop", "ALL"]
    paths = [os.path.realpath(p) for p in (*interpreter_paths(), *read_only_paths)]
    writable = [os.path.realpath(p) for p in writable_paths]
    if cwd is not None and os.path.realpath(cwd) not in writable:
        paths.append(os.path.realpath(cwd))
    if "/" in paths + writable:
        raise ValueError("run_sandboxed: cannot bind '/' into the sandbox (cwd or "
                         "read_only_paths); name a directory below it")
    size = str(SCRATCH_MB * 1024 * 1024)
    args += _system_mounts() + [
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
        "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    # After /tmp, so that a directory under the host's /tmp is not hidden by the fresh tmpfs.
    made = {"/tmp", "/dev", "/dev/shm", "/proc"}
    args += _bind_mounts(_outermost(paths), made)
    args += _bind_mounts(_outermost(writable), made, bind="--bind")
    args += ["--remount-ro", "/", "--chdir", os.path.realpath(cwd) if cwd is not None else "/tmp"]
    return args + ["--", *inner]
