"""Build agentrl_fast: setup.py drives CMake, which builds the native extension agentrl_fast._C.

Build against the installed torch (no build isolation):

    pip install torch && pip install --no-build-isolation -e .

AGENTRL_FAST_CUDA: unset = build the CUDA kernels when torch is a CUDA build and nvcc is found
(otherwise say why in one line and build the CPU kernels); 1 = CUDA required (any failure is
fatal); 0 = CPU only. TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: the visible
GPUs', or 9.0+PTX when none is visible). MAX_JOBS caps parallel compile jobs.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def log(message: str) -> None:
    print(f"agentrl_fast build: {message}", flush=True)


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(cuda_home) / "bin" / "nvcc"] if cuda_home else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    on_path = shutil.which("nvcc")
    return Path(on_path).resolve() if on_path else None


def cuda_archs_for_cmake(torch) -> str:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX", spaces allowed) -> CMake's "80-real;90"."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        if torch.cuda.is_available():
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            spec = ";".join(f"{major}.{minor}" for major, minor in caps)
        else:
            spec = "9.0+PTX"
    archs = []
    for item in spec.replace(" ", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        ptx = item.endswith("+PTX")
        number = item.removesuffix("+PTX").replace(".", "")
        if not number.isdigit() and not (number[:-1].isdigit() and number[-1] == "a"):
            raise SystemExit(f"TORCH_CUDA_ARCH_LIST: cannot read architecture {item!r} (expected e.g. 9.0 or 9.0+PTX)")
        archs.append(number if ptx else f"{number}-real")
    return ";".join(archs)


def decide_cuda(torch):
    """Returns (build_cuda, nvcc, reason_if_not)."""
    mode = os.environ.get("AGENTRL_FAST_CUDA", "").strip()
    if mode not in ("", "0", "1"):
        raise SystemExit(f"AGENTRL_FAST_CUDA must be unset, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, None, "AGENTRL_FAST_CUDA=0"
    nvcc = find_nvcc()
    reason = None
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU build"
    elif nvcc is None:
        reason = "nvcc not found (set CUDA_HOME to the CUDA toolkit)"
    if reason is not None:
        if mode == "1":
            raise SystemExit(f"AGENTRL_FAST_CUDA=1 but CUDA cannot be built: {reason}")
        return False, None, reason
    return True, nvcc, None


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch
        import torch.utils.cpp_extension as cpp_extension

        build_cuda, nvcc, reason = decide_cuda(torch)
        if build_cuda:
            log(f"building CPU and CUDA kernels (nvcc {nvcc})")
        else:
            log(f"building CPU kernels only, not CUDA: {reason}")

        output = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / ("cuda" if build_cuda else "cpu")
        build_dir.mkdir(parents=True, exist_ok=True)
        include_dirs = cpp_extension.include_paths(device_type="cuda" if build_cuda else "cpu")
        args = [
            f"-S{ROOT}",
            f"-B{build_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DTORCH_INCLUDE_DIRS={';'.join(include_dirs)}",
            f"-DTORCH_LIBRARY_DIR={Path(torch.__file__).parent / 'lib'}",
            f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DPYTHON_INCLUDE_DIR={sysconfig.get_paths()['include']}",
            f"-DPYTHON_EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"-DOUTPUT_DIR={output.parent}",
            f"-DAGENTRL_FAST_WITH_CUDA={'ON' if build_cuda else 'OFF'}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        if build_cuda:
            args += [
                f"-DCMAKE_CUDA_COMPILER={nvcc}",
                f"-DCUDAToolkit_ROOT={nvcc.parent.parent}",
                f"-DCMAKE_CUDA_ARCHITECTURES={cuda_archs_for_cmake(torch)}",
            ]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        cmake = shutil.which("cmake")
        if cmake is None:  # --no-build-isolation installs none of pyproject's build requirements
            raise SystemExit("agentrl_fast build failed: cmake not found on PATH "
                             "(pip install 'cmake>=3.21' ninja, or the system's package)")
        try:
            subprocess.run([cmake, *args], check=True)
            subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)
        except subprocess.CalledProcessError as error:
            if build_cuda and os.environ.get("AGENTRL_FAST_CUDA") != "1":
                # Unset mode: CUDA if possible, else a working CPU install and one line saying why.
                log(f"CUDA build failed ({error}); building CPU kernels only. "
                    "Set AGENTRL_FAST_CUDA=1 to make this fatal.")
                os.environ["AGENTRL_FAST_CUDA"] = "0"
                return self.build_extension(ext)
            raise SystemExit(f"agentrl_fast build failed: {error}") from error


setup(
    ext_modules=[Extension("agentrl_fast._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
