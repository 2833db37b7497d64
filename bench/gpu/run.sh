#!/usr/bin/env bash
# ShardTrain vs Python PyTorch FSDP2 on ONE NVIDIA GPU, no Bazel needed.
#
# Builds bench/gpu/gpt_gpu_bench with CMake against this machine's Python
# torch (and the NCCL that torch uses), then trains the same ~1.02B-parameter
# GPT (24 layers, d=1792, 16 heads, sequence 1024, vocab 50304) at world size 1
# in bf16 through
#   - ShardTrain: sharding::ShardedModel FULL_SHARD, one unit per block, NCCL;
#   - PyTorch:    FSDP2 fully_shard per block + root (bench/gpu/torch_fsdp_gpu.py);
# and writes median step time, tokens/s, TFLOP/s, MFU (over 989 TFLOP/s, the
# H100/H200 SXM dense bf16 peak) and peak GPU memory as a markdown table to
# $OUT/gpu_benchmark.md (bench/gpu/gpu_benchmark.md when $OUT is unset), with
# the raw JSON lines (gpu_benchmark.jsonl) and the full log (gpu_benchmark.log).
# About 3-4 minutes on an H200 (most of it the build).
#
#   bench/gpu/run.sh
#   BATCH=8 STEPS=20 CHECKPOINT=both bench/gpu/run.sh
#
# Settings (environment):
#   PYTHON=python3       the Python whose torch (with CUDA) is built against and benchmarked
#   BUILD_DIR=/tmp/shardtrain-gpu-build   CMake build directory (shared with build_and_test_nccl.sh)
#   BATCH=16 STEPS=10 WARMUP=3            sequences per step, timed steps, untimed warmup steps
#   N_LAYER=24 N_EMBD=1792 N_HEAD=16 BLOCK=1024 VOCAB=50304   model size
#   CHECKPOINT=0|1|both  activation checkpointing off (default), on, or both rows
#   PEAK_TFLOPS=989      GPU peak for MFU (dense bf16)
#   RUN_TIMEOUT=300      seconds allowed per run
#   NCCL_ROOT=...        another NCCL than torch's
#   BUILD_ONLY=1         configure and build only (works without a GPU)
#   CPU_SMOKE=1          check this script without a GPU: tiny model on the CPU (in-process
#                        communicator / Gloo); the numbers mean nothing
# Exit status: 0 all runs succeeded, 1 a run failed, 2 no GPU / no CUDA torch / missing tool.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python || true)}"
BUILD="${BUILD_DIR:-${TMPDIR:-/tmp}/shardtrain-gpu-build}"
RESULTS="${OUT:-$ROOT/bench/gpu}"
SMOKE="${CPU_SMOKE:-0}"
if [[ "$SMOKE" == 1 ]]; then
  : "${N_LAYER:=2}" "${N_EMBD:=64}" "${N_HEAD:=4}" "${BLOCK:=32}" "${VOCAB:=96}"
  : "${BATCH:=4}" "${STEPS:=3}" "${WARMUP:=1}"
fi
BATCH="${BATCH:-16}" STEPS="${STEPS:-10}" WARMUP="${WARMUP:-3}"
N_LAYER="${N_LAYER:-24}" N_EMBD="${N_EMBD:-1792}" N_HEAD="${N_HEAD:-16}" BLOCK="${BLOCK:-1024}" VOCAB="${VOCAB:-50304}"
CHECKPOINT="${CHECKPOINT:-0}" PEAK_TFLOPS="${PEAK_TFLOPS:-989}" RUN_TIMEOUT="${RUN_TIMEOUT:-300}"
mkdir -p "$BUILD" "$RESULTS"
LOG="$RESULTS/gpu_benchmark.log"
JSONL="$RESULTS/gpu_benchmark.jsonl"
exec > >(tee "$LOG") 2>&1
T_START=$SECONDS

die() {
  echo "run.sh: error: $2" >&2
  exit "$1"
}

echo "== machine"
[[ -n "$PY" ]] || die 2 "no python3/python on PATH; set PYTHON=/path/to/python (with torch installed)"
GPU_SMI="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  head -n1 || true)"
echo "nvidia-smi: ${GPU_SMI:-(none)}"
TORCH_INFO="$("$PY" - <<'EOF' 2>&1
import torch
cuda = torch.version.cuda
n = torch.cuda.device_count() if cuda else 0
ok = cuda is not None and torch.cuda.is_available() and n > 0
nccl = ".".join(map(str, torch.cuda.nccl.version())) if ok else "-"
name = torch.cuda.get_device_name(0) if ok else "-"
print(f"torch {torch.__version__} cuda {cuda} gpus {n} nccl {nccl} gpu0 {name}")
print("STATUS", "ok" if ok else ("nocudatorch" if cuda is None else "nogpu"))
EOF
)" || die 2 "cannot import torch with $PY: $TORCH_INFO"
echo "$TORCH_INFO" | grep -v '^STATUS'
TORCH_STATUS="$(echo "$TORCH_INFO" | sed -n 's/^STATUS //p')"
if [[ "$TORCH_STATUS" == nocudatorch ]]; then
  die 2 "$PY's torch is built without CUDA; install the CUDA build of torch (e.g. torch 2.11 for CUDA 13)"
