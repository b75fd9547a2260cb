"""Child processes started when the session starts, for tests whose whole work is one child
process (compiling every Triton kernel, the interpreter suites, nvcc).

Such a test module defines ``background_command(params: dict) -> Command | None`` (``params``:
the test's parametrization). The conftest starts one child per selected test at the lowest CPU
priority (``nice 19``; ``Command.nice`` may ask for more), so it runs on whatever CPU the other
tests leave idle, and moves those tests to the end of the run; the test then takes its child's
result with the fixture ``background_result()``. Every assertion stays in the test; only the
start moves earlier.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest


@dataclass
class Command:
    """``argv`` run in ``cwd`` with ``env`` (None: this process's); ``timeout``: the seconds a
    test waits for it once the test starts waiting."""

    argv: list[str]
    cwd: str
    env: dict | None = None
    timeout: float = 600.0
    # 19: only idle CPU. A long single-threaded child gets less (e.g. 5), so it is not the
    # last thing running, on one core, after the other tests end.
    nice: int = 19


@dataclass
class Background:
    """A started ``command``: its process and the files its output goes to."""

    command: Command
    process: subprocess.Popen
    stdout: object
    stderr: object
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, command: Command) -> "Background":
        stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        # A process group of its own (to kill it whole) but not a session: a new session is a
        # new scheduler autogroup, which would share the CPU equally with this one whatever
        # its nice value.
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        process = subprocess.Popen(["nice", "-n", str(command.nice), *command.argv],
                                   cwd=command.cwd, env=command.env, stdout=stdout,
                                   stderr=stderr, **group)
        return cls(command, process, stdout, stderr)

    def result(self) -> subprocess.CompletedProcess:
        """Waits for the child (failing the test after ``command.timeout`` seconds of waiting)."""
        try:
            self.process.wait(timeout=self.command.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"background command did not finish within {self.command.timeout} s of "
                        f"waiting ({time.monotonic() - self.started:.0f} s since it started): "
                        f"{self.command.argv}\nstdout:\n{self._read(self.stdout)[-3000:]}\n"
                        f"stderr:\n{self._read(self.stderr)[-3000:]}")
        return subprocess.CompletedProcess(self.command.argv, self.process.returncode,
                                           self._read(self.stdout), self._read(self.stderr))

    def kill(self):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    @staticmethod
    def _read(file) -> str:
        file.seek(0)
        return file.read().decode(errors="replace")


STARTED: dict[str, Background] = {}  # nodeid -> its child


def start_for(items) -> list:
    """Starts the children of the ``items`` that have one; returns ``items`` reordered with
    those last (in their original order)."""
    front, back = [], []
    for item in items:
        make = getattr(getattr(item, "module", None), "background_command", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        command = make(params) if make is not None else None
        if command is None:
            front.append(item)
            continue
        STARTED[item.nodeid] = Background.start(command)
        back.append(item)
    return front + back


def stop_all():
    for background in STARTED.values():
        background.kill()
    STARTED.clear()
