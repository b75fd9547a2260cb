#!/usr/bin/env bash
# The GPU suite: everything a scarce GPU lease runs, in one call, in stages with their own time
# caps (the whole under 5 minutes), writing at most 8 flat files into OUT_DIR as it goes, so a
# run cut off midway still leaves its finished stages.
#
#   bench/gpu_suite.sh OUT_DIR                      # on the GPU machine
#   bench/gpu_suite.sh OUT_DIR --device cpu --tiny  # CI's dry run: same stages, tiny sizes
#
# Files: summary.txt (one line per stage), env.txt, build.log, tests.log, bench.log (every
# benchmark's output), rows.jsonl (every benchmark's rows; a benchmark cut off midway leaves its
# rows in <op>.jsonl). Exit status:
# non-zero when any stage failed. Each stage's cap is also cut to what is left of SUITE_SECONDS
# (default 285: with timeout's 10 s kill grace the whole stays under 5 minutes); a stage with
# under 10 s left is skipped and counts as failed.
set -u

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 OUT_DIR [--device cuda|cpu] [--tiny]" >&2
  exit 2
fi
OUT=$1
shift
DEVICE=cuda
TINY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --tiny) TINY=(--tiny); shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "--device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac

cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
FAILED=0
SUITE_SECONDS=${SUITE_SECONDS:-285}
DEADLINE=$(( $(date +%s) + SUITE_SECONDS ))
: > "$OUT/summary.txt"

# stage NAME CAP_SECONDS LOG COMMAND...: runs COMMAND under a time cap, output to OUT/LOG.
stage() {
  local name=$1 cap=$2 log=$3
  shift 3
  local start rc left
  start=$(date +%s)
  left=$(( DEADLINE - start ))
  if [ "$left" -lt 10 ]; then
    FAILED=1
    echo "$name: SKIPPED (${left}s left of the suite's ${SUITE_SECONDS}s)" | tee -a "$OUT/summary.txt"
    return
  fi
  [ "$left" -lt "$cap" ] && cap=$left
  if declare -F "$1" > /dev/null; then
    # A function of this script: timeout runs programs, so run it in a child bash.
    timeout --kill-after=10 "$cap" bash -c "$1" >> "$OUT/$log" 2>&1
  else
    timeout --kill-after=10 "$cap" "$@" >> "$OUT/$log" 2>&1
  fi
  rc=$?
  local verdict=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMED OUT after ${cap}s"; FAILED=1
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; FAILED=1; fi
  echo "$name: $verdict in $(( $(date +%s) - start ))s (log: $log)" | tee -a "$OUT/summary.txt"
}

env_report() {
  date -u
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "device: $DEVICE $TINY_FLAG"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  command -v nvcc > /dev/null && nvcc --version | tail -1
  "$PYTHON" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda available', torch.cuda.is_available())"
}

build() {
  if [ "$DEVICE" = cpu ]; then
    # The dry run checks the installed build (CI built it just before) instead of rebuilding.
    "$PYTHON" -c "import agentrl_fast._native as n; print('installed build, cuda_built =', n.cuda_built, n.cuda_arch_list)"
    return
  fi
  MAX_JOBS=${MAX_JOBS:-16} AGENTRL_FAST_CUDA=1 "$PYTHON" -m pip install --no-build-isolation --no-deps -e . &&
    "$PYTHON" -c "
import agentrl_fast._native as n
assert n.cuda_built and n.has_kernel('gae', 'CUDA'), 'no CUDA kernel for agentrl_fast::gae'
print('CUDA kernels built for', n.cuda_arch_list)"
}

gpu_tests() {
  # On the CPU dry run every gpu-marked test is collected and skipped.
  "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests
  local rc=$?
  if [ $rc -eq 5 ]; then echo "no gpu-marked tests were collected"; return 1; fi
  return $rc
}

export DEVICE PYTHON TINY_FLAG="${TINY[*]:-}"
export -f env_report build gpu_tests
stage env 30 env.txt env_report
stage build 150 build.log build
stage tests 60 tests.log gpu_tests
# bench_stage OP CAP: runs bench/bench_OP.py; its output goes to bench.log, its rows to rows.jsonl.
bench_stage() {
  local op=$1 cap=$2
  echo "=== bench_$op ===" >> "$OUT/bench.log"
  stage "bench_$op" "$cap" bench.log "$PYTHON" "bench/bench_$op.py" --device "$DEVICE" "${TINY[@]}" --out "$OUT"
  if [ -f "$OUT/$op.jsonl" ]; then
    cat "$OUT/$op.jsonl" >> "$OUT/rows.jsonl" && rm "$OUT/$op.jsonl"
  fi
}
bench_stage gae 60
bench_stage varlen_attention 90
bench_stage token_logprobs 90
bench_stage ppo_loss 60
bench_stage rollout 90

echo "gpu_suite: $([ $FAILED -eq 0 ] && echo all stages passed || echo SOME STAGES FAILED)" | tee -a "$OUT/summary.txt"
exit $FAILED
