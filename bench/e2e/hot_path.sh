#!/usr/bin/env bash
# The FSDP step against the compute limit, side by side in one run (issue 25):
# for each GPT configuration, with the same initial weights and batches,
#   single_device       one process, both cores (intra-op threads), the whole global batch
#   local_compute       W ranks, each training its own share alone (no communication)
#   fsdp_native         FULL_SHARD at W (the default: the host block cache)
#   fsdp_native_nocache FULL_SHARD at W with SHARDTRAIN_HOST_CACHE=0 (glibc with the
#                       4 MiB mmap threshold: the default before the cache)
#   fsdp_native_fwd_prefetch  FULL_SHARD at W with forward_prefetch=true
#   ddp                 at W (not for the 201.7M model: W full copies would not fit)
#   pytorch_fsdp2       Python PyTorch FSDP2 (fully_shard) at W
# ROUNDS rounds (default 3), every row once per round so that background load
# hits all alike; the report takes medians over rounds. Writes the section "The
# step at the compute limit" of docs/benchmarks.md (bench/e2e/hot_path_report.py).
#
#   bench/e2e/hot_path.sh                     # 23.2M and 49.4M at W=2, 201.8M at W=4 (~30 minutes on 2 idle cores)
#   CONFIGS="23m" ROUNDS=1 bench/e2e/hot_path.sh   # one configuration, one round
#   ROUNDS=3 bench/e2e/hot_path.sh            # what docs/benchmarks.md shows (2026-12-02)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.deps/venv/bin/python"
tools/bazel build //bench/e2e:gpt_bench >&2  # .bazelrc already compiles with -O2
BIN="$ROOT/bazel-bin/bench/e2e/gpt_bench"

model_flags() {  # configuration name -> "W flags..."
  case "$1" in
    23m) echo "2 --n_layer=6 --n_embd=512 --n_head=8 --block_size=128 --vocab=8192 --global_batch=8 --steps=6 --warmup=2" ;;
    49m) echo "2 --n_layer=10 --n_embd=640 --n_head=10 --block_size=128 --vocab=96 --global_batch=8 --steps=5 --warmup=2" ;;
    200m) echo "4 --n_layer=16 --n_embd=1024 --n_head=16 --block_size=128 --vocab=96 --global_batch=8 --steps=3 --warmup=2" ;;
    *) echo "[bench/e2e/hot_path] unknown configuration '$1' (valid: 23m 49m 200m)" >&2; exit 2 ;;
  esac
}

WORK="$(mktemp -d)"
trap 'cp "$WORK/log.txt" "${HOT_PATH_LOG:-/tmp/hot_path_log.txt}" 2>/dev/null; rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
read -r -a CONFIG_LIST <<<"${CONFIGS:-23m 49m 200m}"
for c in "${CONFIG_LIST[@]}"; do
  read -r -a spec <<<"$(model_flags "$c")"
  mkdir -p "$WORK/$c"
  "$BIN" --dump_dir="$WORK/$c" "${spec[@]:1}" > "$WORK/$c/params.json"
done

row() {  # config W label env... -- gpt_bench or torch_bench arguments
  local config=$1 w=$2 label=$3
  shift 3
  local envs=()
  while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  echo "[bench/e2e/hot_path] $config $label (W=$w)" >&2
  local line="" try
  # A run that fails is tried once more (PyTorch's Gloo processes were seen
  # to abort at exit now and then on a loaded machine); both logs are kept.
  for try in 1 2; do
    line="$(env "${envs[@]+"${envs[@]}"}" "$@" 2>>"$WORK/log.txt" | grep '^{' | tail -1)" && break
    line=""
    echo "[bench/e2e/hot_path] failed (try $try of 2): $config $label; its log: ${HOT_PATH_LOG:-/tmp/hot_path_log.txt}" >&2
    tail -5 "$WORK/log.txt" >&2
  done
  [[ -n "$line" ]] || return 0
  echo "{\"config\": \"$config\", \"label\": \"$label\", \"row\": $line}" >> "$RESULTS"
}

for round in $(seq "${ROUNDS:-3}"); do
  for c in "${CONFIG_LIST[@]}"; do
    # ROUNDS_200M (default ROUNDS) caps the 201.8M configuration's rounds (~8 minutes each).
    if [[ "$c" == 200m ]] && ((round > ${ROUNDS_200M:-${ROUNDS:-3}})); then continue; fi
    read -r -a spec <<<"$(model_flags "$c")"
    W=${spec[0]}
    M=("${spec[@]:1}")
    D="$WORK/$c"
    echo "[bench/e2e/hot_path] round $round of ${ROUNDS:-3}: $c" >&2
    row "$c" 1 single_device -- "$BIN" --data_dir="$D" --devices=1 --strategy=single_device "${M[@]}"
    row "$c" "$W" local_compute -- "$BIN" --data_dir="$D" --devices="$W" --strategy=single_device --local_compute "${M[@]}"
    row "$c" "$W" fsdp_native -- "$BIN" --data_dir="$D" --devices="$W" --strategy=fsdp_native \
      --strategy_options=sharding_strategy=FULL_SHARD "${M[@]}"
    row "$c" "$W" fsdp_native_nocache SHARDTRAIN_HOST_CACHE=0 -- "$BIN" --data_dir="$D" --devices="$W" \
      --strategy=fsdp_native --strategy_options=sharding_strategy=FULL_SHARD "${M[@]}"
    row "$c" "$W" fsdp_native_fwd_prefetch -- "$BIN" --data_dir="$D" --devices="$W" --strategy=fsdp_native \
      --strategy_options=sharding_strategy=FULL_SHARD,forward_prefetch=true "${M[@]}"
    if [[ "$c" != 200m ]]; then
      row "$c" "$W" ddp -- "$BIN" --data_dir="$D" --devices="$W" --strategy=ddp "${M[@]}"
    fi
    row "$c" "$W" pytorch_fsdp2 -- "$PY" bench/e2e/torch_bench.py --impl=fsdp2 --world="$W" --data_dir="$D" "${M[@]}"
  done
done
"$PY" bench/e2e/hot_path_report.py "$RESULTS" "$WORK" docs/benchmarks.md "$(git rev-parse --short HEAD)"
cp "$RESULTS" "${HOT_PATH_RESULTS:-/tmp/hot_path_results.jsonl}"
echo "[bench/e2e/hot_path] raw results: ${HOT_PATH_RESULTS:-/tmp/hot_path_results.jsonl}" >&2
