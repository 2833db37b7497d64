#!/usr/bin/env bash
# The GPU run in one go, on a lent GPU machine, from a bundle made HERE by
# bench/gpu/make_bundle.sh (binaries built with Bazel --config=cuda; nothing
# is compiled there). Runs its items in order of value within a total budget,
# writes each result to $OUT the moment it has it, and stops cleanly at the
# budget (an item that no longer fits is skipped, one that runs over is
# stopped).
#
#   # here: build the bundle, then rehearse (no GPU: every binary starts, the
#   # no-GPU paths say so, the budget logic stops on time)
#   bench/gpu/make_bundle.sh && bench/gpu/device_run.sh --rehearse
#   BUDGET_S=40 bench/gpu/device_run.sh --rehearse     # the budget stops it early
#   # on the GPU machine (device tool: carry [".gpu_bundle"]):
#   bench/gpu/device_run.sh
#
# Items, in order: (1) machine facts, the pinned-torch check and every
# binary's libraries resolved; (2) the NCCL communicator test; (3) the CUDA
# checks of issue 29's fixes (tests/cuda:cuda_fixes_test, one process per
# test, then multi_gpu_test, which skips on fewer than 2 GPUs); (4) the ~1.02B GPT
# in bf16 at W=1, ShardTrain FULL_SHARD (gpt_gpu_bench) vs PyTorch FSDP2
# (torch_fsdp_gpu.py), same model, data and optimizer: step time, tokens/s,
# MFU, peak memory of the steps; (5) the same model in plain LibTorch (no
# sharding, bf16 autocast); (6) both with activation checkpointing; (7) both
# with CPU offload (OFFLOAD_STEPS steps); (8) the Trainer on CUDA (examples/gpt,
# 32-true, bf16-mixed, 16-mixed) against the CPU curves recorded in the bundle.
#
# Settings (environment): BUDGET_S=420 (total seconds), BUNDLE=<repo>/.gpu_bundle,
# PYTHON=python3 (the Python with the GPU machine's torch), OUT (results;
# default /tmp/device_run), BATCH=16 STEPS=10 WARMUP=3, OFFLOAD_STEPS=4, PEAK_TFLOPS=989.
# Results: $OUT/device_run.log (everything), $OUT/results.jsonl (one line per
# item: name, status, seconds, exit status), $OUT/gpu_benchmark.{jsonl,md}.
# Exit status: 0 every item that ran passed; 1 an item failed; 2 the bundle
# or the machine cannot run it (no bundle, torch version differs, a library
# missing) — the reason is the last line.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
REHEARSE=0
for a in "$@"; do
  case "$a" in
    --rehearse) REHEARSE=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_run.sh: unknown argument '$a' (valid: --rehearse, --help)" >&2; exit 2 ;;
  esac
done
BUNDLE="${BUNDLE:-$ROOT/.gpu_bundle}"
BUDGET_S="${BUDGET_S:-420}"
OUT="${OUT:-/tmp/device_run}"
if [[ "$REHEARSE" == 1 ]]; then
  PY="${PYTHON:-$ROOT/.deps/venv/bin/python}"
else
  PY="${PYTHON:-$(command -v python3 || command -v python || true)}"
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_run.log") 2>&1
RESULTS="$OUT/results.jsonl"
BENCH="$OUT/gpu_benchmark.jsonl"
: >"$RESULTS"
: >"$BENCH"
T0=$SECONDS
FAILED=0

left() { echo $((BUDGET_S - (SECONDS - T0))); }
record() {  # name status seconds rc [why]
  printf '{"item": "%s", "status": "%s", "seconds": %s, "exit": %s, "why": "%s"}\n' "$1" "$2" "$3" "$4" "${5:-}" \
    >>"$RESULTS"
}
stop_unrunnable() {
  echo "device_run.sh: cannot run here: $1"
  record setup unrunnable 0 2 "$1"
  exit 2
}

# Runs item `name` with at most `limit` seconds (less when the budget has
# less), skipping it when fewer than `need` seconds are left. Benchmark items
# append their JSON line to gpu_benchmark.jsonl.
run_item() {
  local name="$1" need="$2" limit="$3"
  shift 3
  local remaining
  remaining="$(left)"
  if ((remaining < need)); then
    echo "== $name: skipped: ${remaining} s of the ${BUDGET_S} s budget left, it needs ${need} s"
    record "$name" skipped 0 0 "budget: ${remaining} s left, needs ${need} s"
    return 0
  fi
  ((limit > remaining)) && limit=$remaining
  echo "== $name (limit ${limit} s, ${remaining} s left): $*"
  local t=$SECONDS rc
  local item_log="${TMPDIR:-/tmp}/device_run.$$.item"
  # Streamed (into device_run.log as it comes), so a run cut off from outside keeps its output.
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$item_log"
  rc=${PIPESTATUS[0]}
  local line
  line="$(grep '^{"impl"' "$item_log" || true)"  # one per run (the Trainer item: one per precision)
  rm -f "$item_log"
  [[ -n "$line" ]] && printf '%s\n' "$line" >>"$BENCH"
  local status=passed why=""
  if ((rc == 124 || rc == 137)); then
    status=stopped why="ran past its ${limit} s"
  elif ((rc != 0)); then
    status=failed why="exit status $rc"
  elif [[ "$line" == *'"error"'* ]]; then
    status=failed why="reported an error"
  fi
  [[ "$status" != passed ]] && FAILED=1
  echo "== $name: $status in $((SECONDS - t)) s${why:+ ($why)}"
  record "$name" "$status" $((SECONDS - t)) "$rc" "$why"
}

