"""Side environments (virtual environments beside the main one, built by
``tools/setup_test_env.sh`` from ``tools/side-envs/NAME.txt``): where they live and the rule for
a missing one (under ``CI=true`` the test fails, elsewhere it skips naming the script)."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "tools" / "side-envs"
SETUP = "tools/setup_test_env.sh"
TOOL = ROOT / "tools" / "side_env.py"


def side_envs_home() -> Path:
    """The folder holding one virtual environment per side environment (as the script)."""
    default = Path.home() / ".cache" / "agentrl_fast" / "side-envs"
    return Path(os.environ.get("AGENTRL_FAST_SIDE_ENVS", default))


def wanted_requirements(name: str) -> str:
    """What the script stores in a built environment: its reuse key (``tools/side_env.py``)."""
    spec = importlib.util.spec_from_file_location("agentrl_fast_side_env", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.key(name)


def find_side_env(name: str) -> tuple[Path | None, str]:
    """``(python, "")`` for side environment ``name`` built from the current requirements, or
    ``(None, what is wrong and the command that fixes it)``."""
    spec = SPECS / f"{name}.txt"
    if not spec.is_file():
        raise ValueError(f"no side environment named {name!r}: {spec} does not exist")
    folder = side_envs_home() / name
    python = folder / "bin" / "python"
    stored = folder / "requirements.txt"
    if not python.exists():
        problem = f"side environment {name!r} is missing ({folder})"
    elif not stored.is_file() or stored.read_text().rstrip("\n") != wanted_requirements(name):
        problem = f"side environment {name!r} is stale (its requirements changed)"
    else:
        return python, ""
    return None, f"{problem}: run `bash {SETUP} {name}`"


def side_env_python(name: str) -> Path:
    """The Python of side environment ``name``; when it is missing or stale, fails the test
    under ``CI=true`` and skips it elsewhere."""
    python, problem = find_side_env(name)
    if python is not None:
        return python
    if os.environ.get("CI") == "true":
        pytest.fail(problem)
    pytest.skip(problem)
