#!/usr/bin/env bash
# The GPU suite: everything a scarce GPU lease runs, in one call of at most SUITE_SECONDS (540:
# 9 minutes of a 15-minute lease, the rest for the machine's start and a rerun of a stage), in stages with their own time caps that sum to it. Headline benchmarks first,
# compiled baselines after them, then the GPU tests and the sanitizer. Every stage writes what it
# got into OUT_DIR before the next starts, so a run cut off midway keeps its finished stages.
#
#   bench/gpu_suite.sh OUT_DIR                          # on the GPU machine
#   bench/gpu_suite.sh OUT_DIR --only tests,sanitize    # rerun chosen stages (build kept)
#   bench/gpu_suite.sh OUT_DIR --device cpu --tiny      # the dry run (tests/test_gpu_suite.py)
#   bench/gpu_suite.sh --plan                           # the stages and their caps
#
# Files in OUT_DIR: summary.txt (one line per stage), preflight.txt, build.log, warm.log,
# bench.log (every benchmark's output, the tuning sweep's too), tune.md and tuned_configs.json
# (the sweep's choices, which the later stages use: commit the file as
# agentrl_fast/kernels/tuned_configs.json), rows.jsonl (every benchmark's rows; a benchmark cut off
# midway leaves its rows in <op>.jsonl), prefix_sharing.md (bench/bench_prefix_sharing.py's
# record: shared against plain packing, beside the FLOP model's ideal), tests.log, sanitize.log,
# probe.log and probe.jsonl (bench/attention_backward_probe.py --set suite: which backward
# launches, under which ptxas, give the right gradients).
# Exit status: non-zero when a stage failed or timed out. A stage whose modules the preflight
# could not import is skipped with the reason (not a failure of the suite); a stage with under
# 10 s of the suite left is skipped and counts as failed.
set -u

# name:cap (seconds), in the order they run. The caps sum to SUITE_SECONDS (a CI test checks).
# Sized on the first GPU run (bench/results/gpu_2026-12-04): the tests took 163 s with a warm
# Triton cache, the sanitizer 36 s; bench_prefix_sharing never reached its training step in 25 s.
STAGES=(preflight:15 build:70 tune:60 bench_gae:20 bench_varlen_attention:45
        bench_token_logprobs:30 bench_ppo_loss:15 bench_prefix_sharing:45 bench_compiled:25
        tests:170 sanitize:45)

plan() {
  local total=0 entry
  for entry in "${STAGES[@]}"; do
    printf '%-24s %4ss\n' "${entry%%:*}" "${entry##*:}"
    total=$(( total + ${entry##*:} ))
  done
  printf '%-24s %4ss (SUITE_SECONDS %s)\n' total "$total" "${SUITE_SECONDS:-540}"
  echo "warm_triton_cache runs in the background from the end of build (no cap of its own)"
  echo "probe_backward too, in a full run (its own cap of 300s; probe.log, probe.jsonl)"
}

usage() {
  echo "usage: $0 OUT_DIR [--device cuda|cpu] [--tiny] [--only STAGE,...] | $0 --plan" >&2
  exit 2
}

if [ "${1:-}" = --plan ]; then plan; exit 0; fi
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then usage; fi
OUT=$1
shift
DEVICE=cuda
TINY=()
ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --tiny) TINY=(--tiny); shift ;;
    --only) ONLY=${2:?--only needs a comma-separated list of stages}; shift 2 ;;
    --plan) plan; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "--device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
