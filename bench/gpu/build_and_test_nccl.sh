#!/usr/bin/env bash
# Builds comm/'s NCCL backend and tests/comm/nccl_communicator_test.cc with
# CMake against this machine's Python torch (no Bazel needed), then runs the
# test on the visible GPU(s) at world size 1.
#
#   bench/gpu/build_and_test_nccl.sh            # build + run
#   PYTHON=/path/to/python BUILD_DIR=/tmp/b bench/gpu/build_and_test_nccl.sh
#   NCCL_ROOT=/opt/nccl ...                      # another NCCL than torch's
#   ST_NO_GTEST=1 ...                            # use the built-in test main even if GoogleTest exists
#
# The log goes to stdout and, when $OUT is set, to $OUT/nccl_test.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
BUILD="${BUILD_DIR:-${TMPDIR:-/tmp}/shardtrain-gpu-build}"
LOG="${OUT:+$OUT/nccl_test.log}"
LOG="${LOG:-$BUILD/nccl_test.log}"
mkdir -p "$BUILD" "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")'

TORCH_PREFIX="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
CUDA_ARGS=()
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  CUDA_ARGS=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi

echo "== configure"
cmake -S "$ROOT/bench/gpu" -B "$BUILD" ${GEN[@]+"${GEN[@]}"} -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" ${NCCL_ROOT:+-DNCCL_ROOT="$NCCL_ROOT"} ${ST_NO_GTEST:+-DST_NO_GTEST=ON} ${CUDA_ARGS[@]+"${CUDA_ARGS[@]}"}
echo "== build"
cmake --build "$BUILD" --parallel "$(nproc)"
echo "== test"
set +e
NCCL_DEBUG="${NCCL_DEBUG:-WARN}" "$BUILD/nccl_communicator_test" "$@"
rc=$?
set -e
echo "== nccl_communicator_test exit status $rc"
exit "$rc"
