"""MCP server specs and the pool that runs them: :class:`MCPServerSpec`, :class:`MCPServers`.

A spec names a server and how to reach it: a command (stdio) or a ``url`` (streamable HTTP).
Its ``scope`` says how many run: ``"shared"``, one for the whole run; ``"rollout"``, one per
rollout, in a fresh folder of its own (``{rollout_dir}`` in ``args``, ``cwd`` and ``env`` values
becomes that folder; ``rollout_dir_template`` seeds it with a copy of a folder, a git repository
for example).

:class:`MCPServers` runs them. :meth:`MCPServers.start` starts the shared servers and, once, a
probe of each rollout server (in a scratch folder, then stopped) to list the tools: every
rollout of a server offers the same tools, and the tools header must be known before the first
generation. :meth:`MCPServers.tools` gives a rollout its tools without starting anything; a
rollout's own servers start at its first call (within ``startup_timeout``, before the call's
``timeout`` runs) and stop at
:meth:`MCPServers.release`; :meth:`MCPServers.close` stops everything (``atexit`` too). Every
session lives on one thread of the pool's (:mod:`.client`), which also spawns every server: a
server's parent-death signal fires when the thread that spawned it exits, and this one lives as
long as the pool. A server that dies is started again once
(the call that saw it die fails; the next one runs on the new server); when the second one dies
too, every later call fails at once, naming the server.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import numbers
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Hashable, Iterable, Mapping, Sequence

from agentrl_fast.harness.mcp.client import (Connection, LoopThread, MCPServerError, MCPToolError,
                                             connection_closed, kill_group, require_mcp,
                                             result_text, wrapped_argv)
from agentrl_fast.harness.mcp.tools import ToolSpec, build_tool, tool_specs
from agentrl_fast.harness.tools import Tool, ToolTimeout

SCOPES = ("shared", "rollout")
ROLLOUT_DIR = "{rollout_dir}"
"""The placeholder for a rollout server's folder in ``args``, ``cwd`` and ``env`` values."""

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SANDBOX_MEMORY_MB = 8192  # RLIMIT_AS per process: V8 and the JVM reserve address space early
_SANDBOX_CPU_S = 7 * 24 * 3600  # RLIMIT_CPU: a server lives as long as the run
_SANDBOX_STATUS_FD = 9  # where the sandbox launcher reports (a copy of the server's stderr)
_DIED_TAIL_CHARS = 300


