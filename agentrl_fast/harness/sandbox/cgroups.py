"""A control group per sandboxed call: one bound on the memory of all its processes together
(the scratch ``tmpfs`` pages included) and on their number, which per-process rlimits are not,
optionally on their CPU time per wall-clock second (``cpus``), and one handle that kills every
process of the call, ``setsid()`` or not, also without bubblewrap.

cgroup v1 (a ``memory`` and a ``pids`` hierarchy, and ``cpu`` where mounted;
``memory.limit_in_bytes``, ``pids.max``, ``cpu.cfs_quota_us``) and cgroup v2 (``memory.max``,
``memory.swap.max``, ``pids.max``, ``cpu.max``, ``cgroup.kill``) are both read from
``/proc/self/mountinfo`` and ``/proc/self/cgroup``. A call's groups are made below the
trainer's own (``agentrl_fast-<pid>-<n>``), which needs write access there: root on a host or a
VM, or a delegated subtree (systemd ``Delegate=yes``, a container given its own cgroup
namespace). Under v2 the trainer's group must already have ``memory`` and ``pids`` in its
``cgroup.subtree_control`` or accept them there; a group that holds processes itself cannot
(v2's no-internal-processes rule), and then :func:`cgroup_problem` says so.

The child joins its groups before anything of the call runs: the command is prefixed with a
``/bin/sh`` line that writes its own pid into each group's ``cgroup.procs`` and then ``exec``s
the launcher (or bwrap), so every process of the call is born inside.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_counter = itertools.count()
_CPU_PERIOD_US = 100_000  # the scheduler's accounting period for a cpus bound

# Writes the shell's pid into each file before "--", then execs the rest. Exit 125 when a group
# cannot be joined (the sandbox then reports that it did not start, quoting sh's message).
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Hierarchy:
    """Where a call's groups are made: ``version`` 1 or 2 and the parent directory of each
    controller (``memory``, ``pids``, ``cpu`` or ``None`` when it is not available; under v2
    they are the same directory)."""
    version: int
    memory: Path
    pids: Path
    cpu: Path | None = None


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """``(mount root, mount point, fstype, super options)`` of every cgroup mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        dash = fields.index("-")
        fstype = fields[dash + 1]
        if fstype in ("cgroup", "cgroup2"):
            options = set(fields[dash + 3].split(",")) if len(fields) > dash + 3 else set()
            out.append((fields[3], fields[4], fstype, options))
    return out


def _own_paths() -> dict[str, str]:
    """This process's group per v1 controller, and under ``""`` its v2 group."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _inside(mount_root: str, mount_point: str, path: str) -> Path:
    """The directory of group ``path`` under a mount of the hierarchy's ``mount_root``."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]
    return Path(mount_point) / path.lstrip("/")


def find_hierarchy() -> Hierarchy | None:
    """The v1 ``memory`` and ``pids`` hierarchies when both are mounted, else v2 when mounted
    (whether groups can be made there is :func:`cgroup_problem`'s question)."""
    mounts, own = _mounts(), _own_paths()
    v1 = {}
    for root, point, fstype, options in mounts:
        for controller in ("memory", "pids", "cpu"):
            if fstype == "cgroup" and controller in options and controller in own:
                v1[controller] = _inside(root, point, own[controller])
    if "memory" in v1 and "pids" in v1:
        return Hierarchy(1, v1["memory"], v1["pids"], v1.get("cpu"))
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            parent = _inside(root, point, own[""])
            return Hierarchy(2, parent, parent, parent)
    return None


