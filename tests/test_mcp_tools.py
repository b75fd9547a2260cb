"""MCP tool servers as a rollout's tools (agentrl_fast.harness.mcp), against real servers over
real transports: ``mcp-server-git`` (PyPI) on temporary repositories, the npm reference
``@modelcontextprotocol/server-memory`` (installed by tools/setup_test_env.sh into a cache
folder, run by node; missing: fails under ``CI=true``, skips elsewhere), and the toy server of
tests/mcp_servers/toy.py for the failure modes (stdio, and streamable HTTP on 127.0.0.1).
Calls go through a real ``ToolRegistry``. Leaks are checked by process: after a release, a
crash, a close, and a SIGKILL of the process that owned the servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agentrl_fast.harness import ToolCall, ToolRegistry, tool
from agentrl_fast.harness.mcp import MCPServerError, MCPServers, MCPServerSpec
from side_envs import SETUP
from test_sandbox import require_bwrap
from test_sandbox_isolation import processes_with

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups, /proc")

ROOT = Path(__file__).resolve().parent.parent
TOY = str(Path(__file__).resolve().parent / "mcp_servers" / "toy.py")
NPM_PREFIX = Path(os.environ.get("AGENTRL_FAST_NPM",  # as tools/setup_test_env.sh
                                  Path.home() / ".cache" / "agentrl_fast" / "npm"))
MEMORY_SERVER = NPM_PREFIX / "node_modules" / "@modelcontextprotocol" / "server-memory" / \
    "dist" / "index.js"


def toy(name: str = "toy", *options: str, **fields) -> dict:
    """A spec mapping for the toy server (``options``: its command-line options)."""
    return {"name": name, "command": sys.executable, "args": [TOY, *options], **fields}


def run(registry: ToolRegistry, name: str, **arguments):
    return registry.execute_sync([ToolCall(name, arguments)])[0]


def gone(pids, deadline: float = 10.0) -> bool:
    """Whether every pid is gone (or a zombie) within ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if not [p for p in pids if _alive(p)]:
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def no_process_with(marker: str, deadline: float = 10.0) -> bool:
    end = time.monotonic() + deadline
    while processes_with(marker):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def memory_server() -> str:
    """The server-memory entry point, or skip (fail under ``CI=true``) naming the install."""
    if MEMORY_SERVER.is_file():
        return str(MEMORY_SERVER)
    problem = (f"@modelcontextprotocol/server-memory is not installed in {NPM_PREFIX}: run "
               f"`bash {SETUP}` (npm install --prefix {NPM_PREFIX} ...)")
    if os.environ.get("CI") == "true":
        pytest.fail(problem)
    pytest.skip(problem)


@pytest.fixture(scope="module")
def pool():
    """A rollout-scoped toy and a shared one (prefixed, three tools), started once."""
    servers = MCPServers([toy("toy", scope="rollout", timeout=2.0),
                          toy("shared", prefix="s_", include=["echo", "where", "add"])])
    servers.start()
    yield servers
    servers.close()


# ---------------------------------------------------------------------------------------------
# Specs.

