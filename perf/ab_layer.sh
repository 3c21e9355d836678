#!/usr/bin/env bash
# A/B of the decoder layer in one device call: perf/bench_layer.py from git revision REV (a worktree in
# /tmp) and from this working tree, alternating per model so that drift hits both alike. Installs nothing.
#   bash perf/ab_layer.sh REV [MODEL ...]        (default models: llama70b qwen32b)
# AB_LAYER_ARGS: bench_layer.py options (default "--tokens 2048,4096 --no-graphs --no-o-scatter-ab").
# Results: $OUT (or perf/results/ab_layer/): layer_<model>_<old|new>.json / .log; prints the prefill rows.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash perf/ab_layer.sh REV [MODEL ...]"; exit 2; }
REV=$1; shift
MODELS=("$@"); [ ${#MODELS[@]} -eq 0 ] && MODELS=(llama70b qwen32b)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
RES=$(mkdir -p "${OUT:-perf/results/ab_layer}" && cd "${OUT:-perf/results/ab_layer}" && pwd)
OLD=$(mktemp -d)/old
git worktree add -f "$OLD" "$REV" >/dev/null 2>&1 || { echo "git worktree add $REV failed"; exit 1; }
trap 'git worktree remove --force "$OLD" >/dev/null 2>&1' EXIT
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
status=0
for model in "${MODELS[@]}"; do
  for tag in old new; do
    tree=$([ "$tag" = old ] && echo "$OLD" || echo "$PWD")
    echo "=== $model $tag ($tree)"
    # shellcheck disable=SC2086
    (cd "$tree" && timeout "${AB_TIMEOUT:-140}" torchrun --standalone --nproc-per-node "$NGPU" perf/bench_layer.py \
       --model "$model" ${AB_LAYER_ARGS:---tokens 2048,4096 --no-graphs --no-o-scatter-ab} \
       --out "$RES/layer_${model}_${tag}.json" 2>&1 | grep -v "torch/distributed/run.py" \
       | tee "$RES/layer_${model}_${tag}.log" | grep -i "tokens .*:\|error\|Traceback") || status=1
  done
done
exit $status