fi
if [[ "$TORCH_STATUS" != ok && "$SMOKE" != 1 && "${BUILD_ONLY:-0}" != 1 ]]; then
  die 2 "no CUDA device: torch.cuda.is_available() is False (nvidia-smi: ${GPU_SMI:-not found}).
This benchmark needs one NVIDIA GPU. BUILD_ONLY=1 only builds; CPU_SMOKE=1 checks the script on the CPU."
fi
command -v cmake >/dev/null || die 2 "cmake not found on PATH"

echo "== configure ($BUILD)"
TORCH_PREFIX="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [[ -f "$BUILD/CMakeCache.txt" ]]; then
  # An existing build tree keeps its generator.
  GEN=()
fi
CUDA_ARGS=()
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  CUDA_ARGS=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
cmake -S "$ROOT/bench/gpu" -B "$BUILD" ${GEN[@]+"${GEN[@]}"} -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" ${NCCL_ROOT:+-DNCCL_ROOT="$NCCL_ROOT"} ${CUDA_ARGS[@]+"${CUDA_ARGS[@]}"}
echo "== build gpt_gpu_bench"
cmake --build "$BUILD" --target gpt_gpu_bench --parallel "$(nproc)"
echo "build done after $((SECONDS - T_START)) s"
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then
  echo "BUILD_ONLY=1: built $BUILD/gpt_gpu_bench; not running"
  exit 0
fi

COMMON=(--n_layer "$N_LAYER" --n_embd "$N_EMBD" --n_head "$N_HEAD" --block_size "$BLOCK" --vocab "$VOCAB"
        --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP" --peak_tflops "$PEAK_TFLOPS")
[[ "$SMOKE" == 1 ]] && COMMON+=(--cpu_smoke)
case "$CHECKPOINT" in
  0) CKPTS=(0) ;;
  1) CKPTS=(1) ;;
  both) CKPTS=(0 1) ;;
  *) die 2 "CHECKPOINT must be 0, 1 or both, got '$CHECKPOINT'" ;;
esac

: >"$JSONL"
FAILED=0
# Runs one benchmark; its JSON line (or an error line) goes to $JSONL.
run_one() {
  local label="$1" ckpt="$2"
  shift 2
  local out rc
  echo "== $label (activation checkpointing: $ckpt): $*"
  set +e
  out="$(timeout --kill-after=20 "$RUN_TIMEOUT" "$@" | tee /dev/stderr)"
  rc=$?
  set -e
  local line
  line="$(printf '%s\n' "$out" | grep '^{' | tail -n1 || true)"
  if [[ $rc -ne 0 || -z "$line" ]]; then
    FAILED=1
    local why="exit status $rc"
    [[ $rc -eq 124 || $rc -eq 137 ]] && why="timed out after ${RUN_TIMEOUT} s"
    if [[ -z "$line" || "$line" != *'"error"'* ]]; then
      local ck_json=false
      [[ $ckpt == 1 ]] && ck_json=true
      line="{\"impl\": \"$label\", \"checkpointing\": $ck_json, \"error\": \"$why\"}"
    fi
    echo "run.sh: $label failed ($why)"
  elif [[ "$line" == *'"error"'* ]]; then
    FAILED=1
  fi
  printf '%s\n' "$line" >>"$JSONL"
}

export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
for ck in "${CKPTS[@]}"; do
  CK_ARGS=()
  SUFFIX=""
  if [[ "$ck" == 1 ]]; then
    CK_ARGS=(--checkpoint)
    SUFFIX="_ckpt"
  fi
  run_one "shardtrain_fsdp_native$SUFFIX" "$ck" "$BUILD/gpt_gpu_bench" "${COMMON[@]}" ${CK_ARGS[@]+"${CK_ARGS[@]}"} \
    --label "shardtrain_fsdp_native$SUFFIX"
  run_one "pytorch_fsdp2$SUFFIX" "$ck" "$PY" "$ROOT/bench/gpu/torch_fsdp_gpu.py" "${COMMON[@]}" \
    ${CK_ARGS[@]+"${CK_ARGS[@]}"} --label "pytorch_fsdp2$SUFFIX"
done

echo "== report ($RESULTS/gpu_benchmark.md)"
MACHINE="$(date -u '+%Y-%m-%d %H:%M UTC'); GPU: ${GPU_SMI:-none}; $(echo "$TORCH_INFO" | grep -v '^STATUS' | tail -n1)"
[[ "$SMOKE" == 1 ]] && MACHINE="$MACHINE. **CPU_SMOKE=1: a tiny model on the CPU, the numbers mean nothing.**"
"$PY" "$ROOT/bench/gpu/report.py" "$JSONL" "$RESULTS/gpu_benchmark.md" --machine "$MACHINE" \
  --command "BATCH=$BATCH STEPS=$STEPS WARMUP=$WARMUP CHECKPOINT=$CHECKPOINT bench/gpu/run.sh"
echo "total $((SECONDS - T_START)) s; results in $RESULTS/gpu_benchmark.{md,jsonl,log}"
exit "$FAILED"