@pytest.mark.parametrize("mapping, message", [
    ({"command": "x"}, r"mcp_servers\[0\]\.name: missing"),
    ({"name": "a b", "command": "x"}, r"name must be letters"),
    ({"name": "a"}, r"give either command .* or url"),
    ({"name": "a", "command": "x", "url": "http://h"}, r"give either command"),
    ({"name": "a", "command": "x", "scope": "task"}, r"scope must be one of shared, rollout"),
    ({"name": "a", "command": "x", "timeout": 0}, r"timeout must be > 0 seconds, got 0"),
    ({"name": "a", "command": "x", "args": "--flag"}, r"args must be a list of strings"),
    ({"name": "a", "command": "x", "env": {"K": 1}}, r"env must map names to strings"),
    ({"name": "a", "command": "x", "args": ["{rollout_dir}"]},
     r"args\[0\] uses \{rollout_dir\}, which needs scope: rollout"),
    ({"name": "a", "command": "x", "rollout_dir_template": "."},
     r"rollout_dir_template needs scope: rollout"),
    ({"name": "a", "command": "x", "scope": "rollout", "rollout_dir_template": "no/such/dir"},
     r"mcp_servers\[0\]\.rollout_dir_template: no folder 'no/such/dir'"),
    ({"name": "a", "url": "ftp://h"}, r"url must be an http:// or https:// URL"),
    ({"name": "a", "url": "http://h", "sandbox": True}, r"sandbox applies to a stdio server"),
    ({"name": "a", "command": "x", "sandbox": True, "cwd": "/tmp"}, r"cwd: a sandboxed server"),
    ({"name": "a", "command": "x", "colour": "red"}, r"mcp_servers\[0\]\.colour: not an MCP"),
])
def test_a_bad_spec_is_an_error_naming_the_field(mapping, message):
    with pytest.raises(ValueError, match=message):
        MCPServers([mapping])


def test_two_servers_of_one_name_and_the_missing_sdk(monkeypatch):
    with pytest.raises(ValueError, match=r"mcp_servers\[1\]\.name: two servers are named 'a'"):
        MCPServers([{"name": "a", "command": "x"}, MCPServerSpec("a", url="http://h")])
    monkeypatch.setitem(sys.modules, "mcp", None)  # the extra is not installed
    with pytest.raises(ImportError, match=r"pip install agentrl_fast\[mcp\]"):
        MCPServers([{"name": "a", "command": "x"}]).start()


# ---------------------------------------------------------------------------------------------
# The toy server: what the model reads.

def test_listed_tools_are_tools_with_the_servers_schemas(pool):
    registry = ToolRegistry(pool.tools("schemas"))
    assert registry.names == ["echo", "add", "fail", "boom", "slow", "crash", "crash_once",
                              "write", "where", "connect", "s_echo", "s_add", "s_where"]
    add = registry["add"].schema["function"]
    assert add["parameters"]["required"] == ["a", "b"] and add["description"] == \
        "Add two integers."
    assert pool.tool_names["s_add"] == "shared" and pool.tool_names["add"] == "toy"
    assert pool.rollout_dir("schemas", "toy") is None  # listing tools starts nothing


def test_calls_results_and_errors_the_model_reads(pool):
    registry = ToolRegistry(pool.tools("calls"))
    assert run(registry, "echo", text="hi").content == "hi"
    assert run(registry, "s_add", a=2, b=3.0).content == "5"  # shared; 3.0 passed as 3
    missing = run(registry, "add", a=1)
    assert (missing.error, missing.content) == (
        "missing_argument", "Error: invalid arguments for 'add': arguments: 'b' is a required "
                            "property.")
    wrong = run(registry, "add", a=1, b="two")
    assert wrong.error == "wrong_type"
    failed = run(registry, "fail")  # isError: the server's own text
    assert failed.error == "tool_exception"
    assert failed.content == "Error: tool 'fail' raised MCPToolError: the toy failed on purpose"
    boom = run(registry, "boom")  # the handler raised: a JSON-RPC error
    assert boom.error == "tool_exception" and "the handler blew up" in boom.content
    assert run(registry, "echo", text="still up").content == "still up"
    pool.release("calls").result(timeout=30)


def test_a_slow_call_times_out_and_the_server_stays_up(pool):
    registry = ToolRegistry(pool.tools("slow"))
    assert run(registry, "echo", text="warm").ok  # started (the start counts in the timeout)
    start = time.monotonic()
    slow = run(registry, "slow", seconds=30)
    assert (slow.error, slow.content) == ("timeout", "Error: tool 'slow' timed out after 2 s.")
    assert time.monotonic() - start < 5
    assert run(registry, "echo", text="after").content == "after"
    pool.release("slow").result(timeout=30)


