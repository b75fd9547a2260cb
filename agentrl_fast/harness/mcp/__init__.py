"""MCP (Model Context Protocol) tool servers as a rollout's tools, through the official ``mcp``
SDK (an optional extra: ``pip install agentrl_fast[mcp]``; imported only when a server starts).

:class:`MCPServerSpec` describes a server (stdio command or streamable-HTTP ``url``, ``scope``
``"shared"`` or ``"rollout"``, per-call ``timeout``, ``sandbox``); :class:`MCPServers` runs a
list of them for a run and gives each rollout its :class:`~agentrl_fast.harness.tools.Tool`
objects (:mod:`.servers`); :mod:`.tools` adapts listed tools, :mod:`.client` is the SDK glue
(one thread owns every session; servers die with the trainer). Usage in ``docs/harness.md``
("MCP tool servers").
"""

from agentrl_fast.harness.mcp.client import INSTALL_HINT, MCPServerError, MCPToolError
from agentrl_fast.harness.mcp.servers import ROLLOUT_DIR, SCOPES, MCPServers, MCPServerSpec

__all__ = ["INSTALL_HINT", "MCPServerError", "MCPServerSpec", "MCPServers", "MCPToolError",
           "ROLLOUT_DIR", "SCOPES"]
