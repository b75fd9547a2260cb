"""bench/gpu_suite.sh fits its lease: the stage caps sum to SUITE_SECONDS, the headline benchmarks
come before the compiled baselines and the test stages, and the preflight
(bench/gpu_preflight.py) lists every third-party module the stages' sources import, followed
through our own modules; and the whole suite dry-runs on the CPU with tiny sizes (in the
background from the session's start: tests/background.py)."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from background import Command

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench" / "gpu_suite.sh"
HEADLINE = ("bench_gae", "bench_varlen_attention", "bench_token_logprobs", "bench_ppo_loss")
LATER = ("bench_compiled", "tests", "sanitize")


def _dry_run_command() -> Command:
    out = Path(tempfile.gettempdir()) / f"agentrl_fast_gpu_suite_dry_run_{os.getpid()}"
    # nice 5: one core's work for ~80 s; at 19 it ran last, alone, after every other test
    return Command(["bash", str(SUITE), str(out), "--device", "cpu", "--tiny"], cwd=str(ROOT),
                   env=dict(os.environ, CAP_SCALE="5"), timeout=900, nice=5)


def background_command(params: dict) -> Command | None:
    """The dry run starts in the background at the session's start (tests/background.py)."""
    return _dry_run_command() if "dry_run" in params else None


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", ["cpu-tiny"])
def test_the_whole_suite_dry_runs_on_the_cpu(dry_run, background_result):
    """Every stage of bench/gpu_suite.sh runs (tiny sizes, CPU tensors) and passes."""
    command = _dry_run_command()
    result = background_result(command)
    out = Path(command.argv[2])
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert result.returncode == 0, summary + result.stdout[-3000:] + result.stderr[-3000:]
    names = [name for name, _ in plan()[0]]
    for name in names:
        assert re.search(rf"^{name}: ok in", summary, re.M), (name, summary)
    assert summary.splitlines()[-1] == "gpu_suite: all stages passed"
    rows = (out / "rows.jsonl").read_text().splitlines()
    ops = {json.loads(row)["op"] for row in rows}
    assert {"gae", "varlen_attention", "token_logprobs", "ppo_loss"} <= ops, ops
    assert "warm_triton_cache: exit 0" in (out / "warm.log").read_text()
    # the backward probe ran beside the stages: its jobs right under the interpreter
    probe = [json.loads(row) for row in (out / "probe.jsonl").read_text().splitlines()]
    assert probe and all(row["verdict"] == "ok" for row in probe), probe
    assert "probe_backward: exit 0" in (out / "probe.log").read_text()