for name in ${ONLY//,/ }; do
  if ! printf '%s\n' "${STAGES[@]%%:*}" | grep -qx "$name"; then
    echo "--only: unknown stage $name (stages: ${STAGES[*]%%:*})" >&2
    exit 2
  fi
done

cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
FAILED=0
SUITE_SECONDS=${SUITE_SECONDS:-540}
# CAP_SCALE multiplies every cap and the suite's budget: the CPU dry run inside the test suite
# shares two cores with the tests (tests/test_gpu_suite.py sets it).
CAP_SCALE=${CAP_SCALE:-1}
DEADLINE=$(( $(date +%s) + SUITE_SECONDS * CAP_SCALE ))
: > "$OUT/summary.txt"

cap_of() {
  local entry
  for entry in "${STAGES[@]}"; do
    [ "${entry%%:*}" = "$1" ] && echo $(( ${entry##*:} * CAP_SCALE ))
  done
}

# stage NAME LOG COMMAND...: runs COMMAND under the stage's cap (cut to what is left of the
# suite), output appended to OUT/LOG, one verdict line in summary.txt.
stage() {
  local name=$1 log=$2
  shift 2
  local cap start rc left reason
  if [ -n "$ONLY" ] && [ "$name" != preflight ] && ! [[ ",$ONLY," == *",$name,"* ]]; then
    return
  fi
  reason=$(grep "^$name " "$OUT/skips.txt" 2>/dev/null | head -1 | cut -d' ' -f2-)
  if [ -n "$reason" ]; then
    echo "$name: SKIPPED ($reason)" | tee -a "$OUT/summary.txt"
    return
  fi
  cap=$(cap_of "$name")
  start=$(date +%s)
  left=$(( DEADLINE - start ))
  if [ "$left" -lt 10 ]; then
    FAILED=1
    echo "$name: SKIPPED (${left}s left of the suite's ${SUITE_SECONDS}s)" | tee -a "$OUT/summary.txt"
    return
  fi
  [ "$left" -lt "$cap" ] && cap=$left
  echo "=== $name (cap ${cap}s) ===" >> "$OUT/$log"
  if declare -F "$1" > /dev/null; then
    # A function of this script: timeout runs programs, so run it in a child bash.
    STAGE_CAP=$cap timeout --kill-after=10 "$cap" bash -c '"$@"' "$1" "$@" >> "$OUT/$log" 2>&1
  else
    timeout --kill-after=10 "$cap" "$@" >> "$OUT/$log" 2>&1
  fi
  rc=$?
  local verdict=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMED OUT after ${cap}s"; FAILED=1
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; FAILED=1; fi
  echo "$name: $verdict in $(( $(date +%s) - start ))s (log: $log)" | tee -a "$OUT/summary.txt"
}

preflight() {
  # Writes preflight.txt and skips.txt ("STAGE reason" for each stage that cannot run).
  "$PYTHON" bench/gpu_preflight.py --device "$DEVICE" --out "$OUT"
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

bench() {  # bench OP ARGS...: bench/bench_OP.py; its rows move to rows.jsonl when it ends
  local op=$1
  shift
  "$PYTHON" "bench/bench_$op.py" --device "$DEVICE" $TINY_FLAG --out "$OUT" "$@"
  local rc=$?
  if [ -f "$OUT/$op.jsonl" ]; then cat "$OUT/$op.jsonl" >> "$OUT/rows.jsonl" && rm "$OUT/$op.jsonl"; fi
  return $rc
}

tune() {
  # The tuning sweep (bench/tune_kernels.py): on the GPU its choices go to
  # agentrl_fast/kernels/tuned_configs.json, where the ops read them, so the stages after it use them.
  "$PYTHON" bench/tune_kernels.py --device "$DEVICE" $TINY_FLAG --budget $(( STAGE_CAP - 10 )) \
    --out-dir "$OUT"
  local rc=$?
  if [ -f "$OUT/tune.jsonl" ]; then cat "$OUT/tune.jsonl" >> "$OUT/rows.jsonl" && rm "$OUT/tune.jsonl"; fi
  if [ "$DEVICE" = cuda ] && [ -f agentrl_fast/kernels/tuned_configs.json ]; then cp agentrl_fast/kernels/tuned_configs.json "$OUT/"; fi
  return $rc
}

bench_compiled() {
  # Compiled baselines (torch.compile, compiled flex_attention), each beside ours in its own
  # process, after every eager headline number is in.
  local rc=0
  bench ppo_loss --only-compiled || rc=1
  bench token_logprobs --only-compiled --budget-seconds 6 || rc=1
  bench varlen_attention --skip "agentrl_fast backend" sdpa --mix long-tail --time-budget 6 || rc=1
  return $rc
}

gpu_tests() {
  # One pytest per file, the kernels' files first (-rA names every test and failure; a crash
  # that takes the CUDA context down loses one file), while the stage's time lasts.
  local rc=0 file start=$(date +%s) result files
  files=$(ls tests/test_{varlen_attention,varlen_attention_prefix,ppo_loss,token_logprobs,gae}.py; grep -l "mark.gpu" tests/test_*.py)
  files=$(echo "$files" | awk '!seen[$0]++')
  if [ "$DEVICE" = cpu ]; then files=$(echo $files); fi  # the dry run: one pytest for all
  while read -r file; do
    [ -z "$file" ] && continue
    if [ $(( $(date +%s) - start + 10 )) -gt "$STAGE_CAP" ]; then
      echo "SKIPPED $file: the stage's time is spent"; rc=1; continue
    fi
    echo "--- $file"
    "$PYTHON" -m pytest -m gpu -rA -p no:cacheprovider -o addopts="" $file
    result=$?
    if [ $result -ne 0 ] && [ $result -ne 5 ]; then rc=1; fi  # 5: no gpu test collected
  done <<< "$files"
  return $rc
}

sanitize() {
  # compute-sanitizer's memcheck, racecheck and synccheck over every kernel (small inputs), one
  # process per tool. The CPU dry run runs the script plainly.
  if [ "$DEVICE" = cpu ]; then "$PYTHON" bench/sanitize_kernels.py --device cpu; return; fi
  local tool rc=0 log
  for tool in memcheck racecheck synccheck; do
    log=$(mktemp)
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$PYTHON" bench/sanitize_kernels.py \
      > "$log" 2>&1
    local result=$?
    cat "$log"
    if grep -qiE "device not supported|unable to (find|attach)|not supported on this" "$log"; then
      echo "sanitize $tool: compute-sanitizer refused the device (see above): skipped"
    elif [ $result -ne 0 ]; then
      echo "sanitize $tool: FAILED (exit $result)"; rc=1
    else
      echo "sanitize $tool: ok"
    fi
    rm -f "$log"
  done
  return $rc
}

probe_backward() {
  # The attention backward's launches against float64 (bench/attention_backward_probe.py; its
  # rows in probe.jsonl), each in its own process, beside the stages from the end of build:
  # niced below them, 6 at a time. The dry run takes the interpreter's plumbing check (two
  # jobs), at the dry run's own priority: niced further, the tests starved it past its timeouts.
  local set=suite niceness=15
  if [ "$DEVICE" = cpu ]; then set=dry; niceness=0; export TRITON_INTERPRET=1; fi
  : > "$OUT/probe.jsonl"; : > "$OUT/probe.log"  # this run's rows only
  timeout --kill-after=10 $(( 300 * CAP_SCALE )) nice -n "$niceness" "$PYTHON" \
    bench/attention_backward_probe.py --set "$set" --workers 6 --timeout $(( 90 * CAP_SCALE )) \
    --out "$OUT/probe.jsonl" >> "$OUT/probe.log" 2>&1
  echo "probe_backward: exit $?" >> "$OUT/probe.log"
}

warm_triton_cache() {
  # Triton JIT-compiles each kernel configuration at its first launch; compiling the benchmarks'
  # and the GPU tests' configurations in parallel processes now takes that off the stages.
  timeout --kill-after=10 $(( 150 * CAP_SCALE )) nice -n 10 "$PYTHON" bench/warm_triton_cache.py \
    --device "$DEVICE" \
    >> "$OUT/warm.log" 2>&1
  echo "warm_triton_cache: exit $?" >> "$OUT/warm.log"
}

# run_stage NAME: the stage's log and command.
run_stage() {
  case "$1" in
    preflight) stage preflight preflight.txt preflight ;;
    build) stage build build.log build ;;
    tune) stage tune bench.log tune ;;
    bench_gae) stage bench_gae bench.log bench gae --max-seconds 2 ;;
    bench_varlen_attention)
      stage bench_varlen_attention bench.log bench varlen_attention --skip flex_attention \
        --time-budget 30 ;;
    bench_token_logprobs)
      stage bench_token_logprobs bench.log bench token_logprobs --no-compile --budget-seconds 22 \
        --max-seconds 2 ;;
    bench_ppo_loss) stage bench_ppo_loss bench.log bench ppo_loss --no-compile --max-seconds 2 ;;
    bench_prefix_sharing)
      # prefix-shared packing against the plain one (long prompts first; nothing new starts
      # after 30 s; the record is OUT/prefix_sharing.md, rewritten after each part)
      stage bench_prefix_sharing bench.log bench prefix_sharing --time-budget 30 \
        --max-seconds 1 --profile-ops ;;
    bench_compiled) stage bench_compiled bench.log bench_compiled ;;
    tests) stage tests tests.log gpu_tests ;;
    sanitize) stage sanitize sanitize.log sanitize ;;
    *) echo "gpu_suite: no command for stage $1" >&2; exit 2 ;;
  esac
}

export DEVICE PYTHON OUT TINY_FLAG="${TINY[*]:-}"
export -f preflight build tune bench bench_compiled gpu_tests sanitize
WARM_PID=
PROBE_PID=
for entry in "${STAGES[@]}"; do
  run_stage "${entry%%:*}"
  if [ "${entry%%:*}" = build ] && ! grep -q "^build: \(FAILED\|TIMED\)" "$OUT/summary.txt"; then
    warm_triton_cache & WARM_PID=$!
    if [ -z "$ONLY" ]; then probe_backward & PROBE_PID=$!; fi  # (a full run's only)
  fi
done
[ -n "$WARM_PID" ] && wait "$WARM_PID"  # (their own timeouts end them)
[ -n "$PROBE_PID" ] && wait "$PROBE_PID"

echo "gpu_suite: $([ $FAILED -eq 0 ] && echo all stages passed || echo SOME STAGES FAILED)" | tee -a "$OUT/summary.txt"
exit $FAILED
