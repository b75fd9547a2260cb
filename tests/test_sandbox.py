"""The code sandbox: a runaway code tool is killed at its limit, and the episode continues.

Every program here runs in a child process with small limits (1-2 s, 128 MB), so the file
takes a few seconds. Cleanup of forked children is checked by pid (a zombie waiting for init to
reap it counts as gone). Tests taking the ``isolation`` fixture run both without isolation and
under bubblewrap; the attacks on the isolation itself are in tests/test_sandbox_isolation.py.
Without a working bubblewrap the bubblewrap cases skip, or fail under ``CI=true``
(tools/setup_test_env.sh installs it), as tests/side_envs.py's rule.
"""

import asyncio
import json
import os
import signal
import sys
import textwrap
import time

import pytest

import agentrl_fast
from agentrl_fast.harness import ToolRegistry, parse_tool_calls
from agentrl_fast.harness.sandbox import SandboxResult, cgroups, python_tool, run_sandboxed
from agentrl_fast.harness.sandbox.bwrap import base_python
from agentrl_fast.harness.sandbox.execute import bwrap_problem, run_sandboxed_sync
from agentrl_fast.harness.sandbox.launcher import FILE_SIZE_LIMIT_MB, LAUNCHER
from side_envs import SETUP

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux rlimits")

PY = [base_python(), "-I", "-u", "-"]  # a Python program read from stdin


def require_bwrap() -> None:
    """Skip the test when bubblewrap cannot isolate runs here; fail it under ``CI=true``."""
    problem = bwrap_problem()
    if problem is None:
        return
    message = f"bubblewrap cannot isolate runs here ({problem}): run `bash {SETUP}`"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(params=["none", "bwrap"])
def isolation(request) -> str:
    if request.param == "bwrap":
        require_bwrap()
    return request.param


def run_python(code: str, **limits) -> SandboxResult:
    return run_sandboxed_sync(PY, stdin=textwrap.dedent(code), **limits)


def call_text(*calls: tuple[str, dict]) -> str:
    return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                   for n, a in calls)


def run_tool(code: str, **options) -> str:
    registry = ToolRegistry([python_tool(**options)])
    [result] = registry.execute_sync(parse_tool_calls(call_text(("run_python", {"code": code}))))
    assert result.error is None, result
    return result.content