def test_rollout_servers_have_their_own_folder_and_process_and_stop_at_release(pool):
    first, second = ToolRegistry(pool.tools("r1")), ToolRegistry(pool.tools("r2"))
    folder1, pid1 = run(first, "where").content.split()
    folder2, pid2 = run(second, "where").content.split()
    assert folder1 != folder2 and pid1 != pid2
    assert Path(folder1) == pool.rollout_dir("r1", "toy")
    shared1, shared2 = run(first, "s_where").content, run(second, "s_where").content
    assert shared1 == shared2  # one shared server
    assert run(first, "write", path="note.txt", text="one").ok
    assert (Path(folder1) / "note.txt").read_text() == "one"
    assert not (Path(folder2) / "note.txt").exists()
    pool.release("r1").result(timeout=30)
    assert gone([int(pid1)]) and not Path(folder1).exists()
    assert _alive(int(pid2)) and _alive(int(shared1.split()[1]))
    pool.release("r2").result(timeout=30)
    assert gone([int(pid2)])


def test_a_server_that_dies_is_restarted_once_then_calls_fail_clearly(pool):
    registry = ToolRegistry(pool.tools("crashy"))
    pid = int(run(registry, "where").content.split()[1])
    died = run(registry, "crash")
    assert died.error == "tool_exception"
    assert "MCP server 'toy'" in died.content and "died during the call" in died.content
    assert "toy: crashing on purpose" in died.content  # its stderr's tail
    assert died.content.endswith("it is restarted for the next call")
    assert gone([pid])
    restarted = int(run(registry, "where").content.split()[1])
    assert restarted != pid
    again = run(registry, "crash")
    assert again.content.endswith("it stays down: it died again after its restart")
    down = run(registry, "echo", text="anyone?")
    assert down.error == "tool_exception" and "MCP server 'toy' is down" in down.content
    assert gone([restarted])
    assert run(ToolRegistry(pool.tools("fresh")), "echo", text="ok").content == "ok"
    pool.release("crashy").result(timeout=30)
    pool.release("fresh").result(timeout=30)


def test_a_crash_mid_call_with_calls_in_flight_keeps_the_turn_going(pool):
    """``crash_once`` dies the first time (its folder remembers): the turn's other calls fail
    or answer, none hangs; the restarted server answers the same call."""
    registry = ToolRegistry(pool.tools("flight"))
    results = registry.execute_sync([ToolCall("slow", {"seconds": 0.5}),
                                     ToolCall("crash_once", {})])
    assert all(r.error == "tool_exception" for r in results), results
    assert run(registry, "crash_once").content == "survived"
    pool.release("flight").result(timeout=30)


# ---------------------------------------------------------------------------------------------
# Errors at the start.

def test_a_server_that_fails_to_start_names_its_command_and_stderr():
    servers = MCPServers([toy("late", "--mode", "fail-start")])
    with pytest.raises(MCPServerError) as caught:
        servers.start()
    message = str(caught.value)
    assert message.startswith(f"MCP server 'late' ({sys.executable} {TOY} --mode fail-start) "
                              "failed to start")
    assert "toy: refusing to start (--mode fail-start)" in message
    missing = MCPServers([{"name": "nothing", "command": "no-such-command-xyz"}])
    with pytest.raises(MCPServerError, match=r"(?s)MCP server 'nothing' \(no-such-command-xyz\) "
                                             r"failed to start.*cannot run 'no-such-command"):
        missing.start()


def test_a_bad_input_schema_names_the_server_and_the_tool():
    servers = MCPServers([toy("odd", "--mode", "bad-schema", scope="rollout")])
    with pytest.raises(MCPServerError, match=r"MCP server 'odd': tool 'broken' has an unusable "
                                             r"inputSchema: 'no-such-type' is not valid"):
        servers.start()


