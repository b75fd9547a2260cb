"""An MCP server's tools as :class:`~agentrl_fast.harness.tools.Tool` objects.

A listed tool keeps its name (after the spec's ``prefix``), description and ``inputSchema``, so
it appears in the tools header like a ``@tool`` function and its calls go through the same
``ToolRegistry``: arguments are checked against the server's schema before anything is sent,
the spec's ``timeout`` bounds each call (a ``timeout`` result; a server's start is not counted),
and every failure (an ``isError`` answer, a protocol error, a dead server) is an exception the
registry turns into an error result the model reads.
A schema the registry cannot use, or a name taken twice, is an error when the server's tools
are listed, naming the server and the tool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import jsonschema

from agentrl_fast.harness.mcp.client import MCPServerError
from agentrl_fast.harness.tools import Tool, ToolRegistry


@dataclass(frozen=True)
class ToolSpec:
    """One listed tool: ``name`` as the model sees it, ``remote`` as the server knows it. The
    call keeps ``timeout`` itself (:class:`~agentrl_fast.harness.tools.ToolTimeout`); the
    registry's timeout, ``timeout + startup_timeout``, is only a backstop."""

    server: str
    name: str
    remote: str
    description: str
    parameters: dict
    timeout: float
    startup_timeout: float


class _RemoteCall:
    """A tool's function: ``await call(**arguments)`` runs ``tools/call`` on the server."""

    def __init__(self, remote: str, call: Callable[[str, dict], Awaitable[str]]):
        self.remote, self._call = remote, call

    async def __call__(self, **arguments: Any) -> str:
        return await self._call(self.remote, arguments)


def build_tool(spec: ToolSpec, call: Callable[[str, dict], Awaitable[str]]) -> Tool:
    """The :class:`Tool` of ``spec`` whose calls go through ``call(remote name, arguments)``."""
    return Tool(name=spec.name, description=spec.description, parameters=spec.parameters,
                fn=_RemoteCall(spec.remote, call), timeout=spec.timeout + spec.startup_timeout)


def tool_specs(server, listed: list, taken: dict[str, str]) -> list[ToolSpec]:
    """The tools ``server`` (an ``MCPServerSpec``) listed, filtered by its ``include`` and
    renamed by its ``prefix``; their names are added to ``taken`` (``{name: owner}``), where a
    name already present is an error naming both owners."""
    names = [t.name for t in listed]
    if server.include is not None:
        missing = [n for n in server.include if n not in names]
        if missing:
            raise ValueError(f"MCP server {server.name!r}: include names {missing[0]!r}, which "
                             f"it does not offer (its tools: {', '.join(names)})")
        listed = [t for t in listed if t.name in server.include]
    specs = []
    for listed_tool in listed:
        name = server.prefix + listed_tool.name
        owner = f"MCP server {server.name!r}"
        if name in taken:
            raise ValueError(f"tool name {name!r} is offered by both {taken[name]} and {owner}; "
                             "give one server a prefix (or an include list)")
        taken[name] = owner
        parameters = checked_schema(listed_tool.input_schema, server.name, listed_tool.name)
        specs.append(ToolSpec(server.name, name, listed_tool.name,
                              listed_tool.description or listed_tool.title or "", parameters,
                              float(server.timeout), float(server.startup_timeout)))
    return specs


def checked_schema(schema: Any, server: str, tool: str) -> dict:
    """``schema`` when it can validate a call's arguments (an ``object`` JSON schema the
    registry compiles), else an :class:`MCPServerError` naming the server and the tool."""
    where = f"MCP server {server!r}: tool {tool!r} has an unusable inputSchema"
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise MCPServerError(f"{where}: it must be a JSON schema of type 'object', got "
                             f"{schema!r:.200}")
    schema = dict(schema)
    try:
        validator = jsonschema.validators.validator_for(schema,
                                                        default=jsonschema.Draft202012Validator)
        validator.check_schema(schema)
        ToolRegistry([Tool(tool, "", schema, _never)])  # the registry's own conversion
    except jsonschema.SchemaError as error:
        raise MCPServerError(f"{where}: {error.message}") from None
    except Exception as error:  # noqa: BLE001 - jsonschema's reference resolution and others
        raise MCPServerError(f"{where}: {type(error).__name__}: {error}") from None
    return schema


def _never(**_: Any) -> None:
    raise AssertionError("only for checking a schema")
