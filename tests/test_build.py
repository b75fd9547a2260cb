"""The build: the native ops are registered with the schemas the rest of the project relies on,
the CUDA kernels are there when the build says so, and agentrl_fast/kernels/ stays free of torch."""

import subprocess
import sys
from pathlib import Path

import torch

import agentrl_fast
import agentrl_fast.ops  # noqa: F401  (registers the ops and their fakes)
from agentrl_fast import _native

ROOT = Path(__file__).resolve().parent.parent


def test_gae_ops_are_registered_with_their_schemas():
    schema = str(torch.ops.agentrl_fast.gae.default._schema)
    assert schema.startswith("agentrl_fast::gae(Tensor rewards, Tensor values, Tensor cu_seqlens")
    assert "Tensor? action_mask=None" in schema and "bool validate=True" in schema
    assert schema.endswith("-> (Tensor advantages, Tensor returns)")
    out_schema = str(torch.ops.agentrl_fast.gae_out.default._schema)
    assert "Tensor(a!) advantages" in out_schema and "Tensor(b!) returns" in out_schema


def test_cpu_kernels_are_registered():
    for op in ("gae", "gae_out"):
        assert _native.has_kernel(op, "CPU"), op


def test_cuda_kernels_match_the_build():
    # A CUDA build registers CUDA kernels for every native op; a CPU build registers none.
    for op in ("gae", "gae_out"):
        assert _native.has_kernel(op, "CUDA") == _native.cuda_built, op
    if _native.cuda_built:
        assert _native.cuda_arch_list, "a CUDA build names its architectures"


def test_fake_kernels_give_shapes_and_dtypes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        rewards = torch.empty(11, dtype=torch.bfloat16)
        values = torch.empty(11, dtype=torch.float64)
        cu = torch.empty(3, dtype=torch.int32)
        adv, ret = torch.ops.agentrl_fast.gae(rewards, values, cu)
        assert adv.shape == (11,) and adv.dtype == torch.float64 and ret.dtype == torch.float64
        adv, ret = torch.ops.agentrl_fast.gae(rewards, rewards, cu)
        assert adv.dtype == torch.float32


def test_opcheck_gae():
    # torch's own consistency checks of a custom op: schema, fake kernel, autograd registration.
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.25])
    values = torch.randn(5)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    torch.library.opcheck(torch.ops.agentrl_fast.gae.default, (rewards, values, cu),
                          {"gamma": 0.9, "lam": 0.8})


def test_kernels_package_imports_triton_only():
    # agentrl_fast/kernels/ must compile ahead of time in an environment without torch.
    # Loaded as tests/triton_aot.py loads them: a package of their own, by path.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import triton_aot\n"
        "modules = triton_aot.load_kernel_modules()\n"
        "assert len(modules) >= 4, modules\n"
        "assert 'torch' not in sys.modules, 'agentrl_fast/kernels/ imported torch'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_kernels_are_installed_as_agentrl_fast_kernels():
    import agentrl_fast.kernels.ppo_loss as ppo_loss

    assert Path(ppo_loss.__file__).resolve().parent == ROOT / "agentrl_fast" / "kernels"
    assert ppo_loss.__name__ == "agentrl_fast.kernels.ppo_loss" and callable(ppo_loss.aot_specs)


def test_version():
    assert agentrl_fast.__version__