@dataclass(frozen=True)
class MCPServerSpec:
    """One MCP server (see the module doc). Build it directly or with :meth:`from_mapping`.

    ``command``/``args``/``env``/``cwd``: a stdio server (``env`` is added to a minimal
    environment: ``HOME``, ``LOGNAME``, ``PATH``, ``SHELL``, ``TERM``, ``USER``); ``url``: a
    streamable HTTP server instead. ``timeout``: seconds per call; ``startup_timeout``: seconds
    for a start (a rollout server's first call may wait for both). ``sandbox``: run the
    stdio server under bubblewrap (:mod:`agentrl_fast.harness.sandbox`): no network, a read-only
    view of the system and the interpreter plus ``read_only_paths``, its folder (the rollout's,
    or a fresh one for a shared server) writable and its working directory. ``prefix``: put
    before each tool name; ``include``: keep only these of the server's tools (its own names).
    """

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    scope: str = "shared"
    rollout_dir_template: str | None = None
    timeout: float = 30.0
    startup_timeout: float = 30.0
    sandbox: bool = False
    read_only_paths: tuple[str, ...] = ()
    prefix: str = ""
    include: tuple[str, ...] | None = None

    def __post_init__(self):
        where = f"MCP server {self.name!r}" if isinstance(self.name, str) else "MCP server"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"{where}: name must be letters, digits, '_', '.' or '-', "
                             f"got {self.name!r}")
        if (self.command is None) == (self.url is None):
            raise ValueError(f"{where}: give either command (a stdio server) or url (a "
                             "streamable HTTP server), not both or neither")
        _check_text(self.command, "command", where)
        _check_text(self.cwd, "cwd", where)
        _check_text(self.rollout_dir_template, "rollout_dir_template", where)
        object.__setattr__(self, "args", _strings(self.args, "args", where))
        object.__setattr__(self, "read_only_paths",
                           _strings(self.read_only_paths, "read_only_paths", where))
        if self.include is not None:
            object.__setattr__(self, "include", _strings(self.include, "include", where))
        if not isinstance(self.env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"{where}: env must map names to strings, got {self.env!r}")
        object.__setattr__(self, "env", dict(self.env))
        if self.url is not None and not (isinstance(self.url, str)
                                         and re.match(r"https?://", self.url)):
            raise ValueError(f"{where}: url must be an http:// or https:// URL, got {self.url!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"{where}: scope must be one of {', '.join(SCOPES)}, "
                             f"got {self.scope!r}")
        for name in ("timeout", "startup_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ValueError(f"{where}: {name} must be > 0 seconds, got {value!r}")
        for name in ("sandbox",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{where}: {name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.prefix, str) or (self.prefix and not _NAME.fullmatch(self.prefix)):
            raise ValueError(f"{where}: prefix must be letters, digits, '_', '.' or '-', "
                             f"got {self.prefix!r}")
        self._check_placement(where)

    def _check_placement(self, where: str) -> None:
        """The options that need a process, or a rollout's folder, have them."""
        if self.url is not None:
            given = [n for n in ("args", "env", "cwd", "rollout_dir_template", "read_only_paths")
                     if getattr(self, n)] + (["sandbox"] if self.sandbox else [])
            if given:
                raise ValueError(f"{where}: {given[0]} applies to a stdio server (command), "
                                 "not to a url")
        if self.scope != "rollout":
            if self.rollout_dir_template is not None:
                raise ValueError(f"{where}: rollout_dir_template needs scope: rollout (a "
                                 "shared server has no rollout folder)")
            for name, text in self._placed():
                if ROLLOUT_DIR in text:
                    raise ValueError(f"{where}: {name} uses {ROLLOUT_DIR}, which needs scope: "
                                     "rollout (a shared server has no rollout folder)")
        if self.sandbox and self.cwd is not None:
            raise ValueError(f"{where}: cwd: a sandboxed server runs in its own folder (the "
                             f"rollout's, {ROLLOUT_DIR}); leave cwd out")

    def _placed(self) -> list[tuple[str, str]]:
        """``(field, text)`` of every value a placeholder may be in."""
        return ([(f"args[{i}]", a) for i, a in enumerate(self.args)]
                + [(f"env.{k}", v) for k, v in self.env.items()]
                + ([("cwd", self.cwd)] if self.cwd is not None else []))

    @classmethod
    def from_mapping(cls, mapping: Mapping, where: str = "mcp_servers[0]",
                     search: Iterable[str | os.PathLike] = ()) -> "MCPServerSpec":
        """A spec from a config mapping; relative ``rollout_dir_template`` and
        ``read_only_paths`` are looked up in the working directory, then in ``search``. Errors
        name ``where`` and the field."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{where}: expected a mapping (name, command or url, ...), "
                             f"got {type(mapping).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: not an MCP server field (fields: "
                             f"{', '.join(sorted(known))})")
        if "name" not in mapping:
            raise ValueError(f"{where}.name: missing (every server needs a name)")
        values = dict(mapping)
        search = list(search)
        if isinstance(values.get("rollout_dir_template"), str):
            values["rollout_dir_template"] = _find_folder(values["rollout_dir_template"],
                                                          f"{where}.rollout_dir_template", search)
        if isinstance(values.get("read_only_paths"), (list, tuple)):
            values["read_only_paths"] = [
                _find_folder(p, f"{where}.read_only_paths[{i}]", search, folder=False)
                if isinstance(p, str) else p for i, p in enumerate(values["read_only_paths"])]
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def placed(self, rollout_dir: str | None) -> tuple[list[str], dict[str, str], str | None]:
        """``(argv, env, cwd)`` with :data:`ROLLOUT_DIR` replaced by ``rollout_dir``."""
        def put(text: str) -> str:
            return text if rollout_dir is None else text.replace(ROLLOUT_DIR, rollout_dir)

        cwd = put(self.cwd) if self.cwd is not None else None
        return ([put(self.command), *map(put, self.args)],
                {k: put(v) for k, v in self.env.items()}, cwd)


def _check_text(value, name: str, where: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{where}: {name} must be a non-empty string, got {value!r}")


def _strings(values, name: str, where: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{where}: {name} must be a list of strings, got {values!r}")
    values = tuple(values)
    bad = next((v for v in values if not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"{where}: {name} must be a list of strings, got {bad!r} in it")
    return values


def _find_folder(path: str, where: str, search: list, folder: bool = True) -> str:
    given = Path(path).expanduser()
    places = [given] if given.is_absolute() else [Path.cwd() / given,
                                                  *(Path(f) / given for f in search)]
    for place in places:
        if place.is_dir() or (not folder and place.exists()):
            return str(place.resolve())
    kind = "folder" if folder else "path"
    raise ValueError(f"{where}: no {kind} {path!r} (looked in "
                     f"{', '.join(str(p) for p in dict.fromkeys(places))})")


def parse_servers(items, where: str = "mcp_servers",
                  search: Iterable[str | os.PathLike] = ()) -> list[MCPServerSpec]:
    """Specs from a list of specs or config mappings; two servers of one name: an error."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise ValueError(f"{where}: expected a list of MCP servers, got {type(items).__name__}")
    specs, search = [], list(search)
    for index, item in enumerate(items):
        spec = (item if isinstance(item, MCPServerSpec)
                else MCPServerSpec.from_mapping(item, f"{where}[{index}]", search))
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"{where}[{index}].name: two servers are named {spec.name!r}")
        specs.append(spec)
    return specs


# ---------------------------------------------------------------------------------------------
# The pool.

class _Server:
    """One server of one rollout (or the shared one): its folder, the running connection, and
    how often it was started. Lives on the loop thread."""

    def __init__(self, pool: "MCPServers", spec: MCPServerSpec, key: Hashable | None):
        self.pool, self.spec, self.key = pool, spec, key
        self.folder: Path | None = None
        self.connection: Connection | None = None
        self.starting: asyncio.Future | None = None
        self.starts = 0
        self.down: str | None = None  # why it stays down: died after its restart, or stopped

    async def ready(self) -> Connection:
        """The running connection, started now if needed (shielded: a caller's timeout does
        not stop a start other calls wait for)."""
        if self.down is not None:
            raise MCPServerError(f"MCP server {self.spec.name!r} is down: {self.down}")
        if self.starting is None:
            self.starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self.starting)

    async def _start(self) -> Connection:
        self.starts += 1
        if self.folder is None:
            self.folder = await asyncio.to_thread(self.pool._new_folder, self.spec, self.key)
        connection = self.pool._connection(self.spec, self.folder, self.starts)
        await connection.start(self.spec.startup_timeout)
        self.connection = connection
        return connection

    async def call(self, name: str, arguments: dict) -> str:
        """``tools/call`` within the spec's ``timeout`` (after the start, if it must start)."""
        connection = await self.ready()
        try:
            result = await asyncio.wait_for(connection.call(name, arguments), self.spec.timeout)
        except (asyncio.TimeoutError, TimeoutError):  # wait_for's: the SDK raises MCPError
            raise ToolTimeout(self.spec.timeout) from None
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the SDK's and the transport's
            if connection.exited or connection_closed(error):
                raise MCPServerError(await self._died(connection)) from None
            raise MCPServerError(f"MCP server {self.spec.name!r} failed the call: "
                                 f"{type(error).__name__}: {error}") from None
        if result.is_error:
            raise MCPToolError(result_text(result) or "the server reported an error")
        return result_text(result)

    async def _died(self, connection: Connection) -> str:
        """The message for a call that saw the server die; starts it again once."""
        tail = connection.stderr_tail()[-_DIED_TAIL_CHARS:]  # the model reads it: kept short
        what = (f"MCP server {self.spec.name!r} ({connection.shown}) died during the call"
                + (f"; the end of its stderr: {tail!r}; " if tail else "; "))
        if self.connection is connection:
            self.connection = None
            await connection.stop()
            if self.down is None and self.starts >= 2:
                self.down, self.starting = "it died again after its restart", None
            elif self.down is None:
                self.starting = asyncio.ensure_future(self._start())
                self.starting.add_done_callback(_retrieve)
        if self.down is not None:
            return what + f"it stays down: {self.down}"
        return what + "it is restarted for the next call"

    async def stop(self) -> None:
        """Stop the server for good (its folder removed, for a rollout's)."""
        self.down = "it was stopped (its rollout ended, or the pool closed)"
        if self.starting is not None and not self.starting.done():
            self.starting.cancel()
            with contextlib.suppress(BaseException):
                await self.starting
        connection, self.connection = self.connection, None
        if connection is not None:
            await connection.stop()
        if self.folder is not None and self.key is not None:
            await asyncio.to_thread(self.pool._remove_folder, self.folder)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a background start's failure as seen (a later call reports it)."""
    if not future.cancelled():
        future.exception()


