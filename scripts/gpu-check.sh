#!/usr/bin/env bash
# The GPU checks of secvfl, in one go, on a machine with an NVIDIA GPU (sized for an H100/H200 host with 16 cores:
# about 7 minutes, each step capped). Run from the repository root once `secvfl` is importable with a torch built
# with CUDA and $SECVFL_DATA_DIR holds mnist (and uci_credit_default, a9a for the fast suite's real-data tests):
#
#   bash scripts/gpu-check.sh [OUT_DIR]      # OUT_DIR default: $OUT, else ./gpu-check
#
# Steps (each under its own time limit; a failed step is recorded and the next one runs):
#   1. the tests marked gpu (the CUDA path against the CPU: messages, copies, host waits per step, training runs of
#      split-NN, VIMADMM, LASER-VFL, CKKS, masking and label DP, a run moved between CUDA and the CPU on resume);
#   2. `secvfl bench device`: the same training on CUDA and on 1 and on all CPU threads, with the goals;
#   3. a torch-profiler summary of a split-NN epoch on CUDA (where the time and the host waits are);
#   4. the README's fast test suite, where --device auto resolves to CUDA (in parallel when pytest-xdist is there);
#   5. `secvfl bench transport`: one single-threaded process per party over loopback gRPC + mTLS, on the CPU, with a
#      core for each process.
# Results (7 files): OUT_DIR/summary.txt (the machine, one line per step, the device bench's table and goals, the
# transport ratio), gpu-tests.log, device.json, profile.txt, fast-suite.log, transport.json, benches.log.
set -uo pipefail
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
cores=$(nproc)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
summary="$out/summary.txt"
benches="$out/benches.log"
: > "$summary"
: > "$benches"

step() {  # step NAME LIMIT_SECONDS LOG COMMAND...: run under a time limit, log everything, record the outcome
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" >> "$log" 2>&1
  local rc=$? what="ok"
  if [ $rc -eq 124 ]; then what="FAILED (over its ${limit} s limit)"; elif [ $rc -ne 0 ]; then what="FAILED (exit $rc)"; fi
  echo "$name: $what in $((SECONDS - t0)) s; log $(basename "$log")" | tee -a "$summary"
}

{
  echo "date: $(date -u +%FT%TZ); cores: $cores; $(uname -srm)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $py -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); SECVFL_DATA_DIR=${SECVFL_DATA_DIR:-unset}"
} >> "$summary" 2>&1
cat "$summary"

# 1. the gpu-marked tests
step "gpu tests" 120 "$out/gpu-tests.log" $py -m pytest -q -m gpu -p no:cacheprovider -rs --durations=10

# 2. the device bench on 8,000 MNIST training rows (the per-step cost, hence the ratios, of a full epoch)
step "bench device" 170 "$benches" secvfl bench device --dataset mnist --train-rows 8000 --epochs 2 \
  --cpu-threads 1 "$cores" --out "$out/device.json"
if [ -f "$out/device.json" ]; then
  $py scripts/gpu_check_report.py device "$out/device.json" >> "$summary" 2>&1
fi

# 3. where a CUDA epoch's time goes
step "profile" 45 "$out/profile.txt" $py scripts/gpu_check_report.py profile

# 4. the README's fast suite, where --device auto is CUDA
parallel=()
if $py -c "import xdist" 2>/dev/null; then parallel=(-n "$cores"); fi
step "fast suite (auto = CUDA)" 150 "$out/fast-suite.log" $py -m pytest -q -m "not slow" -p no:cacheprovider \
  "${parallel[@]}"
tail -n 3 "$out/fast-suite.log" | sed 's/^/  /' >> "$summary"

# 5. the multi-process transport, one single-threaded process per party, a core each
step "bench transport" 90 "$benches" secvfl bench transport --datasets mnist --repeats 2 --epochs 1 --device cpu \
  --out "$out/transport.json"
if [ -f "$out/transport.json" ]; then
  $py scripts/gpu_check_report.py transport "$out/transport.json" >> "$summary" 2>&1
fi

echo "--- summary"
cat "$summary"