echo "== device_run.sh $( ((REHEARSE)) && echo '--rehearse ')at $(date -u '+%Y-%m-%d %H:%M:%S UTC'), budget ${BUDGET_S} s"
# ---- (1) facts, versions, libraries ----
[[ -f "$BUNDLE/MANIFEST" ]] || stop_unrunnable "no bundle at $BUNDLE (make it here with bench/gpu/make_bundle.sh and carry it)"
[[ -n "$PY" ]] || stop_unrunnable "no python3 on PATH; set PYTHON to the Python that holds torch"
GPU="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n1)"
echo "machine: $(uname -srm); $(nproc) cores; GPU: ${GPU:-none (no nvidia-smi or no device)}"
TORCH_INFO="$("$PY" -c '
import os, torch
ok = torch.cuda.is_available()
print(torch.__version__)
print(os.path.dirname(os.path.dirname(torch.__file__)))
print(torch.cuda.get_device_name(0) if ok else "none")
print(".".join(map(str, torch.cuda.nccl.version())) if ok else "-")
' 2>&1)" || stop_unrunnable "cannot import torch with $PY: $TORCH_INFO"
TORCH_HERE="$(sed -n 1p <<<"$TORCH_INFO")"
SITE="$(sed -n 2p <<<"$TORCH_INFO")"
DEVICE_NAME="$(sed -n 3p <<<"$TORCH_INFO")"
echo "torch $TORCH_HERE at $SITE; CUDA device: $DEVICE_NAME; NCCL $(sed -n 4p <<<"$TORCH_INFO")"
TORCH_BUNDLE="$(sed -n 's/^torch_version=//p' "$BUNDLE/MANIFEST")"
[[ "$TORCH_HERE" == "$TORCH_BUNDLE" ]] ||
  stop_unrunnable "the bundle was built against torch $TORCH_BUNDLE but $PY has $TORCH_HERE; rebuild the bundle against that version"
