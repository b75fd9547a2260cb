"""The glue to the official ``mcp`` SDK: the event-loop thread that owns every MCP session, and
one running server (:class:`Connection`).

MCP client sessions are bound to the anyio task that entered them, and rollouts run on event
loops of their own (the engine's, a thread's, ``asyncio.run`` in a test). So one daemon thread
with its own loop (:class:`LoopThread`) owns every session: each :class:`Connection` is a task
there that enters the transport and the session, and waits until it is told to stop; calls are
coroutines submitted to that loop from any thread. That thread also spawns every stdio server,
which matters: the parent-death signal a server gets (``PR_SET_PDEATHSIG``, set by
:data:`PDEATHSIG_WRAPPER` before it ``exec``\\ s the server) fires when the *spawning thread*
exits, so the long-lived loop thread is the one that must spawn.

A stdio server runs as ``python -I -S -c PDEATHSIG_WRAPPER PARENT_PID PID_FILE STATUS_FD --
COMMAND ARGS...``: the wrapper asks for ``SIGKILL`` when its parent dies (and exits at once if
the parent already died), writes its pid (the server's pid: ``exec`` keeps it) to ``PID_FILE``,
and ``exec``\\ s the server. The SDK starts it in a session of its own, so its pid is its
process group, which :meth:`Connection.stop` kills whole after the SDK's own shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Coroutine

INSTALL_HINT = "pip install agentrl_fast[mcp]"

# ``PARENT_PID PID_FILE STATUS_FD -- ARGV``. STATUS_FD >= 0: stderr is duplicated onto that fd
# (inheritable) for the sandbox launcher, which reports through it.
PDEATHSIG_WRAPPER = """\
import ctypes, os, signal, sys
parent, pid_file, status_fd = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
argv = sys.argv[5:]
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # the parent died before the prctl: nothing would kill us later
    os._exit(1)
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
if status_fd >= 0:
    os.dup2(2, status_fd)
try:
    os.execvp(argv[0], argv)
except OSError as error:
    sys.stderr.write(f"cannot run {argv[0]!r}: {error}\\n")
    os._exit(127)
"""

STDERR_TAIL_BYTES = 2000


def require_mcp():
    """The ``mcp`` SDK module, or an ImportError saying how to install it."""
    try:
        import mcp
    except ImportError as error:
        raise ImportError(f"MCP tool servers need the official MCP Python SDK (the 'mcp' "
                          f"package, missing here: {error}): {INSTALL_HINT}") from None
    return mcp


class MCPServerError(RuntimeError):
    """A server that cannot start, died, or answered a call with a protocol error. Its message
    names the server (and, for a start, its command and the tail of its stderr)."""


class MCPToolError(RuntimeError):
    """A tool call the server answered as failed (``isError``): the message is the server's."""


