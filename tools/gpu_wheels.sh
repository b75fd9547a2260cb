#!/usr/bin/env bash
# Wheels for the GPU machine (no network there): the requirements in tools/gpu-wheels.txt and
# their dependencies, built for its Python (default 3.12, x86_64), into bench/wheels/ (ignored by
# git; the device call carries it: carry=["bench/wheels"]). The suite's preflight installs them.
#
#   bash tools/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
rm -rf bench/wheels
python -m pip download --quiet --only-binary=:all: --python-version "$version" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d bench/wheels -r tools/gpu-wheels.txt
ls bench/wheels
