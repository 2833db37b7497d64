#!/usr/bin/env bash
# Bandwidth-limited benchmark across namespace hosts (issue 11): W=4 = 2 hosts
# (tests/cluster/hosts.sh) x 2 ranks, the links between them limited with tc
# (tbf on every host's egress) to 1, 10 and 25 Gbit/s, one GPT (same initial
# weights and batches on both sides, from gpt_bench --dump_dir) trained side by
# side in one run by
#   ShardTrain (bench/e2e/gpt_bench): fsdp_native FULL_SHARD, SHARD_GRAD_OP,
#     HYBRID_SHARD (shard inside a host, replicate across), model_parallel
#     (tensor parallel inside a host, FSDP across: "Two dimensions"), ddp, and a
#     local-compute baseline (each rank trains its share alone, no communication);
#     4 processes started per run with torchrun's variables (RANK, WORLD_SIZE,
#     LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR=h0's address);
#   Python PyTorch (bench/cluster/torch_hosts_bench.py, Gloo): FSDP2 fully_shard,
#     HSDP (fully_shard over a 2x2 DeviceMesh), DTensor TP + FSDP2 on the same
#     2x2 mesh, DDP and the same local baseline,
#     one `torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d` per host,
#     launched once for all link rates.
# Per configuration: median step time, exposed communication, bytes per link
# class (shared memory inside a host, TCP, and what crossed the host link on
# eth0), final loss. Writes the section "Across hosts" of docs/benchmarks.md
# and docs/benchmarks_hosts.png.
#
#   bench/cluster/run.sh                 # as root; ~6-10 minutes on 2 busy cores
#   SIZE=small bench/cluster/run.sh      # a quick check (a minute or two)
#   RATES="1gbit" bench/cluster/run.sh   # other link rates (tc units)
#   EARLIER="a.jsonl b.jsonl" bench/cluster/run.sh  # also the HYBRID_SHARD overlap's medians over
#                                                   # these earlier runs' results and this one
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export PATH="$PATH:/usr/sbin:/sbin"
HOSTS_SH="$ROOT/tests/cluster/hosts.sh"
PY="$ROOT/.deps/venv/bin/python"
TORCHRUN="$ROOT/.deps/venv/bin/torchrun"
BIN="$ROOT/bazel-bin/bench/e2e/gpt_bench"
LINKS=(${RATES:-1gbit 10gbit 25gbit})

if [[ "${1:-}" != --inside ]]; then
  why="$("$HOSTS_SH" check)" || { echo "bench/cluster: $why" >&2; exit 3; }
  tools/bazel build --config=ci //bench/e2e:gpt_bench >&2
  "$PY" -c "import matplotlib" 2>/dev/null || "$ROOT/.deps/venv/bin/pip" install -q matplotlib >&2 || true
  export BENCH_WORK="$(mktemp -d "${TMPDIR:-/tmp}/bench-cluster.XXXXXX")"
  echo "[bench/cluster] work dir $BENCH_WORK; load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "$HOSTS_SH" gc
  rc=0
  "$HOSTS_SH" with 2 -- "$0" --inside || rc=$?
  [[ $rc -eq 0 ]] || { echo "[bench/cluster] failed ($rc); logs in $BENCH_WORK" >&2; exit "$rc"; }
  "$PY" bench/cluster/report.py "$BENCH_WORK/results.jsonl" "$BENCH_WORK/params.json" docs/benchmarks.md \
    docs/benchmarks_hosts.png "$BENCH_WORK/meta.txt" ${EARLIER:-}
  exit 0
fi

# ---- inside the cluster (SHARDTRAIN_CLUSTER set by hosts.sh with) ----
WORK="$BENCH_WORK"
if [[ "${SIZE:-}" == small ]]; then
  MODEL=(--n_layer=2 --n_embd=64 --n_head=2 --block_size=32 --global_batch=8 --steps=3 --warmup=1)
else
  MODEL=(--n_layer=4 --n_embd=256 --n_head=4 --block_size=128 --global_batch=8 --steps=5 --warmup=1)