def test_a_name_clash_names_both_owners():
    with pytest.raises(ValueError, match=r"tool name 'echo' is offered by both MCP server 'one' "
                                         r"and MCP server 'two'"):
        MCPServers([toy("one", include=["echo"]), toy("two", include=["echo"])]).start()

    @tool
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: The text.
        """
        return text

    from agentrl_fast.config.errors import ConfigError
    from agentrl_fast.envs import DatasetToolEnvironment
    folder = Path(__file__).resolve().parent
    with pytest.raises(ConfigError, match=r"env.args.mcp_servers: tool name 'echo' is offered "
                                          r"by both the Python tool 'echo' \(env.args.tools\) "
                                          r"and MCP server 'one'"):
        DatasetToolEnvironment(train=str(ROOT / "examples" / "calculator" / "train.jsonl"),
                               reward=lambda answer, task: 0.0, tools=[echo],
                               mcp_servers=[toy("one", include=["echo"])], search=[folder])
    with pytest.raises(ValueError, match=r"include names 'nope'"):
        MCPServers([toy("one", include=["nope"])]).start()


# ---------------------------------------------------------------------------------------------
# Real servers no one here wrote, other transports, the sandbox.

@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A git repository with one commit: the rollouts' template."""
    repo = tmp_path_factory.mktemp("template") / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README.md").write_text("hello\n")
    subprocess.run(git + ["-C", str(repo), "add", "README.md"], check=True)
    subprocess.run(git + ["-C", str(repo), "commit", "-q", "-m", "the first commit"], check=True)
    return repo


def test_mcp_server_git_on_a_repository_per_rollout(template):
    spec = {"name": "git", "command": "mcp-server-git", "args": ["--repository", "{rollout_dir}"],
            "scope": "rollout", "rollout_dir_template": str(template),
            "include": ["git_status", "git_log", "git_add", "git_commit"]}
    before = _children()
    with MCPServers([spec]) as servers:
        first, second = ToolRegistry(servers.tools(1)), ToolRegistry(servers.tools(2))
        assert "the first commit" in run(first, "git_log", repo_path=".").content
        folder = servers.rollout_dir(1, "git")
        (folder / "new.txt").write_text("new\n")
        assert "new.txt" in run(first, "git_status", repo_path=".").content
        assert run(first, "git_add", repo_path=".", files=["new.txt"]).ok
        assert run(first, "git_commit", repo_path=".", message="rollout one").ok
        assert "rollout one" in run(first, "git_log", repo_path=".").content
        assert "rollout one" not in run(second, "git_log", repo_path=".").content
        outside = run(first, "git_status", repo_path=str(template))
        assert outside.error == "tool_exception" and "outside" in outside.content
        children = _children() - before
        assert len(children) == 2
    assert gone(children)
    assert "rollout one" not in subprocess.run(["git", "-C", str(template), "log"],
                                               capture_output=True, text=True).stdout


def _children(parent: int | None = None) -> set[int]:
    """Live child processes of ``parent`` (default this one: the servers pools spawned)."""
    parent = os.getpid() if parent is None else parent
    mine = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            mine.add(int(pid))
    return mine