def load_preflight():
    spec = importlib.util.spec_from_file_location("gpu_preflight",
                                                  ROOT / "bench" / "gpu_preflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan() -> tuple[list[tuple[str, int]], int, int]:
    """(stages with caps in order, their total, SUITE_SECONDS) from ``gpu_suite.sh --plan``."""
    out = subprocess.run(["bash", str(SUITE), "--plan"], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    stages = [(m[1], int(m[2])) for m in re.finditer(r"^(\w+)\s+(\d+)s$", out, re.M)]
    total = re.search(r"^total\s+(\d+)s \(SUITE_SECONDS (\d+)\)", out, re.M)
    return stages, int(total[1]), int(total[2])


def test_the_stage_caps_sum_to_the_suite_budget_of_nine_minutes():
    stages, total, budget = plan()
    assert sum(cap for _, cap in stages) == total == budget
    assert budget <= 540  # of a 15-minute lease: the machine's start and a stage's rerun
    assert all(cap >= 10 for _, cap in stages)


def test_headline_benchmarks_come_before_compiled_baselines_and_tests():
    names = [name for name, _ in plan()[0]]
    assert names[:2] == ["preflight", "build"]
    assert all(names.index(h) < names.index(later) for h in HEADLINE for later in LATER)


def test_unknown_stage_in_only_is_refused(tmp_path):
    result = subprocess.run(["bash", str(SUITE), str(tmp_path), "--only", "tests,nope"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--only: unknown stage nope" in result.stderr


# ---------------------------------------------------------------------------------------------
# The preflight's module lists against the sources.

LOCAL_PACKAGES = ("agentrl_fast", "bench", "tests")
OPTIONAL_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _guarded_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes that are optional: inside ``try`` blocks that catch import errors,
    or under ``if TYPE_CHECKING``."""
    guarded = set()
    for node in ast.walk(tree):
        bodies = []
        if isinstance(node, ast.Try):
            caught = set()
            for handler in node.handlers:
                types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                caught |= {getattr(t, "id", getattr(t, "attr", None)) for t in types if t}
                if handler.type is None:
                    caught.add("BaseException")
            if caught & OPTIONAL_ERRORS:
                bodies = node.body
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            bodies = node.body
        for body in bodies:
            guarded |= {id(n) for n in ast.walk(body)}
    return guarded


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, level) of every unguarded import in ``path``, functions included."""
    tree = ast.parse(path.read_text())
    guarded = _guarded_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found.append((base, node.level))
            # "from package import submodule" imports the submodule's file too
            found += [(f"{base}.{alias.name}" if base else alias.name, node.level)
                      for alias in node.names]
    return found


def _local_file(module: str, level: int, importer: Path) -> Path | None:
    """Our own source file for ``module`` (agentrl_fast, bench, a tests/ helper)."""
    if level:
        package = importer.parent
        for _ in range(level - 1):
            package = package.parent
        parts, base = module.split(".") if module else [], package
    else:
        parts = module.split(".")
        if parts[0] in LOCAL_PACKAGES:
            base, parts = ROOT / parts[0], parts[1:]
        else:
            base = importer.parent  # a sibling script's helper (tests' "import background")
    path = base.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def third_party_imports(scripts: list[Path]) -> dict[str, Path]:
    """Top-level third-party modules the scripts import, following our own modules (and their
    packages' __init__ files); each with a file that imports it."""
    todo, seen, found = list(scripts), set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, level in _imports(path):
            local = _local_file(module, level, path)
            if local is not None:
                todo.append(local)
                parts = module.split(".")  # the packages' __init__ files run too
                for i in range(1, len(parts)):
                    package = _local_file(".".join(parts[:i]), level, path)
                    if package is not None:
                        todo.append(package)
                continue
            root = module.split(".")[0]
            ours = root in LOCAL_PACKAGES or (ROOT / "tests" / f"{root}.py").exists()
            if level == 0 and root and root not in sys.stdlib_module_names and not ours:
                found.setdefault(root, path)  # (agentrl_fast._C, the extension, is ours too)
    return found


def test_the_preflight_lists_every_module_the_stages_import():
    preflight = load_preflight()
    names = [name for name, _ in plan()[0] if name != "preflight"]
    assert sorted(preflight.STAGE_MODULES) == sorted(names) == sorted(preflight.STAGE_SCRIPTS)
    missing = []
    for stage in names:
        scripts = [ROOT / s for s in preflight.stage_scripts(stage)]
        if stage == "build":
            scripts.append(ROOT / "setup.py")
        assert all(s.is_file() for s in scripts), scripts
        for module, where in third_party_imports(scripts).items():
            if module not in preflight.STAGE_MODULES[stage] + preflight.OPTIONAL_MODULES:
                missing.append(f"{stage}: {module} (imported by {where.relative_to(ROOT)})")
    assert not missing, "bench/gpu_preflight.py STAGE_MODULES lacks:\n" + "\n".join(missing)


def test_the_scanner_follows_our_modules_and_skips_optional_imports(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os\nimport numpy\nfrom agentrl_fast.ops import gae\n"
                      "try:\n    import optional_thing\nexcept ImportError:\n    pass\n"
                      "def f():\n    import yaml\n")
    found = third_party_imports([script])
    assert {"numpy", "yaml", "torch"} <= set(found)  # torch: through agentrl_fast.ops.gae
    assert not {"optional_thing", "os", "agentrl_fast"} & set(found)


@pytest.mark.parametrize("stage", ["tests"])
def test_every_gpu_test_file_is_in_the_tests_stage(stage):
    preflight = load_preflight()
    files = preflight.stage_scripts(stage)
    assert "tests/test_varlen_attention.py" in files and "tests/conftest.py" in files


def test_the_warm_jobs_cover_the_attention_gpu_grid():
    """bench/warm_triton_cache.py warms the attention GPU tests' cases by index."""
    sys.path.insert(0, str(ROOT / "bench"))
    import warm_triton_cache
    from test_varlen_attention import TRITON_GPU_GRID

    cases = [o["case"] for op, _, o in warm_triton_cache.JOBS if op == "test_varlen_attention"]
    assert cases == list(range(len(TRITON_GPU_GRID)))
