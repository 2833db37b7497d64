#!/usr/bin/env bash
# End-to-end benchmark, side by side in one run on this machine: the same GPT
# (same sizes, batch, sequence length, AdamW, fp32, initial weights, batches)
# through ShardTrain (fsdp_native FULL_SHARD and SHARD_GRAD_OP, fsdp, ddp) and
# Python PyTorch from the pinned torch (FSDP2 fully_shard, DDP, plain), then
# memory per rank versus W = 1, 2, 4. ShardTrain's ranks exchange through
# shared memory (its default on one host); one more row runs FULL_SHARD over
# Gloo's TCP connections (SHARDTRAIN_GLOO_SHM=0). Both sides also run a "local compute"
# baseline: the same ranks, each training its own share of the batch with no
# communication at all. Writes docs/benchmarks.md and docs/benchmarks.png.
#
#   bench/e2e/run.sh            # ~50M-parameter GPT, 3 rounds (about 25 minutes on 2 cores)
#   ROUNDS=1 bench/e2e/run.sh   # one round
#   SIZE=small bench/e2e/run.sh # a quick check
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.deps/venv/bin/python"
tools/bazel build //bench/e2e:gpt_bench >&2  # .bazelrc already compiles with -O2
BIN="$ROOT/bazel-bin/bench/e2e/gpt_bench"
"$PY" -c "import matplotlib" 2>/dev/null || "$ROOT/.deps/venv/bin/pip" install -q matplotlib >&2

if [[ "${SIZE:-}" == small ]]; then
  MODEL=(--n_layer=2 --n_embd=64 --n_head=2 --block_size=32 --global_batch=8 --steps=4 --warmup=1)
else
  MODEL=(--n_layer=10 --n_embd=640 --n_head=10 --block_size=128 --global_batch=8 --steps=5 --warmup=1)
fi
WORK="$(mktemp -d)"
# On failure the last lines of the runs' log are shown before the work dir goes.
trap 'rc=$?; ((rc == 0)) || { echo "[bench/e2e] failed (exit $rc); the log ends:" >&2; tail -20 "$WORK/log.txt" >&2; }; rm -rf "$WORK"' EXIT
"$BIN" --dump_dir="$WORK" "${MODEL[@]}" > "$WORK/params.json"
RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
cpp() {  # label world strategy options [extra flags]
  echo "[bench/e2e] ShardTrain $1 (W=$2)" >&2
  "$BIN" --data_dir="$WORK" --label="$1" --devices="$2" --strategy="$3" --strategy_options="$4" "${@:5}" "${MODEL[@]}" \
    2>>"$WORK/log.txt" | grep '^{' >> "$RESULTS"
}
py() {  # impl world
  echo "[bench/e2e] PyTorch $1 (W=$2)" >&2
  "$PY" bench/e2e/torch_bench.py --impl="$1" --world="$2" --data_dir="$WORK" "${MODEL[@]}" \
    2>>"$WORK/log.txt" | grep '^{' >> "$RESULTS"
}
# W = 2, ROUNDS rounds (default 3) with every configuration once per round,
# so background load hits all alike; the report takes medians over rounds.
for round in $(seq "${ROUNDS:-3}"); do
  echo "[bench/e2e] round $round of ${ROUNDS:-3}" >&2
  cpp shardtrain_local_compute 2 single_device "" --local_compute
  cpp shardtrain_fsdp_native_FULL_SHARD 2 fsdp_native "sharding_strategy=FULL_SHARD"
  # The same over Gloo's TCP connections (what ranks on different hosts use).
  SHARDTRAIN_GLOO_SHM=0 cpp shardtrain_fsdp_native_FULL_SHARD_over_tcp 2 fsdp_native "sharding_strategy=FULL_SHARD"
  cpp shardtrain_fsdp_native_FULL_SHARD_fwd_prefetch 2 fsdp_native "sharding_strategy=FULL_SHARD,forward_prefetch=true"
  cpp shardtrain_fsdp_native_SHARD_GRAD_OP 2 fsdp_native "sharding_strategy=SHARD_GRAD_OP"
  cpp shardtrain_fsdp 2 fsdp "min_num_params=1000"
  cpp shardtrain_ddp 2 ddp ""
  py local 2
  py fsdp2 2
  py ddp 2
  py plain 1
done
for w in 1 4; do
  cpp shardtrain_fsdp_native_FULL_SHARD "$w" fsdp_native "sharding_strategy=FULL_SHARD"
  py fsdp2 "$w"
done
"$PY" bench/e2e/report.py "$RESULTS" "$WORK/params.json" docs/benchmarks.md docs/benchmarks.png \
  "bench/e2e/run.sh ${SIZE:+(SIZE=$SIZE)}" "${MODEL[*]}"
cat docs/benchmarks.md
