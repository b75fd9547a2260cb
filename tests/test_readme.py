"""The README's runnable examples run as written (in a child process, in a scratch directory)."""

import re
import sys
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Sections whose ```python blocks are complete programs (the op sections show fragments).
RUNNABLE_SECTIONS = ["## The harness", "## Training"]


def python_blocks(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    assert section in text, f"README has no section starting {section!r}"
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


@pytest.mark.parametrize("section", RUNNABLE_SECTIONS)
def test_readme_examples_run(section, tmp_path):
    blocks = python_blocks(section)
    assert blocks, f"no python example under {section!r}"
    for code in blocks:
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, f"README example failed:\n{code}\n{result.stderr}"