class MCPServers:
    """MCP tool servers for a run's rollouts (see the module doc).

    ``servers``: :class:`MCPServerSpec` objects or config mappings (:meth:`MCPServerSpec.
    from_mapping`, relative paths looked up in the working directory, then ``search``).
    ``reserved``: tool names already taken (``{name: owner}``, e.g. the environment's Python
    tools): an MCP tool of such a name is an error naming both.

    ``start()`` (also run by the first ``tools()``): starts the shared servers, lists every
    server's tools; ``tools(rollout_key)``: a rollout's :class:`~agentrl_fast.harness.tools.Tool`
    objects (any hashable key, unique per rollout); ``release(rollout_key)``: stops that
    rollout's servers (in the background; returns a future); ``close()``: stops every server.
    Also a context manager.
    """

    def __init__(self, servers: Sequence[MCPServerSpec | Mapping], *,
                 search: Iterable[str | os.PathLike] = (),
                 reserved: Mapping[str, str] | None = None, where: str = "mcp_servers"):
        self.specs = parse_servers(servers, where, search)
        self.reserved = dict(reserved or {})
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._tools: dict[str, list[ToolSpec]] | None = None
        self._servers: dict[tuple[str, Hashable | None], _Server] = {}
        self._releasing: set[_Server] = set()  # released, not stopped yet
        self._root: Path | None = None
        self._folders = itertools.count()
        self._closed = False
        self._bwrap: tuple[str, int] | None = None
        if any(spec.sandbox for spec in self.specs):
            _sandbox_problem(next(s for s in self.specs if s.sandbox))
        _OPEN.add(self)

    # -- public ---------------------------------------------------------------------------------

    @property
    def tool_names(self) -> dict[str, str]:
        """``{tool name: server name}`` of every MCP tool (after :meth:`start`)."""
        self.start()
        return {t.name: t.server for specs in self._tools.values() for t in specs}

    def start(self) -> None:
        """Start the shared servers and list every server's tools (once); raises
        :class:`MCPServerError` (a server that cannot start, a bad tool schema) or
        ``ValueError`` (a tool name taken twice)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("MCPServers: start() after close()")
            if self._tools is not None:
                return
            require_mcp()
            self._loop = LoopThread()
            self._root = Path(tempfile.mkdtemp(prefix="agentrl_fast-mcp-"))
            try:
                self._tools = self._loop.submit(self._discover()).result()
            except BaseException:
                self._tools = None
                self._shutdown()
                raise

    def tools(self, rollout_key: Hashable) -> list[Tool]:
        """The tools of one rollout: the shared servers' and its own servers' (which start at
        its first call to one of them). Starts nothing else."""
        if rollout_key is None:
            raise ValueError("MCPServers.tools: rollout_key must not be None")
        self.start()
        return [build_tool(spec, self._caller(spec.server, rollout_key))
                for specs in self._tools.values() for spec in specs]

    def release(self, rollout_key: Hashable) -> concurrent.futures.Future:
        """Stop ``rollout_key``'s servers and remove their folders, in the background; the
        future is done when they are stopped. Releasing a key with no servers is a no-op."""
        with self._lock:
            loop = self._loop
            mine = [self._servers.pop(k) for k in list(self._servers) if k[1] == rollout_key
                    and self._specs[k[0]].scope == "rollout"] if loop is not None else []
            self._releasing.update(mine)  # until stopped: close() waits for them
        if not mine:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        stopping = loop.submit(_stop_all(mine))
        stopping.add_done_callback(lambda _: self._releasing.difference_update(mine))
        return stopping

    def rollout_dir(self, rollout_key: Hashable, server: str) -> Path | None:
        """The folder of ``rollout_key``'s ``server`` (``None`` before its first call and
        after its release)."""
        found = self._servers.get((server, rollout_key))
        return found.folder if found is not None else None

    def close(self) -> None:
        """Stop every server (shared and rollout) and the pool's thread; idempotent."""
        with self._lock:
            self._closed = True
            self._shutdown()

    def __enter__(self) -> "MCPServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    @property
    def _specs(self) -> dict[str, MCPServerSpec]:
        return {spec.name: spec for spec in self.specs}

    def _shutdown(self) -> None:
        loop, self._loop = self._loop, None
        servers = [*self._servers.values(), *self._releasing.copy()]  # (copy(): atomic)
        self._servers = {}
        if loop is not None and loop.alive:
            with contextlib.suppress(Exception):
                loop.submit(_stop_all(servers)).result(timeout=60)
            loop.stop()
        for server in servers:  # the loop is gone: whatever still runs is killed
            if server.connection is not None:
                kill_group(server.connection.pid)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        _OPEN.discard(self)

    async def _discover(self) -> dict[str, list[ToolSpec]]:
        """Every server's tools: the shared servers stay up, each rollout server's probe (in a
        scratch folder) is stopped."""
        async def listing(spec: MCPServerSpec) -> list:
            probe = _Server(self, spec, None if spec.scope == "shared" else ("probe",))
            if spec.scope == "shared":
                self._servers[(spec.name, None)] = probe
            try:
                return (await probe.ready()).tools
            finally:
                if spec.scope == "rollout":
                    await probe.stop()

        results = await asyncio.gather(*(listing(s) for s in self.specs), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure
        found: dict[str, list[ToolSpec]] = {}
        taken = dict(self.reserved)
        for spec, listed in zip(self.specs, results):
            found[spec.name] = tool_specs(spec, listed, taken)
        return found

    def _caller(self, server: str, key: Hashable):
        """The coroutine function a tool of ``server`` runs for rollout ``key``."""
        scope_key = None if self._specs[server].scope == "shared" else key

        async def call(name: str, arguments: dict) -> str:
            loop = self._loop
            if loop is None:
                raise MCPServerError(f"MCP server {server!r}: the pool is closed")
            return await asyncio.wrap_future(loop.submit(
                self._server(server, scope_key).call(name, arguments)))

        return call

    def _server(self, name: str, key: Hashable | None) -> _Server:
        """The server of ``(name, key)``, made on first use (on the loop thread)."""
        with self._lock:
            found = self._servers.get((name, key))
            if found is None:
                if self._closed:
                    raise MCPServerError(f"MCP server {name!r}: the pool is closed")
                found = self._servers[(name, key)] = _Server(self, self._specs[name], key)
            return found

    def _new_folder(self, spec: MCPServerSpec, key: Hashable | None) -> Path:
        """A fresh folder for a server: a copy of the template, or empty."""
        folder = self._root / f"{spec.name}-{next(self._folders)}"
        if spec.rollout_dir_template is not None:
            shutil.copytree(spec.rollout_dir_template, folder, symlinks=True)
        else:
            folder.mkdir(parents=True)
        return folder

    def _remove_folder(self, folder: Path) -> None:
        """Remove a rollout server's folder and its starts' state."""
        shutil.rmtree(folder, ignore_errors=True)
        for state in (self._root / ".state").glob(f"{folder.name}.*"):
            shutil.rmtree(state, ignore_errors=True)

    def _connection(self, spec: MCPServerSpec, folder: Path, start: int) -> Connection:
        """How to run ``spec`` in ``folder`` (its ``start``-th start)."""
        state = self._root / ".state" / f"{folder.name}.{start}"
        state.mkdir(parents=True, exist_ok=True)
        label = spec.name
        if spec.url is not None:
            return Connection(label, url=spec.url, state_dir=state)
        rollout_dir = str(folder) if spec.scope == "rollout" else None
        argv, env, cwd = spec.placed(rollout_dir)
        cwd = rollout_dir if cwd is None else cwd  # a rollout server works in its folder
        status_fd, shown = -1, " ".join(argv)
        if spec.sandbox:
            argv = self._sandboxed(spec, argv, folder)
            cwd, status_fd = str(folder), _SANDBOX_STATUS_FD
        return Connection(label, argv=wrapped_argv(argv, state / "pid", status_fd), env=env,
                          cwd=cwd, state_dir=state, status_fd=status_fd, shown=shown)

    def _sandboxed(self, spec: MCPServerSpec, argv: list[str], folder: Path) -> list[str]:
        """``argv`` under bubblewrap and the sandbox's launcher, ``folder`` writable."""
        from agentrl_fast.harness.sandbox.bwrap import bwrap_command, bwrap_path, sandbox_uid
        from agentrl_fast.harness.sandbox.execute import MAX_PROCESSES
        from agentrl_fast.harness.sandbox.launcher import inner_command
        if self._bwrap is None:
            self._bwrap = (bwrap_path(), sandbox_uid())
        bwrap, uid = self._bwrap
        if uid >= 0:  # root's sandboxes run as a fresh uid, which must own the folder
            for path in [folder, *folder.rglob("*")]:
                os.lchown(path, uid, uid)
        inner = inner_command(_SANDBOX_STATUS_FD, _SANDBOX_MEMORY_MB, _SANDBOX_CPU_S,
                              MAX_PROCESSES, uid, False, argv)
        return bwrap_command(bwrap, inner, uid=uid, cwd=str(folder),
                             read_only_paths=list(spec.read_only_paths),
                             writable_paths=[str(folder)])


async def _stop_all(servers: list[_Server]) -> None:
    await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)


def _sandbox_problem(spec: MCPServerSpec) -> None:
    """ValueError naming the server when bubblewrap cannot run here."""
    from agentrl_fast.harness.sandbox.execute import bwrap_problem
    problem = bwrap_problem()
    if problem is not None:
        raise ValueError(f"MCP server {spec.name!r}: sandbox: true needs bubblewrap, which "
                         f"cannot isolate here ({problem})")


# Pools not closed yet: closed at exit (a backstop for a run that never reached its close()).
_OPEN: "weakref.WeakSet[MCPServers]" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_OPEN):
        with contextlib.suppress(Exception):
            pool.close()
