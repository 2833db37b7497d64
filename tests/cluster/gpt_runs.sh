# The GPT runs the launcher tests compare (source it after lib.sh): a model
# and a run small enough for seconds (2 blocks of width 32, 6 steps of 4
# sequences of 32 characters per rank, validation at steps 3 and 6 over 16
# windows, no sample), the strategies, and the bit-for-bit comparison.

GPT_ARGS=(--max_steps=6 --n_layer=2 --n_head=2 --n_embd=32 --block_size=32 --batch_size=4 --eval_every=3
          --val_samples=16 --sample_tokens=0 --log_every_n_steps=1)
# name|strategy flags
GPT_CONFIGS=(
  "full_shard|--strategy=fsdp_native --strategy_options=sharding_strategy=FULL_SHARD"
  "shard_grad_op|--strategy=fsdp_native --strategy_options=sharding_strategy=SHARD_GRAD_OP"
  "hybrid_shard|--strategy=fsdp_native --strategy_options=sharding_strategy=HYBRID_SHARD"
  "fsdp|--strategy=fsdp"
  "ddp|--strategy=ddp"
)
declare -A RUN_SECONDS=()
RUN_TIMEOUT=180  # seconds one launch may take before it counts as hung

# Records a finished run: its time; a failure with the tails of its output.
run_done() {  # tag, exit code, seconds
  RUN_SECONDS[$1]=$3
  echo "run $1: exit $2 in $3 s"
  if [[ "$2" != 0 ]]; then
    fail "$1 exited $2"
    local f
    for f in "$OUT/$1".*out "$OUT/$1".*err; do [[ -f "$f" ]] && { echo "--- $f"; tail -n 15 "$f"; } >&2; done
  fi
  return 0
}

# The example's own launcher: W=4 on one host.
own_launcher_gpt() {  # tag, strategy flags, host, [VAR=value: environment]
  local t0=$SECONDS
  # shellcheck disable=SC2086
  H run "$3" env ${4:-} timeout -k 5 "$RUN_TIMEOUT" "$GPT" "${GPT_ARGS[@]}" $2 --devices=4 --default_root_dir="$OUT/$1" >"$OUT/$1.out" 2>"$OUT/$1.err"
  run_done "$1" $? $((SECONDS - t0))
}

# torchrun agents, one per given host, 2 ranks each, rendezvous on h0.
torchrun_gpt() {  # tag, strategy flags, hosts...
  local tag="$1" sargs="$2"; shift 2
  local ep pids=() k=0 t0=$SECONDS host
  ep="$(H addr h0):29400"
  for host in "$@"; do
    # shellcheck disable=SC2086
    H run "$host" timeout -k 5 "$RUN_TIMEOUT" "$TORCHRUN" --nnodes=$# --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$ep" \
      --rdzv-id="$tag" --no-python "$GPT" "${GPT_ARGS[@]}" $sargs --default_root_dir="$OUT/$tag" \
      >"$OUT/$tag.$k.out" 2>"$OUT/$tag.$k.err" &
    pids+=($!); k=$((k + 1))
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$OUT/$tag".[0-9]*.out >"$OUT/$tag.out"
  run_done "$tag" "$rc" $((SECONDS - t0))
}

# The same W=4 run on one host (h0): the example's own launcher (--devices=4);
# for HYBRID_SHARD, whose groups follow the nodes, two torchrun agents of 2
# ranks, both on h0 (2 "nodes" on one host: every group there shares memory).
# ddp's W=4 all-reduce is Gloo's ring between hosts, which adds in another
# order than shared memory's rank-order sum (last bits differ: val_loss
# 4.38251412 vs 4.38251448 after 3 steps), so its one-host run uses Gloo's TCP
# paths too (SHARDTRAIN_GLOO_SHM=0). The sharded strategies' reduce-scatters
# add in rank order on both paths: they match shared memory bit for bit.
reference_gpt() {  # name, strategy flags -> $OUT/<name>.onehost
  if [[ "$1" == hybrid_shard ]]; then
    torchrun_gpt "$1.onehost" "$2" h0 h0
  elif [[ "$1" == ddp ]]; then
    own_launcher_gpt "$1.onehost" "$2" h0 SHARDTRAIN_GLOO_SHM=0
  else
    own_launcher_gpt "$1.onehost" "$2" h0
  fi
}

# NAME=RUN:REFERENCE ...: every loss and final tensor bit-identical.
compare_pairs() {
  "$PYTHON" "$COMPARE" "$@" >"$OUT/compare.out" 2>&1
  local rc=$?
  cat "$OUT/compare.out"
  [[ $rc -eq 0 ]] || fail "runs differ from their one-host reference (above)"
}

leaks_after_down() {
  H down
  unset SHARDTRAIN_CLUSTER
  local leaks; leaks="$(shm_leaks "$OUT/shm.before")"
  [[ -z "$leaks" ]] || fail "/dev/shm segments left behind: $leaks"
  local left; left="$(ip netns list | awk '{print $1}' | grep "^$CLUSTER_PREFIX-")"
  [[ -z "$left" ]] || fail "namespaces left behind: $left"
}