class LoopThread:
    """A daemon thread running an event loop of its own; :meth:`submit` runs a coroutine there
    from any thread."""

    def __init__(self, name: str = "agentrl_fast-mcp"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (after what was submitted before) and join the thread."""
        if not self.alive:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def kill_group(pid: int | None) -> None:
    """``SIGKILL`` to process group ``pid`` (a server started in a session of its own)."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def result_text(result) -> str:
    """A ``CallToolResult``'s content as the text of a ``<tool_response>``: the text blocks
    joined by newlines; other blocks named; the structured content when there is no block."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and getattr(block.resource, "text", None) is not None:
            parts.append(block.resource.text)
        else:
            mime = getattr(block, "mime_type", None) or getattr(block, "uri", None) or ""
            parts.append(f"[{kind} {mime}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


class Connection:
    """One running server: a task on the :class:`LoopThread` that holds its transport and
    session. ``argv``/``env``/``cwd``: the process to spawn (stdio), else ``url`` (streamable
    HTTP); ``shown``: how errors name it (the server's own command line, not the wrappers').
    Start with :meth:`start`, call with :meth:`call`, end with :meth:`stop`; ``exited`` says
    whether the session ended (the server died, or :meth:`stop`)."""

    def __init__(self, label: str, *, argv: list[str] | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 url: str | None = None, state_dir: Path, status_fd: int = -1,
                 shown: str | None = None):
        self.label, self.argv, self.env, self.cwd, self.url = label, argv, env, cwd, url
        self.state_dir, self.status_fd = state_dir, status_fd
        self.shown = shown if shown is not None else url if url is not None else " ".join(argv)
        self.session = None
        self.tools: list = []  # what tools/list answered at the start
        self.exited = False
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task | None = None

    # -- the process --------------------------------------------------------------------------

    @property
    def stderr_path(self) -> Path:
        return self.state_dir / "stderr.log"

    @property
    def pid(self) -> int | None:
        """The server's pid (its process group), once the wrapper wrote it."""
        try:
            return int((self.state_dir / "pid").read_text())
        except (OSError, ValueError):
            return None

    def stderr_tail(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - STDERR_TAIL_BYTES, 0))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        if self.status_fd >= 0:
            text = text.replace("+", "", 1) if text.startswith("+") else text  # the launcher's
        return text.strip()

    # -- lifecycle (on the loop thread) -------------------------------------------------------

    async def start(self, timeout: float) -> list:
        """Start the server, initialize the session and list its tools (every page); an
        :class:`MCPServerError` naming the command and its stderr's tail when it fails."""
        self._stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()
        self._owner = asyncio.ensure_future(self._own(ready))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            await self.stop()
            raise MCPServerError(self._start_failure(f"did not answer within {timeout:g} s "
                                                     "(startup_timeout)")) from None
        except BaseException:  # failed, or cancelled (its rollout ended during the start)
            await self.stop()
            raise

    def _start_failure(self, what: str) -> str:
        tail = self.stderr_tail()
        stderr = f"; the end of its stderr:\n{tail}" if tail else "; its stderr was empty"
        return (f"MCP server {self.label!r} ({self.shown}) failed to start: {what}"
                + ("" if self.url is not None else stderr))

    async def _own(self, ready: asyncio.Future) -> None:
        mcp = require_mcp()
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.url is not None:
                    from mcp.client.streamable_http import streamable_http_client
                    streams = streamable_http_client(self.url)
                else:
                    errlog = stack.enter_context(open(self.stderr_path, "w"))
                    parameters = mcp.StdioServerParameters(command=self.argv[0],
                                                           args=self.argv[1:], env=self.env,
                                                           cwd=self.cwd)
                    streams = mcp.stdio_client(parameters, errlog=errlog)
                stack.callback(lambda: kill_group(self.pid))  # what the SDK's shutdown left
                read, write = await stack.enter_async_context(streams)
                session = await stack.enter_async_context(mcp.ClientSession(read, write))
                await session.initialize()
                self.tools = await _list_tools(session)
                self.session = session
                ready.set_result(self.tools)
                await self._stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
            raise
        except BaseException as error:  # noqa: BLE001 - whatever the SDK or the server did
            if not ready.done():
                ready.set_exception(MCPServerError(self._start_failure(_error_text(error))))
        finally:
            self.exited = True
            self.session = None

    async def stop(self) -> None:
        """End the session and the server (its whole process group); waits for it."""
        if self._owner is None:
            return
        self._stop.set()
        owner = self._owner
        try:
            await asyncio.wait_for(asyncio.shield(owner), 10.0)
        except (asyncio.TimeoutError, TimeoutError):
            owner.cancel()
            with contextlib.suppress(BaseException):
                await owner
        except BaseException:  # noqa: BLE001 - the owner's own failure was already reported
            pass
        kill_group(self.pid)

    async def call(self, name: str, arguments: dict) -> Any:
        """``tools/call``; the SDK's ``CallToolResult``. Raises the SDK's ``MCPError``."""
        if self.session is None:
            raise MCPServerError(f"MCP server {self.label!r} is not running")
        return await self.session.call_tool(name, arguments)


async def _list_tools(session) -> list:
    """Every tool of the server (all pages of ``tools/list``)."""
    from mcp import types
    tools, cursor = [], None
    while True:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _error_text(error: BaseException) -> str:
    """``Type: message`` of an exception, or of an exception group's first leaf (anyio's task
    groups raise groups)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def connection_closed(error: BaseException) -> bool:
    """Whether a call failed because the session ended (the server died or was stopped)."""
    code = getattr(getattr(error, "error", None), "code", None)
    if code is not None:
        from mcp_types import CONNECTION_CLOSED
        return code == CONNECTION_CLOSED
    import anyio
    return isinstance(error, (anyio.ClosedResourceError, anyio.BrokenResourceError,
                              anyio.EndOfStream, ConnectionError))


def wrapped_argv(argv: list[str], pid_file: Path, status_fd: int = -1) -> list[str]:
    """``argv`` behind :data:`PDEATHSIG_WRAPPER` (run by this interpreter, isolated)."""
    return [sys.executable, "-I", "-S", "-c", PDEATHSIG_WRAPPER, str(os.getpid()),
            str(pid_file), str(status_fd), "--", *argv]
