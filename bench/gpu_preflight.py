"""The GPU suite's preflight: what each stage of ``bench/gpu_suite.sh`` needs, checked in seconds.

    python bench/gpu_preflight.py --device cuda --out OUT_DIR

Checks the programs (nvidia-smi, cmake, nvcc, compute-sanitizer) and imports, for each stage,
the third-party modules it needs (``STAGE_MODULES``; our own modules need the build, which comes
after). Modules the GPU image lacks come from wheels prepared on a machine with a network
(``tools/gpu_wheels.sh`` fills ``bench/wheels/``, which travels with the working tree): they are
installed from there, offline, before anything is imported.

Writes ``OUT/preflight.txt`` (the report) and ``OUT/skips.txt`` (``STAGE reason`` per stage
that cannot run: the suite skips those stages and runs the rest). Exit status 0 unless this
script itself breaks.
"""

import argparse
import importlib
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "bench" / "wheels"
WHEEL_REQUIREMENTS = ROOT / "tools" / "gpu-wheels.txt"

BENCH = ("torch", "triton", "numpy")
# Third-party modules (top-level names) each stage imports, including imports inside functions;
# tests/test_gpu_suite.py checks this against the stages' sources.
STAGE_MODULES = {
    "build": ("setuptools", "torch"),
    "tune": BENCH,
    "bench_gae": BENCH,
    "bench_varlen_attention": BENCH,
    "bench_token_logprobs": BENCH,
    "bench_ppo_loss": BENCH,
    # the main job's models and rollouts (agentrl_fast.train.run.build and what it imports)
    "bench_prefix_sharing": BENCH + ("transformers", "tokenizers", "safetensors", "yaml",
                                     "jsonschema", "tqdm", "matplotlib"),
    "bench_compiled": BENCH,
    "tests": BENCH + ("pytest", "hypothesis", "jsonschema", "transformers", "tokenizers",
                      "safetensors", "yaml", "tqdm", "matplotlib"),
    "sanitize": BENCH,
}
# Backends and baselines used only when importable (skipped with a note otherwise); httpx only
# when a VLLMGenerator is made (vLLM is not on the GPU machine); the MCP SDK's (mcp, mcp_types,
# anyio) only when an MCP tool server starts (no GPU test starts one).
OPTIONAL_MODULES = ("flash_attn", "liger_kernel", "torchrl", "httpx", "mcp", "mcp_types", "anyio")
# The scripts each stage runs: the sources tests/test_gpu_suite.py scans for STAGE_MODULES.
STAGE_SCRIPTS = {
    "build": (),
    "tune": ("bench/tune_kernels.py",),
    "bench_gae": ("bench/bench_gae.py",),
    "bench_varlen_attention": ("bench/bench_varlen_attention.py",),
    "bench_token_logprobs": ("bench/bench_token_logprobs.py",),
    "bench_ppo_loss": ("bench/bench_ppo_loss.py",),
    "bench_prefix_sharing": ("bench/bench_prefix_sharing.py",),
    "bench_compiled": ("bench/bench_ppo_loss.py", "bench/bench_token_logprobs.py",
                       "bench/bench_varlen_attention.py"),
    "tests": ("tests/conftest.py",),  # and every test file with a gpu mark: gpu_test_files()
    "sanitize": ("bench/sanitize_kernels.py",),
}
# Programs each stage needs on the GPU machine (the CPU dry run needs none of them).
STAGE_PROGRAMS = {"build": ("cmake", "nvcc"), "sanitize": ("compute-sanitizer",)}


def gpu_test_files() -> list[str]:
    return sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def stage_scripts(stage: str) -> tuple[str, ...]:
    extra = tuple(gpu_test_files()) if stage == "tests" else ()
    return STAGE_SCRIPTS[stage] + extra


def find_program(name: str) -> str | None:
    if name == "nvcc" and Path("/usr/local/cuda/bin/nvcc").exists():
        return shutil.which(name) or "/usr/local/cuda/bin/nvcc"
    return shutil.which(name)


def install_wheels(report: list[str]) -> None:
    """pip-installs, offline from bench/wheels, the requirements in tools/gpu-wheels.txt that
    are not importable here (nothing is upgraded or replaced)."""
    names = [line.split(">")[0].split("=")[0].split("<")[0].strip()
             for line in WHEEL_REQUIREMENTS.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    missing = [n for n in names if importlib.util.find_spec(n.replace("-", "_")) is None]
    if not missing:
        return
    if not WHEELS.is_dir():
        report.append(f"wheels: {', '.join(missing)} missing and no {WHEELS.relative_to(ROOT)}/ "
                      "(tools/gpu_wheels.sh prepares it)")
        return
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                             str(WHEELS), *missing], capture_output=True, text=True, timeout=60)
    verdict = "installed" if result.returncode == 0 else f"FAILED: {result.stderr[-500:]}"
    report.append(f"wheels: {', '.join(missing)} from {WHEELS.relative_to(ROOT)}/: {verdict}")
    importlib.invalidate_caches()


def check_stage(stage: str, device: str, failed_imports: dict) -> str | None:
    """Why ``stage`` cannot run, or None."""
    if device == "cuda":
        missing = [p for p in STAGE_PROGRAMS.get(stage, ()) if find_program(p) is None]
        if missing:
            return f"program(s) not found: {', '.join(missing)}"
    for name in STAGE_MODULES[stage]:
        if name not in failed_imports:
            try:
                importlib.import_module(name)
                failed_imports[name] = None
            except Exception as error:  # noqa: BLE001  (any import failure skips the stage)
                failed_imports[name] = f"{type(error).__name__}: {error}"
        if failed_imports[name]:
            return f"import of {name} failed ({failed_imports[name]})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", required=True, help="the suite's output folder")
    args = parser.parse_args()
    start, report = time.perf_counter(), []
    for program in ("nvidia-smi", "cmake", "nvcc", "compute-sanitizer", "ninja"):
        report.append(f"{program}: {find_program(program) or 'not found'}")
    if find_program("nvidia-smi") and args.device == "cuda":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        report.append(f"gpu: {smi.stdout.strip() or smi.stderr.strip()}")
    install_wheels(report)
    failed_imports: dict = {}
    skips = []
    for stage in STAGE_MODULES:
        reason = check_stage(stage, args.device, failed_imports)
        report.append(f"stage {stage}: {'ok' if reason is None else 'SKIP: ' + reason}")
        if reason is not None:
            skips.append(f"{stage} {reason}")
    if "torch" in sys.modules:
        import torch

        report.append(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda available "
                      f"{torch.cuda.is_available()}")
    report.append(f"preflight took {time.perf_counter() - start:.1f} s")
    out = Path(args.out)
    (out / "skips.txt").write_text("".join(line + "\n" for line in skips))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
