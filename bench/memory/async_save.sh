#!/usr/bin/env bash
# Saves that overlap training, side by side in one run: the examples/gpt model
# (201.7M parameters, AdamW, fp32, batch 1 x 32 tokens) trained 6 steps at W
# ranks with one sharded save after step 2 — none, synchronous, or in the
# background — through ShardTrain (fsdp_native FULL_SHARD,
# TrainerOptions::async_checkpoint: copy-on-write per unit) and Python PyTorch
# (FSDP2, dcp.save / dcp.async_save, which stages a copy of the rank's state).
# And the control: no save, the same bytes written with O_DIRECT by a bare
# thread (memory_bench --save=bare_write), what the disk alone costs the steps.
# Reports the training time the save cost (steps after it + the time the save
# call held the training thread + the wait at the end, minus the same without a
# save) and the extra peak memory (the save's window minus the steps' before
# it), and writes the table into docs/benchmarks.md ("Saves that overlap
# training").
#
# ShardTrain's three runs repeat ROUNDS times (default 3: a save now costs
# less than the steps' own noise), PyTorch's once; the report takes medians.
#
#   bench/memory/async_save.sh                     # W = 2 4 (about 12 minutes on 2 cores)
#   WORLDS=2 SIZE=small ROUNDS=1 bench/memory/async_save.sh # a quick check
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
STEPS=(--steps=6 --save_at=2)
for W in ${WORLDS:-2 4}; do
  for round in $(seq "${ROUNDS:-3}"); do
    for save in none sync async bare_write; do
      echo "[bench/memory/async_save] ShardTrain $LABEL W=$W save=$save round $round" >&2
      rm -rf "$WORK/st"
      "$BIN" --mode=save_during_training --save=$save --devices=$W --dir="$WORK/st" --out="$RESULTS" --label=$LABEL \
        "${MODEL[@]}" "${STEPS[@]}" 2>>"$WORK/log.txt" >/dev/null
    done
  done
  for save in none sync async; do
    echo "[bench/memory/async_save] PyTorch $LABEL W=$W save=$save" >&2
    rm -rf "$WORK/py"; mkdir -p "$WORK/py"
    "$PY" bench/memory/torch_memory.py --mode save_during_training --save $save --world $W --dir "$WORK/py" \
      --out "$RESULTS" --label $LABEL "${MODEL[@]}" --steps 6 --save_at 2 2>>"$WORK/log.txt" >/dev/null
  done
done
rm -rf "$WORK/st" "$WORK/py"
"$PY" bench/memory/async_report.py "$RESULTS" ${UPDATE_DOCS:+--docs docs/benchmarks.md}
echo "[bench/memory/async_save] results: $RESULTS" >&2
