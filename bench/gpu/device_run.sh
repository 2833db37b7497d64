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
# checks of issue 29's fixes (tests/cuda:cuda_fixes_test); (4) the ~1.02B GPT
# in bf16 at W=1, ShardTrain FULL_SHARD (gpt_gpu_bench) vs PyTorch FSDP2
# (torch_fsdp_gpu.py), same model, data and optimizer: step time, tokens/s,
# MFU, peak memory; (5) the same with activation checkpointing. Not yet in the
# bundle (skipped, named): the Trainer on CUDA against its CPU curves, CPU
# offload, plain LibTorch.
#
# Settings (environment): BUDGET_S=420 (total seconds), BUNDLE=<repo>/.gpu_bundle,
# PYTHON=python3 (the Python with the GPU machine's torch), OUT (results;
# default /tmp/device_run), BATCH=16 STEPS=10 WARMUP=3, PEAK_TFLOPS=989.
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
  line="$(grep '^{"impl"' "$item_log" | tail -n1 || true)"
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
run_item cuda_fixes_test 20 90 "$BUNDLE/bin/cuda_fixes_test"

# ---- (4), (5) the 1B GPT, ShardTrain vs FSDP2, without and with activation checkpointing ----
MODEL=(--n_layer 24 --n_embd 1792 --n_head 16 --block_size 1024 --vocab 50304)
RUN=(--batch "${BATCH:-16}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --peak_tflops "${PEAK_TFLOPS:-989}")
NEED=60 LIMIT=150
if [[ "$REHEARSE" == 1 ]]; then
  # A tiny model on the CPU: the binaries start and report; the numbers mean nothing.
  MODEL=(--cpu_smoke --n_layer 2 --n_embd 64 --n_head 4 --block_size 32 --vocab 96)
  RUN=(--batch 4 --steps 2 --warmup 1)
  NEED=5 LIMIT=60
fi
for ck in 0 1; do
  CK=() SFX=""
  ((ck)) && CK=(--checkpoint) SFX="_ckpt"
  run_item "gpt1b_shardtrain$SFX" "$NEED" "$LIMIT" "$BUNDLE/bin/gpt_gpu_bench" "${MODEL[@]}" "${RUN[@]}" \
    ${CK[@]+"${CK[@]}"} --label "shardtrain_fsdp_native$SFX"
  run_item "gpt1b_fsdp2$SFX" "$NEED" "$LIMIT" "$PY" "$ROOT/bench/gpu/torch_fsdp_gpu.py" "${MODEL[@]}" "${RUN[@]}" \
    ${CK[@]+"${CK[@]}"} --label "pytorch_fsdp2$SFX"
done

for absent in trainer_cuda_vs_cpu cpu_offload plain_libtorch; do
  echo "== $absent: skipped: not in the bundle yet (issue 29)"
  record "$absent" skipped 0 0 "not in the bundle yet"
done

if [[ -s "$BENCH" ]]; then
  NOTE="$(date -u '+%Y-%m-%d'); GPU: ${GPU:-none}; torch $TORCH_HERE"
  ((REHEARSE)) && NOTE="$NOTE. **Rehearsal: a tiny model on the CPU, the numbers mean nothing.**"
  "$PY" "$ROOT/bench/gpu/report.py" "$BENCH" "$OUT/gpu_benchmark.md" --machine "$NOTE" \
    --command "bench/gpu/make_bundle.sh (here), then bench/gpu/device_run.sh (carry .gpu_bundle)" ||
    echo "device_run.sh: report.py failed (the JSON lines are in $BENCH)"
fi
echo "== done in $((SECONDS - T0)) s of ${BUDGET_S}; results in $OUT (results.jsonl, gpu_benchmark.md, device_run.log)"
exit "$FAILED"
