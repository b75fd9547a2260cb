"""Compile every shipped Triton kernel configuration for sm_90 (H100/H200) ahead of time, with
the specialisation a launch on the GPU gets.

Runs with no GPU and no torch (it imports only triton and ``agentrl_fast/kernels/``), so it can run under
any triton version in a side environment: ``python tests/triton_aot.py``. Each module
``agentrl_fast/kernels/<op>.py`` that ships kernels defines ``aot_specs()``, yielding dicts

    {"name": str, "fn": <@triton.jit function>, "signature": {arg: "*fp32" | "i32" | ... |
     "constexpr"}, "constexprs": {arg: value}, "num_warps": int, "num_stages": int,
     "allow_spills": bool (optional, default False),
     "sample": bool (optional, default True: False leaves it out of ``--sample``, CI's run),
     "tuning": (op, key) (optional: agentrl_fast/kernels/tuned.py's name of its launch, whose tuned
               configurations are compiled too),
     "hints": {"divisible_by_16": [int arg, ...], "equal_to_1": [int arg, ...]} (optional)}

one per configuration the launcher can pick, plus those the tuning sweep
(``bench/tune_kernels.py``, loaded by path: no torch) may choose: the ones it wrote
(``tuning``) and its ``EXTRA`` candidates. Launch hints: triton's launcher specialises every
pointer and integer argument on its value (``tt.divisibility = 16`` when divisible by 16, the
constant 1 for an integer equal to 1), and the compile it makes depends on it (vectorised and
``cp.async`` loads need aligned addresses). Each compile here gets the specialisation of a
typical launch: every pointer divisible by 16 (torch's allocations are), plus the integer
arguments the spec's ``hints`` names (default: none; each spec says why). One compile per
configuration: other specialisations of the same configuration are not compiled.

For each configuration this prints one JSON line: name, triton version, compile seconds,
registers and spill bytes (the ptxas run of triton's own compile), shared memory, and counts in
the PTX (``cp_async``, ``tma``, ``wgmma`` with its shapes, ``local_in_loops``: see
``ptx_counts``), with ``ok`` false and a ``reason`` when it fails to compile, its hints do not
reach the compile, it spills where the spec does not allow it or it needs more shared memory
than an sm_90 block may have (``failure_reasons``). Exit status 1 when any fails. Each compile
gets a fresh triton cache, so each runs ptxas. ``python tests/triton_aot.py NAME ...`` compiles
only the configurations named (spot checks); ``--sample`` (CI) leaves out the specs marked
``"sample": False`` (the prefix-shared kernels' cold configurations: the same bodies and helpers
as their sampled ones, a quarter of the CPU time).
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

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "agentrl_fast" / "kernels"
TARGET = GPUTarget("cuda", 90, 32)
# Shared memory one block may use on sm_90 (H100/H200), opted in: 227 KB.
SM90_SHARED_BYTES = 232448
INTEGER_TYPES = ("i32", "i64", "u32", "u64")


def ptxas_path() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def load_kernel_modules():
    """agentrl_fast/kernels/*.py loaded by path (as the package agentrl_fast.kernels would be, without torch)."""
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
        if name not in sys.modules:  # not already loaded by another's relative import
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        modules.append(sys.modules[name])
    return modules


# ---------------------------------------------------------------------------------------------
# Launch hints.

def launch_hints(spec: dict) -> dict:
    """The spec's ``hints`` with defaults, checked: each name an integer argument."""
    hints = spec.get("hints", {})
    unknown = set(hints) - {"divisible_by_16", "equal_to_1"}
    if unknown:
        raise ValueError(f"{spec['name']}: unknown hints {sorted(unknown)}")
    hints = {key: list(hints.get(key, ())) for key in ("divisible_by_16", "equal_to_1")}
    for name in hints["divisible_by_16"] + hints["equal_to_1"]:
        if spec["signature"].get(name) not in INTEGER_TYPES:
            raise ValueError(f"{spec['name']}: hint on {name!r}, which is not an integer "
                             f"argument ({spec['signature'].get(name)})")
    return hints


def divisibility_attr() -> list:
    """The attribute list triton's launcher gives an argument divisible by 16 (the backend's
    own ``parse_attr``, so the format is the installed triton's: ``[["tt.divisibility", 16]]``
    under 3.6 and 3.8, keyed by the argument's path ``(index,)`` in ``ASTSource(attrs=...)``)."""
    from triton.compiler.compiler import make_backend

    return make_backend(TARGET).parse_attr("D")


def hinted_source(spec: dict) -> ASTSource:
    """``ASTSource`` of ``spec`` specialised as a launch with its hints: every pointer and each
    ``divisible_by_16`` integer gets the divisibility attribute, each ``equal_to_1`` integer
    becomes the constant 1 (its signature entry ``constexpr``, as the launcher makes it)."""
    hints = launch_hints(spec)
    signature, constexprs = dict(spec["signature"]), dict(spec["constexprs"])
    for name in hints["equal_to_1"]:
        signature[name], constexprs[name] = "constexpr", 1
    divisible = [name for name, kind in signature.items() if kind.startswith("*")]
    divisible += hints["divisible_by_16"]
    arg_names = spec["fn"].arg_names
    attr = divisibility_attr()
    attrs = {(arg_names.index(name),): attr for name in divisible}
    return ASTSource(fn=spec["fn"], signature=signature, constexprs=constexprs, attrs=attrs)


# ---------------------------------------------------------------------------------------------
# Reading ptxas's report and the PTX.

def parse_ptxas_log(text: str) -> dict:
    """Registers and spill bytes from ptxas's ``-v`` report."""
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", text)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
    return {"registers": max(registers, default=None), "spill_bytes": max(spills, default=0)}


def ptx_instructions(ptx: str) -> list[str]:
    """The PTX's lines without comments and blank lines (labels kept)."""
    lines = (line.split("//", 1)[0].strip() for line in ptx.splitlines())
    return [line for line in lines if line]


def loop_lines(lines: list[str]) -> set[int]:
    """Indices of the lines inside a loop body. Heuristic: a loop is a label and a later branch
    back to it (``$L__BB0_3:`` ... ``@%p7 bra $L__BB0_3;``), which is how LLVM lays out every
    loop in PTX; its body is the lines in between. Nested loops overlap; the union counts once."""
    labels = {}
    inside = set()
    for index, line in enumerate(lines):
        label = re.fullmatch(r"(\$?[\w$.]+):", line)
        if label:
            labels[label.group(1)] = index
            continue
        branch = re.search(r"\bbra(?:\.uni)?\s+(\$?[\w$.]+)\s*;", line)
        if branch and branch.group(1) in labels:  # a label already seen: a backward branch
            inside.update(range(labels[branch.group(1)] + 1, index))
    return inside


def ptx_counts(ptx: str) -> dict:
    """Instruction counts in the PTX (static, after unrolling): ``cp_async`` (Ampere-style
    asynchronous copies, ``cp.async.ca``/``.cg``), ``tma`` (``cp.async.bulk.tensor``),
    ``wgmma_count`` and ``wgmma_shapes`` (``wgmma.mma_async`` and its ``mMnNkK`` shapes), and
    ``local_in_loops``: ``ld.local``/``st.local`` inside a loop body (``loop_lines``), local
    memory traffic that the PTX already has before ptxas (ptxas's own spills are
    ``spill_bytes``)."""
    lines = ptx_instructions(ptx)
    in_loop = loop_lines(lines)
    wgmma = [line for line in lines if re.search(r"\bwgmma\.mma_async\b", line)]
    shapes = {shape for line in wgmma for shape in re.findall(r"\.(m\d+n\d+k\d+)\b", line)}
    return {
        "cp_async": sum(bool(re.search(r"\bcp\.async\.c[ag]\b", line)) for line in lines),
        "tma": sum(bool(re.search(r"\bcp\.async\.bulk\.tensor\b", line)) for line in lines),
        "wgmma": bool(wgmma), "wgmma_count": len(wgmma),
        "wgmma_shapes": sorted(shapes, key=lambda s: [int(n) for n in re.findall(r"\d+", s)]),
        "local_in_loops": sum(bool(re.search(r"\b(?:ld|st)\.local\b", lines[i]))
                              for i in in_loop),
    }


def divisible_arguments(ttir: str) -> int:
    """How many arguments of the kernel's entry function carry ``tt.divisibility`` in the TTIR:
    the launch hints that reached the compile (a format triton does not read is dropped
    silently)."""
    match = re.search(r"tt\.func public @[\w$.]+\((.*?)\)\s*(?:attributes|\{)", ttir, re.S)
    return match.group(1).count("tt.divisibility") if match else 0


def narrow_mma_stores(ttgir: str) -> list[str]:
    """The wgmma results stored to shared memory with a swizzle under 128 bytes (a
    ``ttg.local_alloc`` from a version-3 ``nvidia_mma`` layout into an ``nvmma_shared`` one
    swizzled by 32 or 64 bytes: an N of 16 or 32 in 16-bit types), as ``"128x32 swizzle 64"``.
    Every launch that gave a wrong dq (D 128 and 256) or an illegal memory access (D 64 at
    STEP 16) on the H200 under triton 3.6 had one, and none of the right ones did (though every
    wrong one also had 8 warps; docs/experiments.md, session 27): a shipped configuration
    must have none."""
    mma = set(re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3\b", ttgir, re.M))
    swizzle = dict(re.findall(r"^(#shared\d*) = #ttg\.nvmma_shared<\{swizzlingByteWidth = (\d+)",
                              ttgir, re.M))
    stores = re.findall(r"ttg\.local_alloc %[\w.#]+ : \(tensor<([\dx]+)x\w+, (#mma\d*)>\) -> "
                        r"!ttg\.memdesc<[\dx]+x\w+, (#shared\d*)", ttgir)
    return [f"{shape} swizzle {swizzle[shared]}" for shape, layout, shared in stores
            if layout in mma and shared in swizzle and int(swizzle[shared]) < 128]


def failure_reasons(row: dict, allow_spills: bool) -> list[str]:
    """Why a compiled configuration fails: the launch hints did not reach the compile, ptxas
    failed, it spills where the spec does not allow it, or it needs more shared memory than an
    sm_90 block may have (the launch would raise ``OutOfResources``)."""
    reasons = []
    if row.get("divisible_args") != row.get("hinted_args"):
        reasons.append(f"{row.get('divisible_args')} arguments divisible by 16 in the TTIR, "
                       f"{row.get('hinted_args')} hinted")
    if not row["ptxas_ok"]:
        reasons.append("ptxas failed")
    if row.get("spill_bytes") and not allow_spills:
        reasons.append(f"spills {row['spill_bytes']} bytes (the spec does not allow spills)")
    if row.get("narrow_mma_stores"):
        reasons.append("stores a wgmma result to shared memory with a narrow swizzle ("
                       + ", ".join(row["narrow_mma_stores"]) + "): the store every wrong or "
                       "crashing H200 launch had under triton 3.6 (narrow_mma_stores)")
    if row.get("shared_bytes", 0) > SM90_SHARED_BYTES:
        reasons.append(f"needs {row['shared_bytes']} bytes of shared memory, over the sm_90 "
                       f"limit of {SM90_SHARED_BYTES}")
    return reasons


# ---------------------------------------------------------------------------------------------
# Compiling.

def ptxas_report(ptx: str) -> dict:
    """A ptxas run of our own on ``ptx`` (for a compile whose own report was not printed)."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run([str(ptxas_path()), "-arch=sm_90a", "-v", str(source), "-o",
                                 str(Path(folder) / "kernel.cubin")],
                                capture_output=True, text=True)
    text = result.stdout + result.stderr
    return {"ptxas_ok": result.returncode == 0, **parse_ptxas_log(text),
            "ptxas_error": None if result.returncode == 0 else text[-2000:]}


def _compile(source: ASTSource, spec: dict):
    """``triton.compile`` for sm_90 with triton's ptxas report captured: (compiled, log)."""
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # triton prints its ptxas -v report after the compile
    log = io.StringIO()
    # A fresh cache, read by triton at each compile: a cached kernel would skip ptxas.
    with tempfile.TemporaryDirectory(prefix="triton_aot_") as cache, \
            contextlib.redirect_stdout(log):
        os.environ["TRITON_CACHE_DIR"] = cache
        compiled = triton.compile(source, target=TARGET,
                                  options={"num_warps": spec["num_warps"],
                                           "num_stages": spec["num_stages"]})
    return compiled, log.getvalue()


def compile_spec(spec: dict) -> dict:
    row = {"name": spec["name"], "kernel": spec["fn"].__name__, "triton": triton.__version__,
           "num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
           "allow_spills": bool(spec.get("allow_spills"))}
    start = time.perf_counter()
    try:
        row["hints"] = launch_hints(spec)
        source = hinted_source(spec)
        compiled, log = _compile(source, spec)
    except Exception as error:  # report every failure, not only the first
        message = f"{type(error).__name__}: {str(error)[-2000:]}"
        row.update(ok=False, error=message, reason=f"compile failed: {message[:200]}")
        return row
    row["compile_seconds"] = round(time.perf_counter() - start, 2)
    ptx = compiled.asm["ptx"]
    if "Used " in log:  # the compile's own ptxas run (it succeeded: triton raises otherwise)
        row.update(ptxas_ok=True, ptxas_error=None, **parse_ptxas_log(log))
    else:
        row.update(ptxas_report(ptx))
    row.update(shared_bytes=compiled.metadata.shared, hinted_args=len(source.attrs),
               divisible_args=divisible_arguments(compiled.asm["ttir"]),
               narrow_mma_stores=narrow_mma_stores(compiled.asm["ttgir"]), **ptx_counts(ptx))
    # A configuration may declare "allow_spills": True (e.g. a backward whose spills are
    # recorded in bench/results/ rather than forbidden); everything else must not spill.
    reasons = failure_reasons(row, row["allow_spills"])
    row.update(ok=not reasons, reason="; ".join(reasons) or None)
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


def _variant(spec: dict, config: dict, name: str) -> dict | None:
    """``spec`` with ``config``'s ``num_warps`` / ``num_stages`` and its other entries as the
    constexprs of the same name; None when ``config`` names anything else (not a configuration
    of this kernel) or changes nothing."""
    if not set(config) <= set(spec["constexprs"]) | {"num_warps", "num_stages"}:
        return None
    variant = dict(spec, name=name, constexprs={**spec["constexprs"],
                                                **{k: v for k, v in config.items()
                                                   if k in spec["constexprs"]}})
    variant.update({k: config[k] for k in ("num_warps", "num_stages") if k in config})
    if variant["constexprs"] == spec["constexprs"] and all(
            variant[k] == spec[k] for k in ("num_warps", "num_stages")):
        return None
    return variant


def with_tuned_variants(specs: list[dict], tuned) -> list[dict]:
    """``specs`` plus, for each spec with a ``tuning`` key ``(op, key)``, one spec per
    configuration the tuning sweep wrote for it (``agentrl_fast/kernels/tuned.py``, any GPU): the launcher
    may pick those too. A tuned config's ``num_warps`` / ``num_stages`` replace the spec's, its
    other entries the constexprs of the same name; one without ``num_warps`` (every sweep's
    has it) or naming anything else is ignored."""
    out = list(specs)
    for spec in specs:
        if "tuning" not in spec:
            continue
        for index, config in enumerate(tuned.tuned_variants(*spec["tuning"])):
            if "num_warps" not in config:
                continue  # not a configuration of this kernel (a stale sweep)
            variant = _variant(spec, config, f"{spec['name']}_tuned{index}")
            if variant is not None:
                out.append(variant)
    return out


def sweep_extras() -> dict:
    """``EXTRA`` of ``bench/tune_kernels.py`` (the sweep's candidates that move several
    parameters at once, ``{(op, key): (partial config, ...)}``), loaded by path: it imports no
    torch at module level."""
    path = ROOT / "bench" / "tune_kernels.py"
    spec = importlib.util.spec_from_file_location("agentrl_fast_tune_kernels_aot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXTRA


def with_sweep_extras(specs: list[dict], extras: dict) -> list[dict]:
    """``specs`` plus one spec per ``extras`` configuration of a launch ``(op, key)``, for the
    spec named ``<op>_<key>`` (the launch the sweep times, e.g. the dk/dv kernel with the
    atomic dq at an even head dim), named ``<op>_<key>_sweep<i>``; each keeps the spec's
    ``allow_spills``, so a sweep candidate of a hot launch must compile without spills."""
    out = list(specs)
    for spec in specs:
        if "tuning" not in spec or spec["name"] != "_".join(spec["tuning"]):
            continue
        for index, config in enumerate(extras.get(tuple(spec["tuning"]), ())):
            variant = _variant(spec, config, f"{spec['name']}_sweep{index}")
            if variant is not None:
                out.append(variant)
    return out


def main() -> int:
    modules = load_kernel_modules()
    for module in modules:
        SPECS.extend(getattr(module, "aot_specs", lambda: [])())
    tuned = next(m for m in modules if m.__name__.endswith(".tuned"))
    SPECS[:] = with_sweep_extras(with_tuned_variants(SPECS, tuned), sweep_extras())
    only = [a for a in sys.argv[1:] if a != "--sample"]  # optional: names (spot checks)
    if only:
        SPECS[:] = [spec for spec in SPECS if spec["name"] in only]
    if "--sample" in sys.argv[1:]:  # CI's: a spec with "sample": False is left out
        SPECS[:] = [spec for spec in SPECS if spec.get("sample", True)]
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
