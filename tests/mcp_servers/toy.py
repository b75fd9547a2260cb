"""A small MCP server for the MCP tests, written with the SDK's low-level ``Server``: tools that
answer, fail, hang, crash, write files and try the network.

    python toy.py [--mode ok|bad-schema|fail-start] [--http PORT] [--marker TEXT] [--linger]

stdio unless ``--http`` (streamable HTTP on 127.0.0.1:PORT, path ``/mcp``). ``--marker`` is only
there to find the process in ``/proc``. ``--linger``: stay alive after stdin closes (a server
only a signal stops). ``crash`` exits the process mid-call; ``crash_once``
does so only while the file ``crash_once`` is absent from the working directory (writing it
first), so a restarted server answers.
"""

import argparse
import os
import socket
import sys

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

NO_ARGUMENTS = {"type": "object", "properties": {}}


def _tool(name: str, description: str, properties: dict | None = None,
          required: tuple = ()) -> types.Tool:
    schema = {"type": "object", "properties": properties or {}}
    if required:
        schema["required"] = list(required)
    return types.Tool(name=name, description=description, input_schema=schema)


TOOLS = [
    _tool("echo", "Echo the text.", {"text": {"type": "string"}}, ("text",)),
    _tool("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}},
          ("a", "b")),
    _tool("fail", "Answer with an isError result."),
    _tool("boom", "Raise inside the handler."),
    _tool("slow", "Sleep for the given seconds.", {"seconds": {"type": "number"}}, ("seconds",)),
    _tool("crash", "Exit the server process mid-call."),
    _tool("crash_once", "Exit mid-call unless a file crash_once is in the working directory."),
    _tool("write", "Write a file in the working directory.",
          {"path": {"type": "string"}, "text": {"type": "string"}}, ("path", "text")),
    _tool("where", "The working directory and pid."),
    _tool("connect", "Open a TCP connection to 127.0.0.1:port.", {"port": {"type": "integer"}},
          ("port",)),
]


async def list_tools(ctx, params) -> types.ListToolsResult:
    if MODE == "bad-schema":
        broken = types.Tool(name="broken", description="Its schema is not a schema.",
                            input_schema={"type": "object",
                                          "properties": {"x": {"type": "no-such-type"}}})
        return types.ListToolsResult(tools=[TOOLS[0], broken])
    return types.ListToolsResult(tools=TOOLS)


def text(value: str, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=value)],
                                is_error=error)


async def call_tool(ctx, params) -> types.CallToolResult:
    name, arguments = params.name, params.arguments or {}
    if name == "echo":
        return text(arguments["text"])
    if name == "add":
        return text(str(arguments["a"] + arguments["b"]))
    if name == "fail":
        return text("the toy failed on purpose", error=True)
    if name == "boom":
        raise RuntimeError("the handler blew up")
    if name == "slow":
        await anyio.sleep(arguments["seconds"])
        return text("slept")
    if name == "crash" or (name == "crash_once" and not os.path.exists("crash_once")):
        if name == "crash_once":
            open("crash_once", "w").close()
        sys.stderr.write("toy: crashing on purpose\n")
        sys.stderr.flush()
        os._exit(3)
    if name == "crash_once":
        return text("survived")
    if name == "write":
        with open(arguments["path"], "w") as f:
            f.write(arguments["text"])
        return text(f"wrote {os.path.abspath(arguments['path'])}")
    if name == "where":
        return text(f"{os.getcwd()} {os.getpid()}")
    if name == "connect":
        try:
            with socket.create_connection(("127.0.0.1", arguments["port"]), timeout=2):
                return text("connected")
        except OSError as error:
            return text(f"no connection: {error}", error=True)
    return text(f"unknown tool {name}", error=True)


server = Server("toy", on_list_tools=list_tools, on_call_tool=call_tool)


async def main_stdio() -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def main_http(port: int) -> None:
    import uvicorn
    uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="ok", choices=("ok", "bad-schema", "fail-start"))
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--marker", default="")
    parser.add_argument("--linger", action="store_true")
    options = parser.parse_args()
    MODE = options.mode
    if MODE == "fail-start":
        sys.stderr.write("toy: refusing to start (--mode fail-start)\n")
        sys.exit(2)
    if options.http is not None:
        main_http(options.http)
    else:
        anyio.run(main_stdio)
    if options.linger:
        import time
        time.sleep(3600)
