"""Bring the project's direct dependencies to what a fresh machine installs today.

``pip install -e ".[test]"`` keeps a dependency that is already satisfied, so a machine that
installed once never sees a new release; a user installing today gets the newest one. CI runs
this before the README's test command (``.ci/run``), so a release that breaks us fails CI
before it fails a user (a known-bad release is then excluded in ``pyproject.toml``).

    python tools/fresh_deps.py            # upgrade (eager: their dependencies too), then print
    python tools/fresh_deps.py --versions # only print the versions installed

pip's own configuration still applies: a constraints file that caps a package (this machine's
caps torch at the release it has on disk) is printed, so the log says what was held back.
"""

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test",)  # what the README's test command installs: .[test]
REPORTED = ("torch", "transformers", "kernels", "triton", "tokenizers", "huggingface-hub",
            "numpy", "openai", "fastapi")


def direct_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirement strings of ``[project] dependencies`` and the extras in ``EXTRAS``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(r for extra in EXTRAS for r in extras.get(extra, []))]


def constraint_files() -> list[Path]:
    """pip's constraints files: ``PIP_CONSTRAINT`` and ``constraint`` in its configuration."""
    names = os.environ.get("PIP_CONSTRAINT", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith(".constraint"):
            names += value.strip().strip("'\"").split()
    return [Path(name) for name in dict.fromkeys(names) if Path(name).is_file()]


def report_caps() -> None:
    for path in constraint_files():
        caps = [line.strip() for line in path.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
        print(f"fresh_deps: pip's constraints file {path} caps: {', '.join(caps)}")


def report_versions() -> None:
    found = []
    for package in REPORTED:
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} (not installed)")
    print(f"fresh_deps: resolved {'; '.join(found)}")


def upgrade() -> None:
    requirements = direct_requirements()
    print(f"fresh_deps: pip install --upgrade --upgrade-strategy eager {' '.join(requirements)}",
          flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--upgrade",
                    "--upgrade-strategy", "eager", *requirements], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", action="store_true", help="only print the versions")
    args = parser.parse_args(argv)
    report_caps()
    if not args.versions:
        upgrade()
    report_versions()
    return 0


if __name__ == "__main__":
    sys.exit(main())
