#!/usr/bin/env bash
# Memory at every phase, side by side in one run: peak RSS per rank for
# construction, one training step, full save, sharded save, full load and
# sharded load of the examples/gpt model (16 layers, d 1024: 201.7M
# parameters; batch 1 x 32 tokens, AdamW, fp32) at W = 1, 2, 4, through
# ShardTrain (fsdp_native FULL_SHARD, sharded construction, its full and
# sharded checkpoints) and Python PyTorch (FSDP2 fully_shard built on the meta
# device, torch.distributed.checkpoint). Writes docs/memory_phases.md's table
# into docs/benchmarks.md (section "Memory at every phase") and
# docs/memory_phases.png.
#
#   bench/memory/run.sh                 # 201.7M model, W = 1 2 4 (about 10 minutes on 2 cores)
#   WORLDS="2" SIZE=small bench/memory/run.sh   # a quick check
#   SIDES=shardtrain bench/memory/run.sh        # ShardTrain only (with SHARDTRAIN_HOST_CACHE=0:
#                                               # without the host block cache)
#
# A watchdog ends a run (its own process group only) when the machine's
# MemAvailable falls below 1.5 GiB, and the row is reported as stopped.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

guarded() {  # runs "$@" in its own process group; ends it if memory runs low
  setsid "$@" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    local avail
    avail=$(awk '/MemAvailable/ {print int($2/1024)}' /proc/meminfo)
    if (( avail < 1536 )); then
      echo "[bench/memory] MemAvailable ${avail} MiB: stopping $*" >&2
      kill -- -"$pid" 2>/dev/null || true
      echo "{\"stopped\": \"$*\"}" >> "$RESULTS"
    fi
    sleep 0.5
  done
  wait "$pid" || echo "[bench/memory] failed: $*" >&2
}

SIDES="${SIDES:-shardtrain pytorch}"
for W in ${WORLDS:-1 2 4}; do
  [[ " $SIDES " == *" shardtrain "* ]] && for mode in train load_full load_sharded; do
    echo "[bench/memory] ShardTrain $LABEL W=$W $mode" >&2
    guarded "$BIN" --mode=$mode --devices=$W --dir="$WORK/st$W" --out="$RESULTS" --label=$LABEL "${MODEL[@]}" \
      2>>"$WORK/log.txt" >/dev/null
  done
  ls -l "$WORK/st$W/full.ckpt" >&2 || true
  rm -rf "$WORK/st$W"
  [[ " $SIDES " == *" pytorch "* ]] || continue
  mkdir -p "$WORK/py$W"
  for mode in train load_full load_sharded; do
    echo "[bench/memory] PyTorch FSDP2+DCP $LABEL W=$W $mode" >&2
    guarded "$PY" bench/memory/torch_memory.py --mode=$mode --world=$W --dir="$WORK/py$W" --out="$RESULTS" \
      --label=$LABEL "${MODEL[@]}" 2>>"$WORK/log.txt" >/dev/null
  done
  rm -rf "$WORK/py$W"
done
PNG=()  # the plot compares both sides: a one-sided run leaves docs/memory_phases.png alone
[[ " $SIDES " == *" pytorch "* && " $SIDES " == *" shardtrain "* ]] || PNG=(--png=)
"$PY" bench/memory/report.py "$RESULTS" "${MODEL[@]}" "${PNG[@]+"${PNG[@]}"}"
echo "[bench/memory] raw results: $RESULTS" >&2
