"""The environment's tool: an MCP server verifiers starts as ``python -m vf_lookup.tools``."""

import verifiers.v1 as vf

CODES = {"amber": "4417", "birch": "9023", "cedar": "1358", "dune": "7760"}


class LookupTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the model sees `lookup`, not `lookup_tools_lookup`

    @vf.tool
    async def lookup(self, vault: str) -> str:
        """The code of a vault."""
        return CODES.get(vault, f"no vault named {vault!r}")


if __name__ == "__main__":
    LookupTools.run()