def process_gone(pid: int, grace: float = 3.0) -> bool:
    """``pid`` no longer exists (or is a zombie) within ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# --- running programs --------------------------------------------------------------------------


def test_output_and_exit_code(isolation):
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_sandboxed_sync([base_python(), "-c", code], timeout=5, isolation=isolation)
    assert result == SandboxResult(exit_code=3, signal=None, stdout="out\n", stderr="err\n",
                                   isolation=isolation, syscall_filter=True,
                                   cgroup=cgroups.cgroup_problem() is None)
    assert not result.ok
    assert run_sandboxed_sync(["true"], isolation=isolation).ok


def test_exit_codes_and_signals(isolation):
    """bwrap reports a signal N as exit code 128 + N, decoded back into a signal; an exit status
    above 128 + 64 stays an exit status."""
    result = run_sandboxed_sync([base_python(), "-c", "raise SystemExit(200)"],
                                isolation=isolation)
    assert (result.exit_code, result.signal) == (200, None)
    killed = run_sandboxed_sync([base_python(), "-c", "import os; os.kill(os.getpid(), 15)"],
                                isolation=isolation)
    assert (killed.exit_code, killed.signal) == (None, signal.SIGTERM)


def test_stdin_is_passed(isolation):
    result = run_sandboxed_sync([base_python(), "-c", "import sys; print(sys.stdin.read()[::-1])"],
                                stdin="héllo", isolation=isolation)
    assert result.stdout == "olléh\n" and result.ok
    # A program that never reads a large stdin does not hang the writer.
    assert run_sandboxed_sync(["true"], stdin=b"x" * 1_000_000, timeout=5,
                              isolation=isolation).ok


def test_limits_are_set_in_the_child(isolation):
    code = """
        import resource
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"):
            print(*resource.getrlimit(getattr(resource, name)))
    """
    result = run_python(code, timeout=2.5, memory_mb=200, isolation=isolation)
    mb = 1024 * 1024
    assert result.stdout.split("\n")[:4] == [f"{200 * mb} {200 * mb}", "3 4",
                                             f"{FILE_SIZE_LIMIT_MB * mb} {FILE_SIZE_LIMIT_MB * mb}",
                                             "0 0"]
    assert run_python(code, timeout=9, cpu_seconds=1.5,
                      isolation=isolation).stdout.split("\n")[1] == "2 3"


def test_launcher_imports_nothing_of_ours(isolation):
    assert "agentrl_fast" not in LAUNCHER and "torch" not in LAUNCHER
    result = run_python("import sys; print(sorted(m for m in sys.modules "
                        "if m.split('.')[0] in ('torch', 'agentrl_fast')))", isolation=isolation)
    assert result.stdout == "[]\n"


def test_missing_program_raises(isolation):
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        run_sandboxed_sync(["no-such-program-agentrl"], isolation=isolation)


# --- runaway programs are killed at their limits ------------------------------------------------


def test_infinite_loop_is_killed_at_the_timeout(isolation):
    start = time.monotonic()
    result = run_python("while True: pass", timeout=1.5, isolation=isolation)
    assert time.monotonic() - start < 1.5 + 2.0
    assert result.killed_reason in ("timeout", "cpu_limit") and result.exit_code is None
    assert result.signal in (signal.SIGKILL, signal.SIGXCPU)
    if result.killed_reason == "timeout":
        assert result.timed_out and result.signal == signal.SIGKILL


def test_infinite_loop_is_killed_at_the_cpu_limit(isolation):
    start = time.monotonic()
    result = run_python("while True: pass", timeout=20, cpu_seconds=1, isolation=isolation)
    assert time.monotonic() - start < 10
    assert not result.timed_out and result.killed_reason == "cpu_limit"
    assert result.signal == signal.SIGXCPU


@pytest.mark.parametrize("code", ["x = bytearray(2_000_000_000)",
                                  "x = []\nwhile True: x.append(bytearray(10**6))"])
def test_memory_hog_fails_at_the_memory_limit(code, isolation):
    result = run_python(code, timeout=5, memory_mb=128, isolation=isolation)
    assert not result.ok and result.killed_reason == "memory_limit"
    assert "MemoryError" in result.stderr or result.signal is not None


def test_infinite_output_is_truncated_and_stopped(isolation):
    start = time.monotonic()
    result = run_python("while True: print('x' * 100)", timeout=1, max_output_bytes=1000,
                        isolation=isolation)
    assert time.monotonic() - start < 1 + 2.0
    assert result.truncated and len(result.stdout) == 1000 and set(result.stdout) <= {"x", "\n"}
    assert result.killed_reason in ("timeout", "cpu_limit")


@pytest.mark.parametrize("parent", ["time.sleep(1000)", "pass"], ids=["waits", "exits"])
def test_forked_grandchild_is_killed(parent):
    code = f"""
        import os, time
        pid = os.fork()
        if pid == 0:
            time.sleep(1000)
            os._exit(0)
        print(pid)
        {parent}
    """
    result = run_python(code, timeout=1, isolation="none")  # a host pid to check
    grandchild = int(result.stdout)
    assert grandchild != os.getpid()
    assert result.timed_out == (parent != "pass")
    assert process_gone(grandchild)


def test_cancelled_run_kills_the_group(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"""
        import os, time
        if os.fork() == 0:
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(1000)
    """

    async def main():
        task = asyncio.ensure_future(run_sandboxed(PY, stdin=textwrap.dedent(code), timeout=30,
                                                   isolation="none"))
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 10
    assert process_gone(int(pid_file.read_text()))


# --- isolation from the trainer -----------------------------------------------------------------


def test_trainer_environment_does_not_leak(monkeypatch, isolation):
    monkeypatch.setenv("AGENTRL_SECRET", "hunter2")
    result = run_python("import os; print(sorted(os.environ)); "
                        "print(os.environ.get('AGENTRL_SECRET'))", isolation=isolation)
    assert "AGENTRL_SECRET" not in result.stdout and "hunter2" not in result.stdout
    assert result.stdout.endswith("None\n")
    explicit = run_python("import os; print(os.environ['A'])", env={"A": "1"},
                          isolation=isolation)
    assert explicit.stdout == "1\n"


def test_code_runs_only_in_the_child(tmp_path):
    marker = tmp_path / "marker"
    code = (f"import os, sys\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
            "sys.modules.get('agentrl_fast') and setattr(sys.modules['agentrl_fast'], 'PWNED', 1)\n"
            "print(os.getpid())")
    content = run_tool(code, isolation="none")  # writes a host file; bubblewrap would refuse it
    child = int(content)
    assert child != os.getpid() and int(marker.read_text()) == child
    assert not hasattr(agentrl_fast, "PWNED")


# --- the tool, through a real ToolRegistry ------------------------------------------------------


def test_python_tool_schema_and_timeout():
    t = python_tool(timeout=2)
    assert t.name == "run_python" and t.is_async and t.timeout == 7
    assert t.schema["function"]["description"].startswith("Run a Python program in a sandbox")
    assert t.parameters["properties"]["code"]["type"] == "string"
    assert t.parameters["required"] == ["code"]
    assert python_tool(name="python").name == "python"
    with pytest.raises(ValueError, match="memory_mb"):
        python_tool(memory_mb=1)
    with pytest.raises(TypeError, match="timeout"):
        python_tool(timeout="2")
    with pytest.raises(ValueError, match="isolation"):
        python_tool(isolation="docker")
    with pytest.raises(TypeError, match="site_packages"):
        python_tool(site_packages="yes")


def test_python_tool_imports_installed_packages_only_when_configured(isolation):
    code = "import jsonschema; print('imported')"
    assert "ModuleNotFoundError" in run_tool(code, isolation=isolation)
    assert run_tool(code, isolation=isolation, site_packages=True) == "imported"


def test_python_tool_result_text():
    assert run_tool("print('hi')") == "hi"
    assert run_tool("pass") == "[no output]"
    failed = run_tool("print('before')\ndef f(:\n")
    assert "SyntaxError" in failed and failed.endswith("[exit code 1]")
    raised = run_tool("print('out')\nraise ValueError('boom')")
    assert raised.startswith("out\nTraceback") and "ValueError: boom\n[exit code 1]" in raised
    assert run_tool("while True: pass", timeout=1) in ("[killed: timeout after 1 s]",
                                                        "[killed: CPU time limit 1 s]")
    memory = run_tool("x = bytearray(2_000_000_000)", memory_mb=128)
    assert "MemoryError" in memory and memory.endswith("[exit code 1: memory limit 128 MB]")
    flood = run_tool("while True: print('y' * 99)", timeout=1, max_output_bytes=500)
    assert flood.startswith("y" * 99 + "\n") and flood.endswith("\n[output truncated]")
    assert len(flood) < 600


def test_concurrent_runs_take_the_max_not_the_sum():
    registry = ToolRegistry([python_tool(timeout=5)])
    calls = parse_tool_calls(call_text(*[("run_python", {"code": f"import time\n"
                                                                  f"time.sleep(1)\nprint({i})"})
                                         for i in range(3)]))
    start = time.monotonic()
    results = registry.execute_sync(calls)
    assert time.monotonic() - start < 2.5
    assert [r.content for r in results] == ["0", "1", "2"]
    assert all(r.ok for r in results)


def test_runaway_tool_is_killed_and_the_episode_continues():
    """A program killed at its limit is a normal result (``error is None``): the model reads
    the ``[killed: ...]`` line. The other calls of the turn complete."""
    registry = ToolRegistry([python_tool(timeout=1, memory_mb=128)])
    calls = parse_tool_calls(call_text(("run_python", {"code": "while True: pass"}),
                                       ("run_python", {"code": "x = ' ' * 10**10"}),
                                       ("run_python", {"code": 42}),
                                       ("run_python", {"code": "print('still here')"})))
    start = time.monotonic()
    runaway, hog, bad, fine = registry.execute_sync(calls)
    assert time.monotonic() - start < 1 + 2.5
    assert runaway.error is None and runaway.content.startswith("[killed: ")
    assert hog.error is None and "memory limit 128 MB" in hog.content
    assert bad.error == "wrong_type"
    assert fine.ok and fine.content == "still here"
    assert registry.metrics["ok"] == 3 and registry.metrics["wrong_type"] == 1


# --- bad arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"argv": "python"}, TypeError, "argv"),
    ({"argv": []}, ValueError, "argv"),
    ({"argv": [sys.executable, 1]}, TypeError, r"argv\[1\]"),
    ({"argv": [""]}, ValueError, r"argv\[0\]"),
    ({"argv": ["a\0b"]}, ValueError, r"argv\[0\]"),
    ({"stdin": 3}, TypeError, "stdin"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"timeout": -1.0}, ValueError, "timeout"),
    ({"timeout": float("inf")}, ValueError, "timeout"),
    ({"timeout": "1"}, TypeError, "timeout"),
    ({"memory_mb": 16}, ValueError, "memory_mb"),
    ({"memory_mb": 256.0}, TypeError, "memory_mb"),
    ({"memory_mb": True}, TypeError, "memory_mb"),
    ({"cpu_seconds": 0}, ValueError, "cpu_seconds"),
    ({"max_output_bytes": -1}, ValueError, "max_output_bytes"),
    ({"cwd": "/no/such/dir"}, ValueError, "cwd"),
    ({"cwd": 3}, TypeError, "cwd"),
    ({"env": ["PATH"]}, TypeError, "env"),
    ({"env": {"A": 1}}, TypeError, "env"),
    ({"isolation": "docker"}, ValueError, "isolation"),
    ({"max_processes": 0}, ValueError, "max_processes"),
    ({"read_only_paths": "/usr"}, TypeError, "read_only_paths"),
])
def test_bad_arguments(kwargs, error, fragment):
    kwargs = {"argv": ["true"], **kwargs}
    with pytest.raises(error, match=fragment):
        run_sandboxed_sync(kwargs.pop("argv"), **kwargs)
