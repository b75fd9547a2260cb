"""The house's layout: ``RunConfig()`` is the main job (what ``agentrl-fast train`` runs, and
``configs/default.yaml``), the config is a leaf (no torch, no trainer, harness or ops), and no
module of ``agentrl_fast`` imports itself back through others."""

import ast
import subprocess
import sys
from pathlib import Path

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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The agentrl_fast modules ``path`` imports when it is imported (imports inside functions
    and under ``TYPE_CHECKING`` run later, or never)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                break
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = package.split(".")[:len(package.split(".")) - sub.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found |= {f"{base}.{a.name}" for a in sub.names}
    return {m for m in found if m in modules}


def test_no_import_circle_in_the_package():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _module_level_imports(path, name, set(paths)) - {name}
             for name, path in paths.items()}
    # a module imports its parent packages too (their __init__ runs first)
    for name in graph:
        parts = name.split(".")
        graph[name] |= {".".join(parts[:i]) for i in range(1, len(parts))} - {name}
    # package __init__s that re-export their own submodules are not circles: drop parent edges
    # from a submodule to its own package
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_no_module_of_the_package_is_over_600_lines():
    """A module over ~600 lines does more than one job: split it (CONTRIBUTING, "Layout")."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