def test_server_memory_shared_by_rollouts(tmp_path):
    spec = {"name": "memory", "command": "node", "args": [memory_server()],
            "env": {"MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}}
    before = _children()
    with MCPServers([spec]) as servers:
        one, two = ToolRegistry(servers.tools("a")), ToolRegistry(servers.tools("b"))
        entity = {"name": "vault", "entityType": "place", "observations": ["code 7"]}
        assert run(one, "create_entities", entities=[entity]).ok
        found = run(two, "search_nodes", query="vault")
        assert found.ok and "code 7" in found.content  # one server: the other rollout sees it
        bad = run(two, "create_entities", entities="vault")
        assert bad.error == "wrong_type"  # checked against the server's schema, never sent
        children = _children() - before
        assert len(children) == 1
    assert gone(children)


def test_a_streamable_http_server_by_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    marker = f"http-{uuid.uuid4().hex}"
    server = subprocess.Popen([sys.executable, TOY, "--http", str(port), "--marker", marker],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for_port(port)
        with MCPServers([{"name": "web", "url": f"http://127.0.0.1:{port}/mcp",
                          "include": ["echo", "fail"], "scope": "rollout"}]) as servers:
            registry = ToolRegistry(servers.tools("r"))
            assert run(registry, "echo", text="over http").content == "over http"
            assert run(registry, "fail").error == "tool_exception"
            servers.release("r").result(timeout=30)
    finally:
        server.kill()
        server.wait()
    dead = MCPServers([{"name": "web", "url": f"http://127.0.0.1:{port}/mcp",
                        "startup_timeout": 5}])
    with pytest.raises(MCPServerError, match=rf"MCP server 'web' \(http://127.0.0.1:{port}/mcp\) "
                                             "failed to start"):
        dead.start()


def _wait_for_port(port: int, deadline: float = 20.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


def test_a_sandboxed_server_writes_its_folder_and_has_no_network():
    require_bwrap()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for sandbox, reached in ((True, False), (False, True)):  # the control can fail it
            spec = toy("boxed", scope="rollout", sandbox=sandbox,
                       read_only_paths=[str(Path(TOY).parent)])
            with MCPServers([spec]) as servers:
                registry = ToolRegistry(servers.tools("r"))
                assert run(registry, "write", path="out.txt", text="mine").ok
                assert (servers.rollout_dir("r", "boxed") / "out.txt").read_text() == "mine"
                assert run(registry, "connect", port=port).ok is reached
                escape = run(registry, "write", path=str(ROOT / f"escape-{port}"), text="x")
                assert escape.ok is not sandbox
                (ROOT / f"escape-{port}").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# No server outlives the process that started it.

OWNER = """
import sys, time
from agentrl_fast.harness import ToolCall, ToolRegistry
from agentrl_fast.harness.mcp import MCPServers
toy, marker = sys.argv[1], sys.argv[2]
args = [toy, "--marker", marker, "--linger"]  # only a signal stops them
servers = MCPServers([{"name": "shared", "command": sys.executable, "args": args},
                      {"name": "mine", "command": sys.executable, "args": args,
                       "scope": "rollout", "prefix": "r_"}])
registry = ToolRegistry(servers.tools("rollout"))
print(registry.execute_sync([ToolCall("r_where", {})])[0].content, flush=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_no_server_outlives_a_sigkilled_owner(tmp_path):
    marker = f"owner-{uuid.uuid4().hex}"
    # The killed owner cannot remove its rollout folders: they go to the test's tmp_path.
    owner = subprocess.Popen([sys.executable, "-c", OWNER, TOY, marker], cwd=ROOT,
                             env={**os.environ, "TMPDIR": str(tmp_path)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [owner.stdout.readline() for _ in range(2)]
        assert lines[1] == "ready\n", (lines, owner.stderr.read() if owner.poll() else "")
        servers = set(processes_with(marker)) - {owner.pid}
        assert len(servers) == 2  # the shared server and the rollout's
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert gone(servers), servers


def test_close_stops_every_server_and_is_idempotent():
    marker = f"close-{uuid.uuid4().hex}"
    servers = MCPServers([toy("a", "--marker", marker),
                          toy("b", "--marker", marker, scope="rollout", prefix="b_")])
    registry = ToolRegistry(servers.tools("k"))
    assert run(registry, "b_echo", text="x").ok
    assert len(processes_with(marker)) == 2
    servers.close()
    servers.close()
    assert no_process_with(marker)
    closed = run(registry, "echo", text="late")
    assert closed.error == "tool_exception" and "the pool is closed" in closed.content
    with pytest.raises(RuntimeError, match="start\\(\\) after close\\(\\)"):
        servers.tools("k2")
