#!/usr/bin/env bash
# Time the layer and model benchmarks of another source tree and of this one in one GPU session,
# alternating A, B, A, B so drift hits both alike. Results: $OUT/compare/{a,b}{1,2}_{layer,model}.json.
#   bash perf/tools/compare_trees.sh OTHER_TREE        # OTHER_TREE: e.g. `git archive <commit>` unpacked
# BENCHES picks (default "layer model"); LAYER_ARGS / MODEL_ARGS pass options (the same to both trees).
set -uo pipefail
cd "$(dirname "$0")/../.."
OTHER=$(cd "$1" && pwd)
HERE=$PWD
RES=$(mkdir -p "${OUT:-perf/tools/out}/compare" && cd "${OUT:-perf/tools/out}/compare" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
status=0

bench() {  # bench TREE TAG: the layer and model benchmarks of TREE, records to $RES/TAG_*.json
  local tree=$1 tag=$2
  (
    cd "$tree" || exit 1
    # a tree whose adapters live in ./integrations maps them into the package with a symlink
    if [ -d integrations ] && [ ! -e fusedpar/integrations ]; then ln -s ../integrations fusedpar/integrations; fi
    export PYTHONPATH="$tree"
    for b in ${BENCHES:-layer model}; do
      case $b in
        layer) timeout "${LAYER_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$NGPU" perf/bench_layer.py \
                 ${LAYER_ARGS:-} --out "$RES/${tag}_layer.json" || exit 1 ;;
        model) timeout "${MODEL_TIMEOUT:-240}" torchrun --standalone --nproc-per-node "$NGPU" perf/model_bench.py \
                 ${MODEL_ARGS:-} --out "$RES/${tag}_model.json" || exit 1 ;;
      esac
    done
  ) 2>&1 | tee "$RES/${tag}.log" | grep -E "^\||speedup|ttft|tpot|throughput|Error|error" | head -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

for round in ${ROUNDS:-1 2}; do
  bench "$OTHER" "a$round"
  bench "$HERE" "b$round"
done
echo "overall status=$status"
exit $status
