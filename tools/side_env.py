"""Side environments' two rules, in one place for ``tools/setup_test_env.sh`` (which builds them)
and ``tests/side_envs.py`` (which finds them): what a built environment must match to be reused,
and how one sees the main environment's packages.

A side environment is ``tools/side-envs/NAME.txt`` (pip requirements) and an optional
``NAME.post.sh``. A line ``# sees-main-environment`` in ``NAME.txt`` makes it see the packages of
the main environment (the interpreter that runs this script: a virtual environment or not), so
torch, transformers and agentrl_fast are the project's own. ``python -m venv
--system-site-packages`` cannot do that inside a virtual environment: it sees the *base*
interpreter's packages, where pip would then install a second torch. Instead a ``.pth`` file
in the side environment adds the main environment's site folders (their own ``.pth`` files, an
editable install's included) after its own.

Its reuse key (``key``) is the requirements and the post script, and for an environment that
sees the main one also the main environment's prefix and torch / transformers versions: a new
torch in the main environment rebuilds what was built against the old one.

    python tools/side_env.py key NAME          # the key the built environment must store
    python tools/side_env.py link SITEDIR      # write the .pth into a new environment's SITEDIR
"""

import importlib.metadata
import site
import sys
from pathlib import Path

SPECS = Path(__file__).resolve().parent / "side-envs"
MARKER = "# sees-main-environment"
SHARED_PACKAGES = ("torch", "transformers")  # what must stay the main environment's
LINK_FILE = "agentrl_fast_main_environment.pth"


def sees_main_environment(name: str) -> bool:
    return MARKER in (SPECS / f"{name}.txt").read_text().splitlines()


def key(name: str) -> str:
    """What a built side environment ``name`` stores and is compared with (trailing newlines
    dropped)."""
    post = SPECS / f"{name}.post.sh"
    text = (SPECS / f"{name}.txt").read_text() + (post.read_text() if post.is_file() else "")
    text = text.rstrip("\n")
    if sees_main_environment(name):
        versions = " ".join(f"{package}=={_version(package)}" for package in SHARED_PACKAGES)
        text += f"\n# main environment: {sys.prefix} {versions}"
    return text


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def link(site_dir: Path) -> Path:
    """Writes the ``.pth`` into a side environment's ``site_dir`` that adds this interpreter's
    site folders (processed as site folders: their ``.pth`` files run too)."""
    folders = [folder for folder in site.getsitepackages() if Path(folder).is_dir()]
    # One line (a .pth runs lines that start with "import"); no comprehension: its scope would
    # not see the name imported in the exec.
    line = f"import site; list(map(site.addsitedir, {folders!r}))\n"
    path = Path(site_dir) / LINK_FILE
    path.write_text(line)
    return path


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "key":
        print(key(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "link":
        print(link(Path(argv[1])))
        return 0
    print("usage: python tools/side_env.py key NAME | link SITEDIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
