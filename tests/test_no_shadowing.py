"""Nothing of ours shadows another package when the project runs from its root (issue 42).

A top-level ``kernels/`` folder once made ``import kernels`` find our Triton sources instead of
Hugging Face's ``kernels`` package, which transformers imports on every model construction: with
the repository root on ``sys.path`` (``python -m pytest``, ``python -m agentrl_fast.cli``,
``torchrun -m ...``) every model failed to build. These tests run from the root, as a user does,
with Hugging Face's ``kernels`` installed (the test extra names it)."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _from_root(code: str, cwd: Path = ROOT, timeout: int = 120) -> str:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _top_level_names() -> set[str]:
    """What ``import NAME`` could find in the root: modules and regular packages."""
    names = {path.stem for path in ROOT.glob("*.py")}
    names |= {path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file()}
    return names


def test_no_top_level_name_in_the_root_belongs_to_another_distribution():
    owners = importlib.metadata.packages_distributions()
    clashes = {name: owners[name] for name in _top_level_names() - {"agentrl_fast"}
               if name in owners}
    assert not clashes, f"the repository root shadows installed packages: {clashes}"
    assert "kernels" not in _top_level_names()


def test_hugging_faces_kernels_is_theirs_from_the_root():
    theirs = importlib.metadata.distribution("kernels")  # the test extra installs it
    where = Path(_from_root("import kernels; print(kernels.__file__)").strip()).resolve()
    assert ROOT not in where.parents, where
    assert where == Path(theirs.locate_file("kernels/__init__.py")).resolve()


def test_our_kernels_are_agentrl_fast_kernels_from_the_root():
    out = _from_root("import agentrl_fast.kernels.varlen_attention as k, sys; "
                     "print(k.__file__); print('torch' in sys.modules)")
    path, torch_loaded = out.split()
    assert Path(path).resolve() == ROOT / "agentrl_fast" / "kernels" / "varlen_attention.py"
    assert torch_loaded == "False"  # the kernels import triton only


def test_a_hugging_face_model_runs_on_our_packed_attention_from_the_root():
    """transformers builds a model (its hub-kernels integration imports ``kernels``) and runs a
    packed forward through our attention, from the root as ``python -m pytest`` runs."""
    code = """
import torch
from agentrl_fast.models import pack, packed_forward, use_packed_attention
from agentrl_fast.models.tiny import tiny_qwen3

torch.manual_seed(0)
model = use_packed_attention(tiny_qwen3(64, hidden_size=32, num_layers=1))
sequences = [torch.randint(0, 64, (n,)) for n in (5, 1, 7)]
logits = packed_forward(model, *pack(sequences)).logits
alone = model(sequences[2][None]).logits[0]
assert torch.allclose(logits[0, 6:13], alone, atol=1e-5), (logits[0, 6:13] - alone).abs().max()
print("ok", model.config._attn_implementation)
"""
    assert _from_root(code).split() == ["ok", "agentrl_varlen"]


def test_the_cli_starts_as_a_module_from_the_root():
    assert "train" in _from_root("import runpy, sys; sys.argv = ['agentrl-fast', '--help'];"
                                 "runpy.run_module('agentrl_fast.cli', run_name='__main__')")


def test_a_regular_install_holds_the_kernels(tmp_path):
    """setuptools' build of the pure-Python part (what a wheel holds besides the extension):
    the kernels are ``agentrl_fast/kernels/`` and import from there."""
    build = tmp_path / "lib"
    done = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base",
                           str(tmp_path), "build_py", "--build-lib", str(build)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = build / "agentrl_fast" / "kernels"
    assert {"__init__.py", "varlen_attention.py", "tuned.py"} <= {p.name for p in kernels.iterdir()}
    out = _from_root(f"import sys; sys.path.insert(0, {str(build)!r}); "
                     "import agentrl_fast.kernels.ppo_loss as k; print(k.__file__)", cwd=tmp_path)
    assert Path(out.strip()).resolve().parent == kernels.resolve()