class CallGroup:
    """The groups of one call: made with its limits by :meth:`create`, joined by the child
    (:meth:`wrap`), and at the end :meth:`kill`, :meth:`oom_killed`, :meth:`remove`."""

    def __init__(self, hierarchy: Hierarchy, name: str, with_cpu: bool = False):
        self.hierarchy = hierarchy
        self.memory = hierarchy.memory / name
        self.pids = hierarchy.pids / name
        self.cpu = hierarchy.cpu / name if with_cpu and hierarchy.cpu is not None else None
        self.dirs = list(dict.fromkeys(d for d in (self.memory, self.pids, self.cpu) if d))

    @classmethod
    def create(cls, hierarchy: Hierarchy, memory_bytes: int, max_processes: int,
               cpus: float | None = None) -> "CallGroup":
        """Make the groups and set the limits (``cpus``: CPU seconds per wall-clock second, all
        processes together; needs ``hierarchy.cpu``). Raises ``OSError`` if the host does not
        let us; nothing is left behind then."""
        if cpus is not None and hierarchy.cpu is None:
            raise OSError("no cpu controller in this process's control groups")
        group = cls(hierarchy, f"agentrl_fast-{os.getpid()}-{next(_counter)}", cpus is not None)
        try:
            for directory in group.dirs:
                directory.mkdir()
            if hierarchy.version == 1:
                _write(group.memory / "memory.limit_in_bytes", memory_bytes)
                if (group.memory / "memory.memsw.limit_in_bytes").exists():  # no swapping out
                    _write(group.memory / "memory.memsw.limit_in_bytes", memory_bytes)
            else:
                _write(group.memory / "memory.max", memory_bytes)
                if (group.memory / "memory.swap.max").exists():
                    _write(group.memory / "memory.swap.max", 0)
            _write(group.pids / "pids.max", max_processes)
            if cpus is not None:
                quota = max(1000, round(cpus * _CPU_PERIOD_US))
                if hierarchy.version == 1:
                    _write(group.cpu / "cpu.cfs_period_us", _CPU_PERIOD_US)
                    _write(group.cpu / "cpu.cfs_quota_us", quota)
                else:
                    _write(group.cpu / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
        except OSError:
            group.remove()
            raise
        return group

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` started inside the groups (see the module)."""
        return ["/bin/sh", "-c", _JOIN, "sh", *(str(d / "cgroup.procs") for d in self.dirs),
                "--", *command]

    def processes(self) -> list[int]:
        try:
            text = (self.pids / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    def kill(self) -> None:
        """SIGKILL every process of the call (v2: ``cgroup.kill``; v1: each listed pid, and the
        list read again until it names none not yet killed: a fork that beat the kill shows up
        there, and a killed process cannot fork any more). Does not wait for them to exit."""
        if self.hierarchy.version == 2 and (self.pids / "cgroup.kill").exists():
            try:
                _write(self.pids / "cgroup.kill", 1)
                return
            except OSError:
                pass
        killed: set[int] = set()
        while True:
            fresh = set(self.processes()) - killed
            if not fresh:
                return
            for pid in fresh:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            killed |= fresh

    def oom_killed(self) -> bool:
        """The kernel's out-of-memory killer killed a process of the call (the group's
        ``oom_kill`` count; v1 kernels before 4.13 do not count it: then any failed charge)."""
        name = "memory.oom_control" if self.hierarchy.version == 1 else "memory.events"
        try:
            counts = dict(line.split() for line in (self.memory / name).read_text().splitlines())
        except (OSError, ValueError):
            return False
        if "oom_kill" in counts:
            return int(counts["oom_kill"]) > 0
        try:
            return int((self.memory / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError):
            return False

    def remove(self, wait: float = 2.0) -> bool:
        """Remove the groups, waiting up to ``wait`` seconds for killed processes to leave
        them; ``False`` if one could not be removed (it is then left for the host)."""
        deadline = time.monotonic() + wait
        removed = True
        for directory in self.dirs:
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        removed = False
                        break
                    self.kill()
                    time.sleep(0.005)
        return removed


_GROUP_NAME = re.compile(r"agentrl_fast-(\d+)-\d+")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_orphans(hierarchy: Hierarchy) -> int:
    """Kill the processes of, and remove, the calls' groups whose trainer is gone (a SIGKILLed
    trainer cannot clean up; what its calls left running would run on); the number removed.
    Groups of live trainers, this one included, are left alone."""
    removed = 0
    parents = dict.fromkeys(d for d in (hierarchy.memory, hierarchy.pids, hierarchy.cpu) if d)
    names = set()
    for parent in parents:
        try:
            names |= {p.name for p in parent.iterdir() if _GROUP_NAME.fullmatch(p.name)}
        except OSError:
            continue
    for name in sorted(names):
        if not _alive(int(_GROUP_NAME.fullmatch(name).group(1))):
            group = CallGroup(hierarchy, name, with_cpu=True)
            group.kill()
            removed += group.remove()
    return removed


def _write(path: Path, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


@functools.lru_cache(maxsize=None)
def cgroup_problem() -> str | None:
    """Why this process cannot give each call its own groups, or ``None`` when it can. Checked
    once per process by making (and removing) a real group."""
    try:
        hierarchy = find_hierarchy()
    except OSError as error:
        return f"cannot read this process's control groups: {error}"
    if hierarchy is None:
        return "no cgroup v1 memory+pids hierarchies and no cgroup v2 mount"
    if hierarchy.version == 2:
        problem = _enable_v2_controllers(hierarchy.memory)
        if problem:
            return problem
    try:
        CallGroup.create(hierarchy, 64 * 1024 * 1024, 8).remove()
    except OSError as error:
        return (f"cannot make a control group under {hierarchy.memory} (cgroup "
                f"v{hierarchy.version}): {error.strerror or error}")
    return None


def _enable_v2_controllers(parent: Path) -> str | None:
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        available = set((parent / "cgroup.controllers").read_text().split())
        if not {"memory", "pids"} <= available:
            return f"cgroup v2 at {parent} lacks the memory or pids controller"
        wanted = {"memory", "pids"} | ({"cpu"} & available)
        if not wanted <= enabled:
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
    except OSError as error:
        return (f"cgroup v2: cannot enable memory and pids below {parent} "
                f"({error.strerror or error}; a group that holds processes itself cannot)")
    return None


@functools.lru_cache(maxsize=None)
def hierarchy() -> Hierarchy | None:
    """The hierarchy calls' groups are made in, when :func:`cgroup_problem` is ``None``
    (``cpu`` ``None`` under v2 when its ``cpu`` controller is not enabled for children)."""
    found = find_hierarchy() if cgroup_problem() is None else None
    if found is not None and found.version == 2:
        enabled = (found.memory / "cgroup.subtree_control").read_text().split()
        found = found if "cpu" in enabled else Hierarchy(2, found.memory, found.pids, None)
    if found is not None:
        sweep_orphans(found)
    return found
