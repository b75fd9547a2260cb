"""The house's layout: ``RunConfig()`` is the main job (what ``agentrl-fast train`` runs, and
``configs/default.yaml``), the config is a leaf (no torch, no trainer, harness or ops), imports
follow the written layers (function-level imports included) and no module imports itself back
through others."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl_fast.cli import _train_config, parser
from agentrl_fast.config import RunConfig, to_yaml

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agentrl_fast"


def test_run_config_is_what_train_runs_with_no_arguments():
    assert _train_config(parser().parse_args(["train"])) == RunConfig()


def test_default_yaml_is_written_from_run_config():
    """configs/default.yaml is `agentrl-fast config` output (regenerate it with that command)."""
    assert (ROOT / "configs" / "default.yaml").read_text() == to_yaml(RunConfig())


def test_the_config_imports_no_torch_trainer_harness_or_ops():
    code = ("import sys, agentrl_fast.config\n"
            "print(' '.join(m for m in sys.modules if m == 'torch' or "
            "m.startswith(('agentrl_fast.train', 'agentrl_fast.harness', 'agentrl_fast.ops'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.strip() == ""


# The written layer order (docs/design.md, "Layers"), highest first. A module imports only its
# own package or packages of lower layers; packages of one layer do not import each other.
# Every import counts: at module level, inside functions and under TYPE_CHECKING.
LAYERS = (
    ("cli",),
    ("train",),
    ("proxy", "envs", "integrations"),
    ("harness",),
    ("generators",),
    ("models",),
    ("ops",),
    ("kernels", "_native"),
    ("config", "seeds"),
)


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every agentrl_fast module ``path`` imports, wherever the import statement is."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules}


def _unit(module: str) -> str | None:
    """The layered package (or top-level module) ``module`` belongs to; None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_problems(root: Path) -> list[str]:
    """Upward imports, imports between packages of one layer, unplaced modules and import
    circles in the package tree ``root/agentrl_fast``."""
    paths = {_module_name(root, p): p for p in (root / "agentrl_fast").rglob("*.py")}
    level = {unit: index for index, units in enumerate(LAYERS) for unit in units}
    graph = {name: _imports(path, name, set(paths)) - {name} for name, path in paths.items()}
    problems = [f"{name}: in no layer (add it to LAYERS and docs/design.md)"
                for name in paths if _unit(name) is not None and _unit(name) not in level]
    for name, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = _unit(name), _unit(other)
            if None in (mine, theirs) or mine == theirs or mine not in level or theirs not in level:
                continue
            if level[theirs] < level[mine]:
                problems.append(f"{name} imports {other}: upward ({theirs} is above {mine})")
            elif level[theirs] == level[mine]:
                problems.append(f"{name} imports {other}: {mine} and {theirs} share a layer")
    return problems + [" -> ".join(c) for c in _circles(graph)]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    # A module imports its parent packages too (their __init__ runs first), except that a
    # package __init__ re-exporting its own submodules is not a circle.
    edges = {}
    for name, imported in graph.items():
        parts = name.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))}
        edges[name] = {m for m in imported | parents if not name.startswith(m + ".")} - {name}
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return circles


def test_imports_follow_the_written_layers():
    problems = layer_problems(ROOT)
    assert not problems, "\n".join(problems)


PLANTS = {
    "upward": ("agentrl_fast/ops/gae.py",
               "\n\ndef _planted():\n    from agentrl_fast.train import ppo  # noqa\n",
               "agentrl_fast.ops.gae imports agentrl_fast.train"),
    "circle": ("agentrl_fast/harness/tool_calls.py",
               "\n\ndef _planted():\n    import agentrl_fast.harness.tools  # noqa\n",
               "agentrl_fast.harness.tool_calls -> agentrl_fast.harness.tools"),
    "one layer": ("agentrl_fast/envs/__init__.py",
                  "\n\ndef _planted():\n    from agentrl_fast.proxy import Proxy  # noqa\n",
                  "share a layer"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_the_layer_check_finds_a_planted_function_level_import(tmp_path, plant):
    shutil.copytree(ROOT / "agentrl_fast", tmp_path / "agentrl_fast",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    assert layer_problems(tmp_path) == []
    where, code, expected = PLANTS[plant]
    with open(tmp_path / where, "a") as file:
        file.write(code)
    assert any(expected in problem for problem in layer_problems(tmp_path)), plant


def test_no_module_of_the_package_is_over_600_lines():
    """A module over ~600 lines does more than one job: split it (CONTRIBUTING, "Layout")."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_the_design_is_cited_inside_the_project():
    """Sources cite docs/design.md, not a DESIGN.md outside the repository."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    citing = [name for name in listed
              if not name.startswith(("bench/results/", "docs/experiments.md"))
              and name != "tests/test_config_layout.py"
              and (ROOT / name).is_file()
              and re.search(r"(?<![\w/.])DESIGN\.md", (ROOT / name).read_text(errors="replace"))]
    assert not citing, f"cite docs/design.md instead of DESIGN.md in: {citing}"
    assert (ROOT / "docs" / "design.md").is_file()
