#!/usr/bin/env bash
# Build Arctic Inference 0.3.0 (the shift-parallelism vLLM plugin perf/bench_vllm.py compares against,
# case "arctic") as a cp312 wheel on a CPU machine with network, into .whl/arctic/ of the repository.
#   bash perf/tools/build_arctic_wheel.sh   (needs Python 3.12 as python3.12 or $PYTHON312, cmake >= 3.18, a C++20 compiler)
# Only its suffix-decoding extension is compiled (plain C++ via nanobind); its CUDA ops are optional and
# not built. Its setup.py imports torch for two values its C++ build does not use: a stand-in module
# answers them, so no torch is installed. On the GPU machine, next to the vLLM bundle (docs/vllm.md):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/arctic .whl/arctic/*.whl
#   python3 perf/bench_vllm.py --world 4 --cases plain,fusedpar,arctic --arctic-site /tmp/arctic
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"${PYTHON312:-python3.12}" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q setuptools wheel ninja "nanobind==2.9.2" "protobuf==5.29.6" grpcio-tools
mkdir -p "$WORK/stub/torch" "$ROOT/.whl/arctic"
printf 'class utils:\n    cmake_prefix_path = "/nonexistent"\n\n\nclass cuda:\n    is_available = staticmethod(lambda: False)\n' \
  > "$WORK/stub/torch/__init__.py"
(cd "$WORK" && PYTHONPATH="$WORK/stub" "$WORK/venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation arctic-inference==0.3.0 -d .)
PATH="$WORK/venv/bin:$PATH" PYTHONPATH="$WORK/stub" CMAKE_ARGS="-DPython_EXECUTABLE=$WORK/venv/bin/python" \
  "$WORK/venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$ROOT/.whl/arctic" "$WORK"/arctic_inference-0.3.0.tar.gz
grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
ls -la "$ROOT/.whl/arctic"
