#!/usr/bin/env bash
# Runs the communication benchmark side by side: ShardTrain's GlooCommunicator
# (//bench/comm:comm_bench; through shared memory, as by default for ranks on
# one host, and again over Gloo's TCP connections with SHARDTRAIN_GLOO_SHM=0)
# and torch.distributed on Gloo (bench/comm/torch_reference.py), W = 2
# processes each, and writes the table to docs/comm_benchmark.md.
#
#   bench/comm/run.sh                      # full run (1..256 MiB), ~3-5 minutes on 2 cores
#   SIZES=1,4 bench/comm/run.sh --out /tmp/quick.md
#   NICE=-10 bench/comm/run.sh                 # on a shared machine: run the ranks at higher priority
#   bench/comm/run.sh --baseline-rev eec0c67   # also time comm_bench built against
#                                              # comm/gloo_communicator.cc at that revision ("before" column)
#   bench/comm/run.sh --keep /tmp/csv          # also keep the raw CSVs there
#
# The two implementations run alternately, one size at a time, so that load
# from other processes on the machine affects both alike. With the first size
# each side also times LATENCY_ITERS (default 500) back-to-back all-reduces of
# one float32 element: the per-call latency, and (ShardTrain with verify_calls
# on minus off) what the per-call signature check costs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

OUT="docs/comm_benchmark.md"
BASELINE_REV=""
KEEP=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --baseline-rev) BASELINE_REV="$2"; shift 2 ;;
    --keep) KEEP="$2"; shift 2 ;;
    *) echo "usage: $0 [--out FILE] [--baseline-rev REV] [--keep DIR]" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-$ROOT/.deps/venv/bin/python}"
SIZES="${SIZES:-1,4,16,64,256}"
DTYPES="${DTYPES:-float32,bfloat16}"
RUN=()
[[ -n "${NICE:-}" ]] && RUN=(nice -n "$NICE")
COMMON=(--dtypes="$DTYPES" --warmup=2 --small_iters=25 --small_mib=16 --iters=9 --large_iters=5 --large_mib=256)

tools/bazel build //bench/comm:comm_bench
BIN="$ROOT/bazel-bin/bench/comm/comm_bench"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
[[ -n "$BASELINE_REV" ]] && bench/comm/build_baseline.sh "$TMP/comm_bench_baseline" "$BASELINE_REV"

start=$(date +%s)
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
self_check=true
latency_iters="${LATENCY_ITERS:-500}"
IFS=',' read -ra size_list <<<"$SIZES"
for s in "${size_list[@]}"; do
  echo "=== ${s} MiB: ShardTrain ==="
  "${RUN[@]+"${RUN[@]}"}" "$BIN" --sizes_mib="$s" --self_check="$self_check" --latency_iters="$latency_iters" \
    --out="$TMP/st_$s.csv" "${COMMON[@]}"
  echo "=== ${s} MiB: ShardTrain over TCP (SHARDTRAIN_GLOO_SHM=0) ==="
  SHARDTRAIN_GLOO_SHM=0 "${RUN[@]+"${RUN[@]}"}" "$BIN" --sizes_mib="$s" --self_check="$self_check" \
    --unverified_below_mib=0 --latency_iters="$latency_iters" --out="$TMP/tcp_$s.csv" "${COMMON[@]}"
  self_check=false  # the edge-case check runs once, before the first size
  if [[ -n "$BASELINE_REV" ]]; then
    echo "=== ${s} MiB: ShardTrain at $BASELINE_REV (before) ==="
    "${RUN[@]+"${RUN[@]}"}" "$TMP/comm_bench_baseline" --sizes_mib="$s" --self_check=false --unverified_below_mib=0 \
      --latency_iters="$latency_iters" --out="$TMP/base_$s.csv" "${COMMON[@]}"
  fi
  echo "=== ${s} MiB: PyTorch ==="
  "${RUN[@]+"${RUN[@]}"}" "$PY" bench/comm/torch_reference.py --sizes_mib="$s" --latency_iters="$latency_iters" \
    --out="$TMP/py_$s.csv" "${COMMON[@]}"
  latency_iters=0  # the per-call latency is timed once, with the first size
done
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
elapsed=$(( $(date +%s) - start ))

torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"
threads="$("$PY" -c 'import torch; print(torch.get_num_threads())')"
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
mem="$(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
cmd="bench/comm/run.sh"
[[ "$SIZES" != "1,4,16,64,256" ]] && cmd="SIZES=$SIZES $cmd"
[[ "$DTYPES" != "float32,bfloat16" ]] && cmd="DTYPES=$DTYPES $cmd"
[[ -n "${NICE:-}" ]] && cmd="NICE=$NICE $cmd"
[[ -n "$BASELINE_REV" ]] && cmd+=" --baseline-rev $BASELINE_REV"
[[ "$OUT" != "docs/comm_benchmark.md" ]] && cmd+=" --out $OUT"

machine=(
  --machine "$(nproc) CPU cores ($cpu), $mem RAM, $(uname -sr); both ranks on this machine (ShardTrain: shared memory, or Gloo over loopback TCP with SHARDTRAIN_GLOO_SHM=0; PyTorch: Gloo over loopback TCP)"
  --machine "torch $torch_version (pip, project venv) for both sides; intra-op threads $threads per rank, Gloo worker threads 2 per rank"
  --machine "load average (1/5/15 min) before: $load_before, after: $load_after (other work shared the machine when above ~1); benchmark wall time ${elapsed} s; ${NICE:+ranks run under nice -n $NICE; }$(date -u '+%Y-%m-%d %H:%M UTC')"
)
base_args=()
[[ -n "$BASELINE_REV" ]] && base_args=(--baseline "$TMP"/base_*.csv --baseline-rev "$BASELINE_REV")
"$PY" bench/comm/make_table.py --shardtrain "$TMP"/st_*.csv --pytorch "$TMP"/py_*.csv --tcp "$TMP"/tcp_*.csv \
  "${base_args[@]+"${base_args[@]}"}" --command "$cmd" "${machine[@]}" >"$OUT"
if [[ -n "$KEEP" ]]; then
  mkdir -p "$KEEP"
  cp "$TMP"/*.csv "$KEEP"/
fi
echo "wrote $OUT (${elapsed} s)"
