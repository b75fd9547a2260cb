"""MCP tool-call latency over stdio (scope ``shared`` and ``rollout``, and mcp-server-git)
against the same function as an in-process ``@tool`` (issue 45). Work in progress.

    python bench/bench_mcp.py --out bench/results/mcp.md
"""
