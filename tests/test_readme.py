"""The README and docs/: their runnable examples run as written (each in a child process, in a
scratch directory), every relative link points to a file that exists, and the README stays a
front page (under 150 lines, linking every docs page, with the test command CI extracts)."""

import re
import textwrap
import sys
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (file, section) pairs whose ```python blocks are complete programs (other sections show
# fragments). A section runs from its "## " heading to the next "## " heading.
RUNNABLE_SECTIONS = [
    ("README.md", "## Use"),
    ("docs/ops.md", "## GAE over packed trajectories"),
    ("docs/harness.md", "## Tools, memory and trajectories"),
    ("docs/harness.md", "## Rollouts"),
    ("docs/training.md", "## The trainer"),
]

# The docs pages the README must link (issue 25), and the files whose links are checked.
DOCS_PAGES = ["design", "ops", "harness", "training", "backends", "scaling", "security",
              "integrations", "benchmarks", "migration", "experiments"]
# Every page listed here must exist (docs/experiments.md included), so a missing page fails.
LINKED_FILES = (["README.md", "CONTRIBUTING.md", "docs/README.md"]
                + [f"docs/{page}.md" for page in DOCS_PAGES])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def python_blocks(path: str, section: str) -> list[str]:
    text = (ROOT / path).read_text()
    assert section in text, f"{path} has no section starting {section!r}"
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    # A block inside a list item is indented as a whole.
    return [textwrap.dedent(block) for block in re.findall(r"```python\n(.*?)```", body, flags=re.S)]


@pytest.mark.parametrize("path, section", RUNNABLE_SECTIONS)
def test_examples_run(path, section, tmp_path):
    blocks = python_blocks(path, section)
    assert blocks, f"no python example under {section!r} in {path}"
    for code in blocks:
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, f"{path} example failed:\n{code}\n{result.stderr}"


def relative_links(path: Path, *, anchors: bool = False) -> list[str]:
    """Link targets of a markdown file that are paths in this repository (no URLs, no anchors
    alone), without their #fragment unless ``anchors``. Code blocks are skipped."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target if anchors else target.split("#", 1)[0])
    return targets


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("name", LINKED_FILES)
def test_relative_links_resolve(name):
    path = ROOT / name
    assert path.is_file(), f"{name} does not exist"
    missing = []
    for target in relative_links(path, anchors=True):
        file, _, anchor = target.partition("#")
        linked = path.parent / file
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            missing.append(target)
    assert not missing, f"{name} links to files or headings that do not exist: {missing}"


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines; keep it under 150 (move detail to docs/)"
    links = {target for target in relative_links(ROOT / "README.md")}
    unlinked = [page for page in DOCS_PAGES if f"docs/{page}.md" not in links]
    assert not unlinked, f"README.md does not link docs pages: {unlinked}"
    assert "CONTRIBUTING.md" in links
    # .ci/run runs the first ```bash block after the test-command marker (one line), and the
    # main command follows its own marker.
    after = text.split("<!-- test-command", 1)[1]
    command = re.search(r"^```bash\n(.*?)^```", after, flags=re.S | re.M).group(1).strip()
    assert command and "\n" not in command and "pytest" in command, command
    main = re.search(r"<!-- main-command -->\n```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "agentrl-fast train" in main, main