# LibTorch and the nvidia-* wheels from this Python's site-packages; the rest from the bundle.
LIBS="$BUNDLE/lib:$SITE/torch/lib"
for d in "$SITE"/nvidia/*/lib; do [[ -d "$d" ]] && LIBS="$LIBS:$d"; done
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ "$REHEARSE" == 1 ]] && ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
  # No driver here: the CUDA toolkit's stub libcuda lets the binaries start
  # (every CUDA call then reports no device), so their no-GPU paths run.
  STUB="${CUDA_HOME:-/usr/local/cuda}/lib64/stubs/libcuda.so"
  [[ -f "$STUB" ]] || stop_unrunnable "no NVIDIA driver and no stub libcuda at $STUB to rehearse with"
  STUB_DIR="${TMPDIR:-/tmp}/device_run_stubs.$$"
  mkdir -p "$STUB_DIR"
  ln -sf "$STUB" "$STUB_DIR/libcuda.so.1"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$STUB_DIR"
  echo "rehearsal: no NVIDIA driver here; the toolkit's stub libcuda stands in ($STUB)"
fi
missing=""
for b in "$BUNDLE"/bin/*; do
  m="$(ldd "$b" 2>&1 | grep 'not found' | awk '{print $1}' | tr '\n' ' ')"
  [[ -n "$m" ]] && missing="$missing $(basename "$b"): $m;"
done
[[ -z "$missing" ]] || stop_unrunnable "libraries not found:$missing (not in the bundle, not in $SITE)"
echo "libraries: every binary's resolved (bundle + torch $TORCH_HERE)"
record facts passed $((SECONDS - T0)) 0 "GPU: ${GPU:-none}; torch $TORCH_HERE"
if [[ "$DEVICE_NAME" == none && "$REHEARSE" != 1 ]]; then
  stop_unrunnable "no CUDA device visible to torch (nvidia-smi: ${GPU:-none}); on a machine without a GPU use --rehearse"
fi

# ---- (2) NCCL ----
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
run_item nccl_communicator_test 20 90 "$BUNDLE/bin/nccl_communicator_test"
# ---- (3) the CUDA checks of issue 29's fixes ----
# One process per test, so that a crash (its stack trace printed by the
# tests' main) leaves the other tests' results.
CUDA_TESTS="$("$BUNDLE/bin/cuda_fixes_test" --gtest_list_tests | awk '/^[^ ]/ {s = $1} /^  / {print s $1}')"
if [[ -z "$CUDA_TESTS" ]]; then
  run_item cuda_fixes_test 20 90 "$BUNDLE/bin/cuda_fixes_test"
fi
for t in $CUDA_TESTS; do
  run_item "cuda_fixes_test/${t#*.}" 5 60 "$BUNDLE/bin/cuda_fixes_test" --gtest_filter="$t"
done
# Needs two GPUs: on one it skips each test in a second, saying why.
run_item multi_gpu_test 10 90 "$BUNDLE/bin/multi_gpu_test"

# ---- (4)-(7) the 1B GPT: ShardTrain vs FSDP2, plain LibTorch, checkpointing, CPU offload ----
MODEL=(--n_layer 24 --n_embd 1792 --n_head 16 --block_size 1024 --vocab 50304)
RUN=(--batch "${BATCH:-16}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --peak_tflops "${PEAK_TFLOPS:-989}")
# Offload steps AdamW over 1B float32 values on the host: fewer of them.
RUN_OFFLOAD=(--batch "${BATCH:-16}" --steps "${OFFLOAD_STEPS:-4}" --warmup 1 --peak_tflops "${PEAK_TFLOPS:-989}")
NEED=60 LIMIT=150
if [[ "$REHEARSE" == 1 ]]; then
  # A tiny model on the CPU: the binaries start and report; the numbers mean nothing.
  MODEL=(--cpu_smoke --n_layer 2 --n_embd 64 --n_head 4 --block_size 32 --vocab 96)
  RUN=(--batch 4 --steps 2 --warmup 1)
  RUN_OFFLOAD=("${RUN[@]}")
  NEED=5 LIMIT=60
fi
# One comparison: ShardTrain (gpt_gpu_bench) and FSDP2 (torch_fsdp_gpu.py) with the same extra flags.
pair() {
  local sfx="$1"
  shift
  local run=("${RUN[@]}")
  [[ "$sfx" == *offload* ]] && run=("${RUN_OFFLOAD[@]}")
  run_item "gpt1b_shardtrain$sfx" "$NEED" "$LIMIT" "$BUNDLE/bin/gpt_gpu_bench" "${MODEL[@]}" "${run[@]}" "$@" \
    --label "shardtrain_fsdp_native$sfx"
  run_item "gpt1b_fsdp2$sfx" "$NEED" "$LIMIT" "$PY" "$ROOT/bench/gpu/torch_fsdp_gpu.py" "${MODEL[@]}" "${run[@]}" \
    "$@" --label "pytorch_fsdp2$sfx"
}
pair ""
# (5) the plain-LibTorch reference (float32 parameters, bf16 autocast, no sharding): the goal is within 3% of it.
run_item gpt1b_plain_libtorch "$NEED" "$LIMIT" "$BUNDLE/bin/gpt_gpu_bench" "${MODEL[@]}" "${RUN[@]}" --plain \
  --label plain_libtorch
pair _ckpt --checkpoint  # (6)
pair _offload --offload  # (7) GPU memory saved, step time

# (8) the Trainer on CUDA (examples/gpt's program, 30 steps per precision) against the
# CPU curves make_bundle.sh recorded with the same binary and data.
# The rehearsal runs the same comparison on the CPU (it must then match exactly).
CURVE_DEVICE=cuda
((REHEARSE)) && CURVE_DEVICE=cpu
run_item trainer_cuda_vs_cpu 30 120 "$PY" "$ROOT/bench/gpu/trainer_curves.py" compare --train "$BUNDLE/bin/train" \
  --data "$BUNDLE/trainer/corpus.txt" --ref "$BUNDLE/trainer/cpu_curves.json" --out "$OUT/trainer_curves" \
  --device "$CURVE_DEVICE"

if [[ -s "$BENCH" ]]; then
  NOTE="$(date -u '+%Y-%m-%d'); GPU: ${GPU:-none}; torch $TORCH_HERE"
  ((REHEARSE)) && NOTE="$NOTE. **Rehearsal: a tiny model on the CPU, the numbers mean nothing.**"
  "$PY" "$ROOT/bench/gpu/report.py" "$BENCH" "$OUT/gpu_benchmark.md" --machine "$NOTE" \
    --command "bench/gpu/make_bundle.sh (here), then bench/gpu/device_run.sh (carry .gpu_bundle)" ||
    echo "device_run.sh: report.py failed (the JSON lines are in $BENCH)"
fi
echo "== done in $((SECONDS - T0)) s of ${BUDGET_S}; results in $OUT (results.jsonl, gpu_benchmark.md, device_run.log)"
exit "$FAILED"
