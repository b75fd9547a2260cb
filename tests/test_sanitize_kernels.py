"""``bench/sanitize_kernels.py``, which the GPU suite runs under compute-sanitizer one kernel at
a time (or all but the CUDA C++ ones, ``--triton-only``): its ``--list`` names every kernel, and
``--device cpu`` (CI's dry run) runs them all on their CPU paths, in this process."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "sanitize_kernels.py"
# One name per CUDA/Triton kernel (forward and backward): what the sanitizer stages iterate over.
KERNELS = ["gae", "varlen_attention", "varlen_attention_odd_head_dim", "token_logprobs",
           "linear_token_logprobs", "ppo_loss", "value_loss", "varlen_attention_prefix"]


def load_script():
    spec = importlib.util.spec_from_file_location("sanitize_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_list_and_cpu_dry_run(capsys):
    script = load_script()
    assert script.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == KERNELS
    assert script.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == KERNELS
    assert all(": ok on cpu" in line for line in lines), lines
    assert script.main(["--device", "cpu", "--only", "ppo_loss"]) == 0
    assert capsys.readouterr().out.startswith("ppo_loss: ok on cpu")
    assert script.main(["--list", "--triton-only"]) == 0
    assert capsys.readouterr().out.split() == [name for name in KERNELS if name != "gae"]


def test_a_failing_kernel_is_reported_and_fails_the_run(capsys, monkeypatch):
    script = load_script()

    def broken(device, backend):
        raise ValueError("out of range\nsecond line")

    monkeypatch.setitem(script.KERNELS, "gae", broken)
    assert script.main(["--device", "cpu", "--only", "gae"]) == 1
    assert capsys.readouterr().out == "gae: FAILED on cpu (ValueError: out of range)\n"
