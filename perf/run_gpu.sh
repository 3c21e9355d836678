#!/usr/bin/env bash
# One device call does it all: GPU tests, then the benchmarks. Installs nothing.
#   bash perf/run_gpu.sh [tests|bench|all]      (default all)
# Results: $OUT if set (the device tool brings it back), else perf/results/. At most 8 files:
#   gpu_run.log (environment + every command + its output) and one JSON per benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RES=${OUT:-perf/results}
mkdir -p "$RES"
LOG="$RES/gpu_run.log"
WHAT=${1:-all}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
status=0

run() {  # run CMD..., logging the command and its output; remember failures
  echo "+ $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "rc=$rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())'
  echo "GPUs: $NGPU"
} 2>&1 | tee -a "$LOG"

if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  # One process per GPU; single-GPU tests just run on every rank.
  run timeout "${TEST_TIMEOUT:-240}" torchrun --standalone --nproc-per-node "$NGPU" -m pytest -m gpu -q \
    -p no:cacheprovider --ignore=tests/integrations tests
fi

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  # A device call lasts at most 600 s: keep the sum of these timeouts under that.
  [ -f perf/bench_gemm.py ] && run timeout 150 python3 perf/bench_gemm.py --out "$RES/gemm.json"
  [ -f perf/bench_one_shot_all_reduce.py ] && run timeout 120 torchrun --standalone --nproc-per-node "$NGPU" \
    perf/bench_one_shot_all_reduce.py --out "$RES/one_shot_all_reduce.json"
fi
echo "overall status=$status" | tee -a "$LOG"
exit $status
