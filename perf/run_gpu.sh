#!/usr/bin/env bash
# The GPU tests and benchmarks, by item:   bash perf/run_gpu.sh ITEM [ITEM ...]
# perf/README.md lists the items and the environment knobs (OUT, TIMEOUT, TEST_PATHS, <ITEM>_ARGS, FUSEDPAR_COMMIT).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tree, uninstalled

# item -> command (expanded when the item runs; <ITEM>_ARGS, the item's name in upper case, is appended)
declare -A ITEMS=(
  [tests]='$TRUN -m pytest -m gpu -q -p no:cacheprovider ${TEST_PATHS:-tests}'
  [hf]='$TRUN -m tests.integrations.hf_gpu_check'
  [vllm_tests]='python3 -m pytest -m gpu -q -rA --tb=short -p no:cacheprovider --timeout 420 tests/integrations/test_vllm_gpu.py'
  [nccl_timeouts]='python3 -m pytest -m gpu -q -rA --tb=short -p no:cacheprovider tests/collectives/test_timeouts_gpu.py'
  [gemm]='python3 perf/bench_gemm.py --out "$RES/gemm.json"'
  [gemm_fp8]='python3 perf/bench_gemm.py --fp8 --out "$RES/gemm_fp8.json"'
  [attention]='python3 perf/bench_attention.py --out "$RES/attention.json"'
  [one_shot]='$TRUN perf/bench_one_shot_all_reduce.py --out "$RES/one_shot_all_reduce.json"'
  [gemm_all_reduce]='$TRUN perf/bench_gemm_all_reduce.py --out "$RES/gemm_all_reduce.json"'
  [qkv_all_to_all]='$TRUN perf/bench_qkv_all_to_all.py --out "$RES/qkv_all_to_all.json"'
  [all_to_all_o_proj]='$TRUN perf/bench_all_to_all_o_proj.py --out "$RES/all_to_all_o_proj.json"'
  [layer]='$TRUN perf/bench_layer.py --out "$RES/layer.json"'
  [model]='$TRUN perf/model_bench.py --out "$RES/model.json"'
  [decode]='$TRUN perf/bench_decode.py --out "$RES/decode.json"'
  [hf_decode]='$TRUN perf/bench_hf_decode.py --out "$RES/hf_decode.json"'
  [reshard]='$TRUN perf/bench_reshard.py --out "$RES/reshard.json"'
  [serve]='$TRUN perf/serve_bench.py --out "$RES/serve.json"'
  [vllm]='python3 perf/bench_vllm.py --world "$NGPU" --out "$RES/vllm.json"'
  [vllm_serve]='python3 perf/bench_vllm_serve.py --world "$NGPU" --out "$RES/vllm_serve.json"'
  [tune_gemm]='python3 perf/tools/tune_gemm.py --out "${OUT:-perf/tools/out}/gemm_tune.json"'
  [gemv]='python3 perf/tools/bench_gemv.py --out "${OUT:-perf/tools/out}/gemv.json"'
  [gemv_sweep]='python3 perf/tools/bench_gemv.py --sweep --out "${OUT:-perf/tools/out}/gemv_sweep.json"'
  [qkv_sweep]='$TRUN perf/bench_qkv_all_to_all.py --sweep-configs --tokens 512,1024,2048,4096'
)

unknown=()
for item in "$@"; do [ -n "${ITEMS[$item]+set}" ] || unknown+=("$item"); done
if [ $# -eq 0 ] || [ ${#unknown[@]} -gt 0 ]; then  # nothing runs
  [ ${#unknown[@]} -eq 0 ] || echo "unknown items: ${unknown[*]}" >&2
  echo "usage: bash perf/run_gpu.sh ITEM [ITEM ...]; items: $(printf '%s\n' "${!ITEMS[@]}" | sort | xargs)" >&2
  exit 2
fi
RES=$(mkdir -p "${OUT:-perf/results}" && cd "${OUT:-perf/results}" && pwd)  # absolute: items may cd
LOG="$RES/gpu_run.log"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TRUN="torchrun --standalone --nproc-per-node $NGPU"
{
  date -u; echo "commit: ${FUSEDPAR_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())'
  echo "GPUs: $NGPU; items: $*"
} 2>&1 | tee -a "$LOG"

status=0
for item in "$@"; do
  args="${item^^}_ARGS"
  eval "cmd=(${ITEMS[$item]} ${!args:-})"
  echo "+ ${cmd[*]}" | tee -a "$LOG"
  timeout "${TIMEOUT:-0}" "${cmd[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "rc=$rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
done
echo "overall status=$status" | tee -a "$LOG"
exit $status
