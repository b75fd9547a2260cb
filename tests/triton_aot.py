"""Compile every shipped Triton kernel configuration for sm_90 (H100/H200) ahead of time.

Runs with no GPU and no torch (it imports only triton and ``kernels/``), so it can run under
any triton version in a side environment: ``python tests/triton_aot.py``. Each module
``kernels/<op>.py`` that ships kernels defines ``aot_specs()``, yielding dicts

    {"name": str, "fn": <@triton.jit function>, "signature": {arg: "*fp32" | "i32" | ... |
     "constexpr"}, "constexprs": {arg: value}, "num_warps": int, "num_stages": int,
     "allow_spills": bool (optional, default False)}

one per configuration the launcher can pick. For each, this prints one JSON line: name, triton
version, compile seconds, registers, spill bytes (the report of the ptxas run triton's compile
makes itself, with its own flags), shared memory, and whether the PTX uses wgmma. Exit status 1
when a configuration fails to compile or spills. Each compile gets a fresh triton cache, so each
runs ptxas.
"""

import contextlib
import importlib.util
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def ptxas_path() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def load_kernel_modules():
    """kernels/*.py loaded by path (as the package agentrl_fast.kernels would be, without torch)."""
    package = "agentrl_fast_kernels_aot"
    spec = importlib.util.spec_from_file_location(package, KERNELS / "__init__.py",
                                                  submodule_search_locations=[str(KERNELS)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    modules = []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "__init__.py":
            continue
        name = f"{package}.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def parse_ptxas_log(text: str) -> dict:
    """Registers and spill bytes from ptxas's ``-v`` report."""
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", text)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
    return {"registers": max(registers, default=None), "spill_bytes": max(spills, default=0)}


def ptxas_report(ptx: str) -> dict:
    """A ptxas run of our own on ``ptx`` (for a compile whose own report was not printed)."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run([str(ptxas_path()), "-arch=sm_90a", "-v", str(source), "-o",
                                 str(Path(folder) / "kernel.cubin")], capture_output=True, text=True)
    text = result.stdout + result.stderr
    return {"ptxas_ok": result.returncode == 0, **parse_ptxas_log(text),
            "ptxas_error": None if result.returncode == 0 else text[-2000:]}


def _compile(spec: dict):
    """``triton.compile`` for sm_90 with triton's ptxas report captured: (compiled, log)."""
    from triton import knobs

    source = ASTSource(fn=spec["fn"], signature=spec["signature"], constexprs=spec["constexprs"])
    knobs.nvidia.dump_ptxas_log = True  # triton prints its ptxas -v report after the compile
    log = io.StringIO()
    # A fresh cache, read by triton at each compile: a cached kernel would skip ptxas.
    with tempfile.TemporaryDirectory(prefix="triton_aot_") as cache, \
            contextlib.redirect_stdout(log):
        os.environ["TRITON_CACHE_DIR"] = cache
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": spec["num_warps"],
                                           "num_stages": spec["num_stages"]})
    return compiled, log.getvalue()


def compile_spec(spec: dict) -> dict:
    row = {"name": spec["name"], "triton": triton.__version__, "num_warps": spec["num_warps"],
           "num_stages": spec["num_stages"]}
    start = time.perf_counter()
    try:
        compiled, log = _compile(spec)
    except Exception as error:  # report every failure, not only the first
        row.update(ok=False, error=f"{type(error).__name__}: {str(error)[-2000:]}")
        return row
    row["compile_seconds"] = round(time.perf_counter() - start, 2)
    ptx = compiled.asm["ptx"]
    if "Used " in log:  # the compile's own ptxas run (it succeeded: triton raises otherwise)
        row.update(ptxas_ok=True, ptxas_error=None, **parse_ptxas_log(log))
    else:
        row.update(ptxas_report(ptx))
    row.update(shared_bytes=compiled.metadata.shared, wgmma="wgmma" in ptx)
    # A configuration may declare "allow_spills": True (e.g. a backward whose spills are
    # recorded in bench/results/ rather than forbidden); everything else must not spill.
    row["ok"] = row["ptxas_ok"] and (row["spill_bytes"] == 0 or bool(spec.get("allow_spills")))
    return row


SPECS: list = []  # filled before the worker processes fork


def _compile_index(index: int) -> dict:
    return compile_spec(SPECS[index])


def compile_cost(spec: dict) -> tuple:
    """A rough order of compile time (attention backward over forward, float32 over 16-bit,
    wider heads over narrower), so the slowest configurations start first instead of leaving
    one worker on a long serial tail."""
    constexprs = spec["constexprs"]
    return ("backward" in spec["name"] and "preprocess" not in spec["name"],
            "_fp32_" in spec["name"], constexprs.get("HEAD_DIM", 0))


def main() -> int:
    for module in load_kernel_modules():
        SPECS.extend(getattr(module, "aot_specs", lambda: [])())
    SPECS.sort(key=compile_cost, reverse=True)
    # Configurations compile independently: one process per core (forked, so the kernels
    # loaded above are shared).
    workers = max(1, min(len(SPECS), os.cpu_count() or 1))
    rows = []
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for row in pool.imap_unordered(_compile_index, range(len(SPECS))):
                rows.append(row)
                print(json.dumps(row), flush=True)
    else:
        for index in range(len(SPECS)):
            rows.append(_compile_index(index))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"summary": True, "triton": triton.__version__, "configurations": len(rows),
                      "failed": [r["name"] for r in rows if not r["ok"]]}))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
