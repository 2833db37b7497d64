#!/usr/bin/env bash
# Llama end-to-end benchmark (issue 28), side by side in one run on this
# machine: a random ~100M-parameter Llama saved by Python transformers as a
# Hugging Face directory, trained from it for the same AdamW steps on the same
# batches by ShardTrain (bench/e2e:llama_bench: examples/llama's model built
# shard by shard, each rank streaming its shards' ranges from the file,
# fsdp_native FULL_SHARD) and by PyTorch FSDP2 (fully_shard on the
# transformers model, Gloo; bench/e2e/torch_llama_bench.py), W=2, fp32;
# ROUNDS rounds alternating the two, medians reported. Then loading only: a
# ~500M-parameter directory at W=4, peak RSS per rank through the load.
# Writes the section "Llama: ShardTrain vs PyTorch FSDP2" of docs/benchmarks.md
# and docs/benchmarks_llama.png.
#
#   bench/e2e/llama_run.sh                         # 3 rounds + the 500M load (about 10 minutes on 2 cores)
#   ROUNDS=1 LOAD_SIZE=none bench/e2e/llama_run.sh # one round, no load rows
#   SIZE=tiny LOAD_SIZE=tiny bench/e2e/llama_run.sh  # a quick check (docs untouched)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.deps/venv/bin/python"
tools/bazel build //bench/e2e:llama_bench >&2
BIN="$ROOT/bazel-bin/bench/e2e/llama_bench"
"$PY" -c "import matplotlib" 2>/dev/null || "$ROOT/.deps/venv/bin/pip" install -q matplotlib >&2
SIZE="${SIZE:-100m}" LOAD_SIZE="${LOAD_SIZE:-500m}" STEPS="${STEPS:-5}" WARMUP="${WARMUP:-1}"
WORK="$(mktemp -d)"
trap 'rc=$?; ((rc == 0)) || { echo "[llama_run] failed (exit $rc); the log ends:" >&2; tail -20 "$WORK/log.txt" >&2; }; rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
echo "[llama_run] writing a $SIZE Llama and $((STEPS + WARMUP)) batches" >&2
"$PY" bench/e2e/torch_llama_bench.py make --dir "$WORK/model" --batches "$WORK/batches.safetensors" --size "$SIZE" \
  --steps $((STEPS + WARMUP)) 2>>"$WORK/log.txt" >&2
cpp() {  # world [extra flags]
  echo "[llama_run] ShardTrain fsdp_native (W=$1) $2" >&2
  "$BIN" --hf_dir="$3" --batches="$WORK/batches.safetensors" --devices="$1" --steps="$4" --warmup="$WARMUP" \
    --strategy=fsdp_native --strategy_options=sharding_strategy=FULL_SHARD 2>>"$WORK/log.txt" | grep '^{' >> "$RESULTS"
}
py() {  # world label dir steps
  echo "[llama_run] PyTorch FSDP2 (W=$1) $2" >&2
  "$PY" bench/e2e/torch_llama_bench.py run --dir "$3" --batches "$WORK/batches.safetensors" --world "$1" \
    --steps "$4" --warmup "$WARMUP" 2>>"$WORK/log.txt" | grep '^{' >> "$RESULTS"
}
for round in $(seq "${ROUNDS:-3}"); do
  echo "[llama_run] round $round of ${ROUNDS:-3}" >&2
  cpp 2 train "$WORK/model" "$STEPS"
  py 2 train "$WORK/model" "$STEPS"
done
if [[ "$LOAD_SIZE" != none ]]; then
  rm -rf "$WORK/model"
  echo "[llama_run] writing a $LOAD_SIZE Llama for the load rows" >&2
  "$PY" bench/e2e/torch_llama_bench.py make --dir "$WORK/load" --batches "$WORK/unused.safetensors" --size "$LOAD_SIZE" \
    --steps 1 2>>"$WORK/log.txt" >&2
  for round in $(seq "${LOAD_ROUNDS:-2}"); do
    cpp 4 load "$WORK/load" 0
    py 4 load "$WORK/load" 0
  done
fi
DOCS=()
[[ "$SIZE" == 100m ]] && DOCS=(--docs docs/benchmarks.md --png docs/benchmarks_llama.png)
"$PY" bench/e2e/llama_report.py "$RESULTS" "${DOCS[@]}" \
  --command "bench/e2e/llama_run.sh (SIZE=$SIZE LOAD_SIZE=$LOAD_SIZE ROUNDS=${ROUNDS:-3}; $(date -u +%F), commit $(git rev-parse --short HEAD))"
