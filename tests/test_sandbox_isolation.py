"""Attacks on the bubblewrap sandbox, each through ``python_tool`` and a real ``ToolRegistry``.

Each test runs the attack under ``isolation="bwrap"`` and asserts that it failed and that
nothing outside changed, then (where it is safe) runs the same attack under
``isolation="none"`` as a control and asserts that it succeeded there, so that the test can
fail. Without a working bubblewrap these tests skip, or fail under ``CI=true``
(``bash tools/setup_test_env.sh`` installs it). This machine runs them as root, as CI does.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest

from agentrl_fast.harness import ToolRegistry, parse_tool_calls
from agentrl_fast.harness.sandbox import execute as sandbox
from agentrl_fast.harness.sandbox import python_tool, run_sandboxed
from agentrl_fast.harness.sandbox.execute import run_sandboxed_sync
from test_sandbox import call_text, require_bwrap, run_tool

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap needs Linux")


@pytest.fixture(autouse=True)
def _bwrap():
    require_bwrap()


def attack(code: str, isolation: str, **options) -> dict:
    """Run ``code`` (which prints one JSON object last) through python_tool; its report."""
    content = run_tool(code, isolation=isolation, **options)
    return json.loads(content.strip().splitlines()[-1])


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        fields = _stat_fields(pid)
        if marker.encode() in command and fields is not None and fields[0] != "Z":
            found.append(int(pid))
    return found


def descendants() -> set[int]:
    """Live processes descended from this one."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(pid)
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(pid))
    found, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def wait_until(predicate, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- 1. the trainer's files are not readable ----------------------------------------------------


READ = """
import json, os
report = {{}}
for path in {paths!r}:
    try:
        report[path] = open(path).read()
    except OSError as error:
        report[path] = type(error).__name__
print(json.dumps(report))
"""


def test_trainer_files_are_not_readable(tmp_path, monkeypatch):
    secret = f"secret-{uuid.uuid4()}"
    workdir, run = tmp_path / "workdir", tmp_path / "run" / "checkpoints"
    workdir.mkdir()
    run.mkdir(parents=True)
    files = [workdir / "notes.txt", run / "step_100.pt", Path.home() / f".agentrl-{uuid.uuid4()}"]
    monkeypatch.chdir(workdir)  # the trainer's working directory
    try:
        for path in files:
            path.write_text(secret)
        paths = [str(path) for path in files] + ["notes.txt"]  # the last: relative to the cwd
        isolated = attack(READ.format(paths=paths), "bwrap")
        assert secret not in json.dumps(isolated)
        assert all(value in ("FileNotFoundError", "PermissionError")
                   for value in isolated.values()), isolated
        control = attack(READ.format(paths=paths), "none")
        assert control == {path: secret for path in paths}
    finally:
        files[2].unlink()


# --- 2. nothing outside the scratch directory can be written or deleted -------------------------


WRITE = """
import json, os, shutil
report = {{}}
def attempt(name, action):
    try:
        action()
        report[name] = "done"
    except OSError as error:
        report[name] = type(error).__name__
for path in {targets!r}:
    attempt("overwrite " + path, lambda: open(path, "w").write("pwned"))
    attempt("delete " + path, lambda: os.remove(path))
for folder in {folders!r}:
    attempt("create in " + folder, lambda: open(os.path.join(folder, "pwned"), "w").write("x"))
for folder in {trees!r}:
    attempt("rmtree " + folder, lambda: shutil.rmtree(folder))
if {scratch!r}:
    attempt("scratch cwd", lambda: open("scratch.txt", "w").write("ok"))
    attempt("scratch /tmp", lambda: open("/tmp/scratch.txt", "w").write("ok"))
print(json.dumps(report))
"""


def snapshot(folder: Path) -> dict:
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_writes_outside_scratch_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    checkpoint = run / "model.pt"
    checkpoint.write_bytes(b"weights")
    before = snapshot(tmp_path)
    prefix = os.path.realpath(sys.base_prefix)
    folders = [str(run), str(tmp_path), "/", "/usr", prefix, str(Path.home()), "/tmp"]
    isolated = attack(WRITE.format(targets=[str(checkpoint), sys.executable], folders=folders,
                                   trees=[str(run), str(tmp_path)], scratch=True), "bwrap")
    scratch = {"scratch cwd", "scratch /tmp", "create in /tmp"}  # the sandbox's own /tmp
    assert {key for key, value in isolated.items() if value == "done"} == scratch, isolated
    assert snapshot(tmp_path) == before
    assert not any(os.path.exists(os.path.join(folder, "pwned")) for folder in folders)
    # Control, on the test's own files only: without isolation the attack works.
    control = attack(WRITE.format(targets=[str(checkpoint)], folders=[str(run)],
                                  trees=[str(run)], scratch=False), "none")
    assert control[f"overwrite {checkpoint}"] == "done" and not run.exists()


# --- 3. no network, not even the host's loopback ------------------------------------------------


CONNECT = """
import json, socket
report = {{}}
try:
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as connection:
        connection.sendall(b"pwned")
    report["connect"] = "done"
except OSError as error:
    report["connect"] = type(error).__name__
try:
    socket.getaddrinfo("example.com", 443)
    report["resolve"] = "done"
except OSError as error:
    report["resolve"] = type(error).__name__
print(json.dumps(report))
"""


def received(server: socket.socket) -> bytes | None:
    """What a client that connected to ``server`` (listening) sent, or None if none did."""
    server.settimeout(0.5)
    try:
        connection, _ = server.accept()
    except (TimeoutError, socket.timeout):
        return None
    with connection:
        connection.settimeout(2)
        return connection.recv(100)


def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        code = CONNECT.format(port=server.getsockname()[1])
        isolated = attack(code, "bwrap")
        assert isolated["connect"] != "done" and isolated["resolve"] != "done", isolated
        assert received(server) is None
        control = attack(code, "none")
        assert control["connect"] == "done" and received(server) == b"pwned"


# --- 4. nothing of a call outlives it, setsid() or not ------------------------------------------


ESCAPE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
    os._exit(0)
print("{{}}")
time.sleep(60)
"""


def test_setsid_child_does_not_outlive_the_call():
    marker = f"agentrl-escape-{uuid.uuid4()}"
    before = descendants()
    assert processes_with(marker) == []
    # (cgroup="off" here and in the control: bubblewrap's PID namespace alone must do it;
    # tests/test_sandbox_cgroup.py checks the control group's kill)
    content = run_tool(ESCAPE.format(marker=marker), isolation="bwrap", timeout=1, cgroup="off")
    assert content.endswith("[killed: timeout after 1 s]")
    # (generous waits: on a loaded machine a killed namespace takes a while to be reaped; only
    # sandbox processes count: the test session's background jobs start processes meanwhile)
    assert wait_until(lambda: processes_with(marker) == [], seconds=30)
    assert wait_until(lambda: not sandboxed(descendants() - before), seconds=30), \
        sandboxed(descendants() - before)
    # Control: without isolation the setsid() child escapes the process-group kill.
    run_tool(ESCAPE.format(marker=marker), isolation="none", timeout=1, cgroup="off")
    survivors = processes_with(marker)
    for pid in survivors:
        os.kill(pid, 9)
    assert len(survivors) == 1


def host_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Uid:")).split()[1])


def test_cancelled_call_kills_the_namespace():
    """Also: as root, the program runs as a fresh unprivileged uid (what RLIMIT_NPROC needs)."""
    marker = f"agentrl-cancel-{uuid.uuid4()}"

    async def main():
        task = asyncio.ensure_future(run_sandboxed(
            [sandbox.base_python(), "-I", "-S", "-"], stdin=ESCAPE.format(marker=marker),
            timeout=30, isolation="bwrap"))
        assert await asyncio.to_thread(wait_until, lambda: processes_with(marker), 10)
        [pid] = processes_with(marker)
        assert host_uid(pid) >= 1_000_000 or os.geteuid() != 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_until(lambda: processes_with(marker) == [])


# --- 5. fork bomb and memory bomb, as root ------------------------------------------------------


class StallMonitor:
    """A 10 ms sleep loop in this process; ``worst`` is its longest gap in seconds."""

    def __init__(self):
        self.worst, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last = time.monotonic()
        while not self._stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            self.worst, last = max(self.worst, now - last), now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

FORK_COUNT = """
import json, os, time
forks = 0
for _ in range({count}):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        forks += 1
    except OSError:
        break
print(json.dumps({{"forks": forks}}))
"""

MEMORY_BOMB = "x = []\nwhile True:\n    x.append(bytearray(10**7))"


@pytest.mark.parametrize("code", [FORK_BOMB, MEMORY_BOMB], ids=["fork", "memory"])
def test_bombs_are_bounded_as_root(code):
    before = descendants()
    timeout = 3
    with StallMonitor() as monitor:
        start = time.monotonic()
        content = run_tool(code, isolation="bwrap", timeout=timeout, memory_mb=256)
        elapsed = time.monotonic() - start
    assert elapsed <= timeout + 2, content
    assert monitor.worst < 1.0
    assert "[killed: " in content or "memory limit 256 MB" in content, content
    assert wait_until(lambda: descendants() <= before)


def test_process_count_is_limited():
    """Root ignores RLIMIT_NPROC; the sandbox's fresh uid does not. Control: without isolation
    (as root) nothing stops 200 forks. (Both without the call's control group, whose pids.max
    bounds it too: tests/test_sandbox_cgroup.py.)"""
    isolated = attack(FORK_COUNT.format(count=200), "bwrap", max_processes=16, cgroup="off")
    assert isolated["forks"] < 16
    if os.geteuid() == 0:
        assert attack(FORK_COUNT.format(count=200), "none", cgroup="off")["forks"] == 200


# --- 6. the trainer's environment and other processes are invisible ---------------------------


SNOOP = """
import json, os
secret = {secret!r}
report = {{"environ": secret in repr(dict(os.environ))}}
for pid in {pids!r}:
    for name in ("environ", "cmdline"):
        try:
            report[f"{{pid}}/{{name}}"] = secret in open(f"/proc/{{pid}}/{{name}}", errors="replace").read()
        except OSError as error:
            report[f"{{pid}}/{{name}}"] = type(error).__name__
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("environ", "cmdline"):
        try:
            if secret in open(f"/proc/{{pid}}/{{name}}", errors="replace").read():
                found.append(pid)
        except OSError:
            pass
report["scan"] = found
print(json.dumps(report))
"""


def test_trainer_environment_and_processes_are_invisible(monkeypatch):
    secret = f"sk-{uuid.uuid4()}"
    monkeypatch.setenv("AGENTRL_SECRET", secret)
    # A stand-in for another process of the trainer's: the secret in its environment and
    # command line (/proc/<pid>/environ holds a process's initial environment).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", f"--api-key={secret}"],
        env={**os.environ, "AGENTRL_SECRET": secret})
    try:
        code = SNOOP.format(secret=secret, pids=[os.getpid(), holder.pid])
        isolated = attack(code, "bwrap")
        assert not any(value is True for value in isolated.values()), isolated
        assert isolated["scan"] == []
        control = attack(code, "none")
        assert control[f"{holder.pid}/environ"] is True and control[f"{holder.pid}/cmdline"]
        assert str(holder.pid) in control["scan"]
    finally:
        holder.kill()
        holder.wait()


# --- 7. many concurrent calls leak nothing -----------------------------------------------------


def test_200_calls_from_8_workers_leak_nothing():
    marker = f"agentrl-leak-{uuid.uuid4()}"
    code = ("import os, sys\n"
            "if os.fork() == 0:\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
            f"{marker!r}])\n"
            "print({n} * {n})")
    registry = ToolRegistry([python_tool(timeout=20, isolation="bwrap")])
    temp_dirs = [Path(tempfile.gettempdir()), Path("/dev/shm")]
    temp_before = {d: set(d.iterdir()) for d in temp_dirs}
    mounts_before = Path("/proc/self/mountinfo").read_text()
    before = descendants()

    async def worker(first: int) -> list:
        results = []
        for n in range(first, 200, 8):
            call = parse_tool_calls(call_text(("run_python", {"code": code.format(n=n)})))
            results.append((n, *await registry.execute(call)))
        return results

    async def main():
        return [r for rs in await asyncio.gather(*(worker(i) for i in range(8))) for r in rs]

    results = asyncio.run(main())
    assert sorted(n for n, _ in results) == list(range(200))
    assert all(result.ok and result.content == str(n * n) for n, result in results)
    # (generous waits: on a loaded machine a killed namespace takes a while to be reaped; only
    # sandbox processes count: the test session's background jobs start processes meanwhile)
    assert wait_until(lambda: processes_with(marker) == [], seconds=30)
    assert wait_until(lambda: not sandboxed(descendants() - before), seconds=30), \
        sandboxed(descendants() - before)
    assert Path("/proc/self/mountinfo").read_text() == mounts_before
    for folder in temp_dirs:  # other processes may add files meanwhile; no sandbox uid may
        assert all(owner(path) < 1_000_000 for path in set(folder.iterdir())
                   - temp_before[folder])


def sandboxed(pids: set[int]) -> set[int]:
    """Those of ``pids`` that are a sandbox's: bwrap itself, or a process under a sandbox uid."""
    found = set()
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if command.endswith(b"bwrap") or host_uid(pid) >= 1_000_000:
                found.add(pid)
        except OSError:  # gone meanwhile
            pass
    return found


def owner(path: Path) -> int:
    try:
        return path.lstat().st_uid
    except FileNotFoundError:
        return 0


# --- failures to isolate are reported, never crash ----------------------------------------------


def test_sandbox_that_cannot_start_is_an_error_result():
    with pytest.raises(RuntimeError, match="sandbox did not start: bwrap: .*no-such-path"):
        run_sandboxed_sync(["true"], isolation="bwrap", read_only_paths=["/no-such-path"])

    async def broken(code: str) -> str:
        """A code tool whose sandbox cannot start.

        Args:
            code: The Python source to run.
        """
        result = await run_sandboxed(["true"], stdin=code, isolation="bwrap",
                                     read_only_paths=["/no-such-path"])
        return result.stdout

    registry = ToolRegistry([broken])
    [result] = registry.execute_sync(parse_tool_calls(call_text(("broken", {"code": "1"}))))
    assert result.error == "tool_exception" and "sandbox did not start" in result.content


def test_without_bubblewrap_auto_warns_once_and_bwrap_fails(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to find
    monkeypatch.setattr(sandbox, "_warned_unisolated", False)
    sandbox.bwrap_problem.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="isolation='bwrap'.*bwrap.*not on PATH"):
            python_tool(isolation="bwrap")
        with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
            run_sandboxed_sync(["/bin/true"], isolation="bwrap")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [run_sandboxed_sync(["/bin/true"]) for _ in range(2)]
        assert [r.isolation for r in results] == ["none", "none"] and all(r.ok for r in results)
        assert len(caught) == 1 and "WITHOUT isolation" in str(caught[0].message)
        assert "bwrap" in str(caught[0].message)
    finally:
        monkeypatch.undo()
        sandbox.bwrap_problem.cache_clear()
    assert sandbox.bwrap_problem() is None
