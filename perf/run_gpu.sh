#!/usr/bin/env bash
# GPU tests and benchmarks in one device call. Installs nothing.
#   bash perf/run_gpu.sh [ITEM ...]     items: tests hf gemm one_shot gemm_all_reduce attention
#                                              qkv_all_to_all all_to_all_o_proj layer model demo profile host_cost
#                                              tune_gemm qkv_sweep pdl_probe qkv_stores launch hf_decode
#                                              hf_probe vllm_tests vllm reshard serve nccl_timeouts kv_gather
#                                              migrate_probe peer_copy
#                                              (default: all but profile, host_cost, the sweeps and probes;
#                                              those run the tools in perf/tools/)
# MODEL_ARGS / LAYER_ARGS / ATTN_ARGS / GAR_ARGS / PROFILE_ARGS pass extra arguments to perf/model_bench.py /
# perf/bench_layer.py / perf/bench_attention.py / perf/bench_gemm_all_reduce.py / perf/tools/profile_layer.py (e.g.
# MODEL_ARGS="--layers 4" for a smoke run); MODEL_TIMEOUT / LAYER_TIMEOUT / ATTN_TIMEOUT / GAR_TIMEOUT /
# PROFILE_TIMEOUT / TEST_TIMEOUT / HF_TIMEOUT their limits; TEST_PATHS narrows the GPU tests; TORCHRUN_ARGS adds torchrun
# options (per-rank logs: TORCHRUN_ARGS="--log-dir /tmp/ranks --tee 3", then copy the logs you need into $OUT:
# the device tool brings back files at most two folders below it).
# A device call lasts at most 600 s: "all" does not fit one call; pass a subset per call, e.g.
#   bash perf/run_gpu.sh tests hf          # the GPU tests; Triton compiles on the CPU, so a slow host
#                                          # needs most of TEST_TIMEOUT (520 s)
#   bash perf/run_gpu.sh qkv_all_to_all all_to_all_o_proj gemm one_shot
# Results: $OUT if set, else perf/results/ (the tools' outputs: perf/tools/out/). Each run writes
# gpu_run.log (environment, every command and its output; not committed) and one JSON per benchmark;
# `python perf/report.py` then regenerates docs/performance.md from perf/results/. The records carry
# the git commit; in a copy of the tree without .git, pass it: FUSEDPAR_COMMIT=<sha> bash perf/run_gpu.sh ...
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tree, uninstalled
RES=$(mkdir -p "${OUT:-perf/results}" && cd "${OUT:-perf/results}" && pwd)  # absolute: items may cd
TOOLS_RES=$(mkdir -p "${OUT:-perf/tools/out}" && cd "${OUT:-perf/tools/out}" && pwd)
LOG="$RES/gpu_run.log"
ITEMS=("$@")
[ ${#ITEMS[@]} -eq 0 ] && ITEMS=(tests hf gemm one_shot gemm_all_reduce attention qkv_all_to_all all_to_all_o_proj layer model demo)
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TRUN=(torchrun --standalone --nproc-per-node "$NGPU" ${TORCHRUN_ARGS:-})
status=0

run() {  # run CMD..., logging the command and its output; remember failures
  echo "+ $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "rc=$rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

{
  date -u; echo "commit: ${FUSEDPAR_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())'
  echo "GPUs: $NGPU; items: ${ITEMS[*]}"
} 2>&1 | tee -a "$LOG"

for item in "${ITEMS[@]}"; do
  case "$item" in
    # One process per GPU; single-GPU tests just run on every rank.
    # TEST_PATHS narrows the run (e.g. one file after a fix); default: every GPU test.
    tests) run timeout "${TEST_TIMEOUT:-520}" "${TRUN[@]}" -m pytest -m gpu -q -p no:cacheprovider \
             ${TEST_PATHS:-tests} ;;
    # HF adapter on NCCL: tiny random Llama/Qwen2/Qwen3 vs the unsharded model, fp32 and bf16.
    # Run from the overlay: `python -m` puts the cwd first on sys.path, where ./fusedpar would
    # shadow the overlay's fusedpar (which has .integrations); `tests` comes from PYTHONPATH.
    hf) run timeout "${HF_TIMEOUT:-300}" "${TRUN[@]}" -m tests.integrations.hf_gpu_check ;;
    # vLLM plugin on the GPU build of vLLM (installed beforehand, see docs/vllm.md): one process each
    vllm_tests) run timeout "${VLLM_TEST_TIMEOUT:-560}" python3 -m pytest -m gpu -q -rA --tb=short -p no:cacheprovider \
                  --timeout 420 tests/integrations/test_vllm_gpu.py ;;
    # a stalled and a dead NCCL peer give bounded errors (one process spawning 2 ranks on GPUs 0 and 1)
    nccl_timeouts) run timeout "${NCCL_TIMEOUT_TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rA --tb=short \
                     -p no:cacheprovider tests/collectives/test_timeouts_gpu.py ;;
    vllm) run timeout "${VLLM_TIMEOUT:-580}" python3 perf/bench_vllm.py --world "$NGPU" ${VLLM_ARGS:-} \
            --out "$RES/vllm.json" ;;
    # layout switches, KV migration, host KV tier swaps and their overlap with GEMMs (Llama-3-8B shape)
    reshard) run timeout "${RESHARD_TIMEOUT:-540}" "${TRUN[@]}" perf/bench_reshard.py ${RESHARD_ARGS:-} \
               --out "$RES/reshard.json" ;;
    # bursty-traffic serving loop, one record per layout policy (a random Llama-3-8B-shaped model); policies split
    # over calls: pass each call its own --plot (serve_timeline.png, serve_timeline_dp.png), and carry the first
    # call's serve.json into $OUT so that later records take its static tp baseline
    serve) run timeout "${SERVE_TIMEOUT:-540}" "${TRUN[@]}" perf/serve_bench.py ${SERVE_ARGS:-} --out "$RES/serve.json" ;;
    # HF generate TPOT with decode graphs vs eager (a random Llama-3-8B-shaped model)
    hf_decode) run timeout "${HF_DECODE_TIMEOUT:-400}" "${TRUN[@]}" perf/bench_hf_decode.py ${HF_DECODE_ARGS:-} \
                 --out "$RES/hf_decode.json" ;;
    # where an HF decode step's time goes with decode graphs (diagnosis, printed)
    hf_probe) run timeout "${HF_PROBE_TIMEOUT:-300}" "${TRUN[@]}" perf/tools/probe_hf_decode.py ${HF_PROBE_ARGS:-} ;;
    # host cost of a Triton launch and of each launcher (one GPU)
    launch) run timeout 120 python3 perf/tools/probe_launch.py ;;
    # KV migration's gathers / scatters: torch index ops vs a flat index vs Triton, beside a plain copy (one GPU)
    kv_gather) run timeout 120 python3 perf/tools/probe_kv_gather.py ${KV_GATHER_ARGS:-} ;;
    # copy-engine pulls from symmetric memory vs NCCL all-to-all, alone and beside row moves
    peer_copy) run timeout "${PEER_COPY_TIMEOUT:-180}" "${TRUN[@]}" perf/tools/probe_peer_copy.py ${PEER_COPY_ARGS:-} ;;
    # KV migration time per number of layer groups, and its host-side ops (printed)
    migrate_probe) run timeout "${MIGRATE_TIMEOUT:-240}" "${TRUN[@]}" perf/tools/probe_migrate.py ${MIGRATE_ARGS:-} ;;
    gemm) run timeout 150 python3 perf/bench_gemm.py --out "$RES/gemm.json" ;;
    one_shot) run timeout 120 "${TRUN[@]}" perf/bench_one_shot_all_reduce.py --out "$RES/one_shot_all_reduce.json" ;;
    gemm_all_reduce) run timeout "${GAR_TIMEOUT:-150}" "${TRUN[@]}" perf/bench_gemm_all_reduce.py ${GAR_ARGS:-} \
                       --out "$RES/gemm_all_reduce.json" ;;
    attention) run timeout "${ATTN_TIMEOUT:-240}" python3 perf/bench_attention.py ${ATTN_ARGS:-} --out "$RES/attention.json" ;;
    qkv_all_to_all) run timeout 120 "${TRUN[@]}" perf/bench_qkv_all_to_all.py --out "$RES/qkv_all_to_all.json" ;;
    # tiling sweeps behind the heuristics (printed tables; tune_gemm also writes its JSON)
    tune_gemm) run timeout "${TUNE_TIMEOUT:-300}" python3 perf/tools/tune_gemm.py ${TUNE_ARGS:-} \
                 --out "$TOOLS_RES/gemm_tune.json" ;;
    qkv_sweep) run timeout "${SWEEP_TIMEOUT:-200}" "${TRUN[@]}" perf/bench_qkv_all_to_all.py --sweep-configs \
                 ${SWEEP_ARGS:---tokens 512,1024,2048,4096} ;;
    all_to_all_o_proj) run timeout 120 "${TRUN[@]}" perf/bench_all_to_all_o_proj.py \
                         --out "$RES/all_to_all_o_proj.json" ;;
    layer) run timeout "${LAYER_TIMEOUT:-300}" "${TRUN[@]}" perf/bench_layer.py ${LAYER_ARGS:-} --out "$RES/layer.json" ;;
    # the main job on GPUs: fusedpar demo --device cuda (one process per GPU, bf16, fused kernels)
    demo) run timeout 240 python3 -m fusedpar demo --device cuda --world-size "$NGPU" ;;
    profile) run timeout "${PROFILE_TIMEOUT:-200}" "${TRUN[@]}" perf/tools/profile_layer.py ${PROFILE_ARGS:-} \
               --out "$TOOLS_RES/profile_layer.txt" ;;
    # host cost per eager call of each all-reduce / GEMM + all-reduce path (diagnosis, no records)
    host_cost) run timeout 120 "${TRUN[@]}" perf/tools/host_cost.py ${HOST_COST_ARGS:-} ;;
    # what Programmatic Dependent Launch saves per kernel boundary in a CUDA graph (one GPU)
    pdl_probe) run timeout 120 python3 perf/tools/probe_pdl.py --out "$TOOLS_RES/pdl_probe.json" ;;
    # fused qkv all-to-all vs its own GEMM: flags, remote stores and kernel structure apart (printed)
    qkv_stores) run timeout "${PROBE_TIMEOUT:-200}" "${TRUN[@]}" perf/tools/probe_qkv_stores.py ${PROBE_ARGS:-} ;;
    model) run timeout "${MODEL_TIMEOUT:-480}" "${TRUN[@]}" perf/model_bench.py ${MODEL_ARGS:-} --out "$RES/model.json" ;;
    *) echo "unknown item $item" | tee -a "$LOG"; status=1 ;;
  esac
done
echo "overall status=$status" | tee -a "$LOG"
exit $status