fi
H() { "$HOSTS_SH" "$@"; }
A0="$(H addr h0)"
"$BIN" --dump_dir="$WORK" "${MODEL[@]}" >"$WORK/params.json"
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
{
  echo "model: ${MODEL[*]}"
  echo "started: $(date -u '+%Y-%m-%d %H:%M UTC') at commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), load $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$WORK/meta.txt"
mkdir -p "$WORK/sync"
PORT=29500

# ShardTrain: 4 ranks, 2 per host, torchrun's variables set directly.
st() {  # label link strategy options [extra flags]
  local label="$1" link="$2" strategy="$3" opts="$4" pids=() r n l
  shift 4
  PORT=$((PORT + 1))
  echo "[bench/cluster] $(date -u +%T) ShardTrain $label @ $link" >&2
  for r in 0 1 2 3; do
    n=$((r / 2)); l=$((r % 2))
    H run "h$n" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$l LOCAL_WORLD_SIZE=2 GROUP_RANK=$n MASTER_ADDR="$A0" \
      MASTER_PORT=$PORT SHARDTRAIN_LAUNCHED=1 OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
      timeout -k 5 300 "$BIN" --data_dir="$WORK" --label="$label" --devices=4 --strategy="$strategy" \
      --strategy_options="$opts" "$@" "${MODEL[@]}" >"$WORK/st.$label.$link.$r.out" 2>"$WORK/st.$label.$link.$r.err" &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [[ $rc -ne 0 ]]; then
    echo "[bench/cluster] ShardTrain $label @ $link failed:" >&2; tail -n 5 "$WORK/st.$label.$link".*.err >&2; return 1
  fi
  grep '^{' "$WORK/st.$label.$link.0.out" | "$PY" -c 'import json,sys; r=json.loads(sys.stdin.read()); r["link"]=sys.argv[1]; print(json.dumps(r))' "$link" >>"$RESULTS"
}

# PyTorch: one torchrun per host for all link rates; phases step through LINKS.
PHASES="$(IFS=,; echo "${LINKS[*]}")"
for n in 0 1; do
  H run "h$n" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 timeout -k 5 900 "$TORCHRUN" --nnodes=2 --nproc-per-node=2 \
    --rdzv-backend=c10d --rdzv-endpoint="$A0:29400" --rdzv-id=bench "$ROOT/bench/cluster/torch_hosts_bench.py" \
    --data_dir="$WORK" --sync_dir="$WORK/sync" --phases="$PHASES" --local_once "${MODEL[@]}" \
    >"$WORK/py.$n.out" 2>"$WORK/py.$n.err" &
  eval "PYPID$n=$!"
done
py_phase() {  # link: let the PyTorch ranks run this phase and wait for it
  local t=0
  echo "[bench/cluster] $(date -u +%T) PyTorch @ $1" >&2
  until [[ -e "$WORK/sync/ready.$1" ]]; do
    sleep 0.2; t=$((t + 1))
    kill -0 "$PYPID0" 2>/dev/null || { echo "[bench/cluster] PyTorch ranks died:" >&2; tail -n 20 "$WORK"/py.*.err >&2; return 1; }
    ((t < 3000)) || { echo "[bench/cluster] PyTorch did not reach phase $1" >&2; return 1; }
  done
  touch "$WORK/sync/go.$1"
  until [[ -e "$WORK/sync/done.$1" ]]; do
    sleep 0.2
    kill -0 "$PYPID0" 2>/dev/null || { echo "[bench/cluster] PyTorch ranks died:" >&2; tail -n 20 "$WORK"/py.*.err >&2; return 1; }
  done
}

first=1
for rate in "${LINKS[@]}"; do
  H shape "$rate"
  py_phase "$rate"
  [[ $first -eq 1 ]] && st shardtrain_local_compute "$rate" single_device "" --local_compute
  first=0
  st shardtrain_FULL_SHARD "$rate" fsdp_native "sharding_strategy=FULL_SHARD"
  st shardtrain_SHARD_GRAD_OP "$rate" fsdp_native "sharding_strategy=SHARD_GRAD_OP"
  st shardtrain_HYBRID_SHARD "$rate" fsdp_native "sharding_strategy=HYBRID_SHARD"
  st shardtrain_TP_FSDP "$rate" model_parallel "tensor_parallel_size=2"
  st shardtrain_ddp "$rate" ddp ""
done
wait "$PYPID0" "$PYPID1" || { echo "[bench/cluster] torchrun exited with an error" >&2; tail -n 20 "$WORK"/py.*.err >&2; exit 1; }
grep -h '^{' "$WORK"/py.*.out >>"$RESULTS"
H shape off
echo "finished: $(date -u '+%H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$WORK/meta.txt"
