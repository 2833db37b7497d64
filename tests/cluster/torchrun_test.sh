#!/usr/bin/env bash
# torchrun across nodes: the GPT example on 2 namespace hosts x 2 ranks, one
#   torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d
#            --rdzv-endpoint=<h0's address>:29400 --no-python <gpt> ...
# per host, equals the same W=4 run on one host bit for bit: every logged
# loss (train_loss at each of 6 steps, val_loss) and every tensor of the
# final checkpoint, for fsdp_native FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD
# (shard inside a host, replicate across hosts), fsdp and ddp.
# The one-host reference: the example's own launcher (--devices=4) on h0;
# for HYBRID_SHARD, whose groups follow the nodes, the same two torchrun
# agents, both on h0 (2 "nodes" on one host, so every group there shares memory).
#
#   torchrun_test.sh GPT_TRAIN COMPARE_RUNS_PY    (runfiles paths; Bazel passes them)
set -u
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh" torchrun_test
[[ $# -eq 2 ]] || die "usage: torchrun_test.sh GPT_TRAIN COMPARE_RUNS_PY"
GPT="$(abspath "$1")"
COMPARE="$(abspath "$2")"
PYTHON="$REPO_ROOT/.deps/venv/bin/python"
cluster_skip_unless_possible
[[ -x "$TORCHRUN" ]] || die "torchrun not found at $TORCHRUN (tools/bootstrap.sh installs the pinned torch)"
shm_snapshot "$OUT/shm.before"
cluster_start 2
source "$CLUSTER_DIR/gpt_runs.sh"

PAIRS=()
for cfg in "${GPT_CONFIGS[@]}"; do
  name="${cfg%%|*}"; sargs="${cfg#*|}"
  torchrun_gpt "$name.hosts" "$sargs" h0 h1
  reference_gpt "$name" "$sargs"
  PAIRS+=("$name=$OUT/$name.hosts:$OUT/$name.onehost")
done
# The cross-host runs really joined as 2 nodes of 2 ranks through torchrun.
grep -q "4 rank(s) via torchrun" "$OUT/full_shard.hosts.out" || fail "the cross-host run did not report 4 ranks via torchrun"
compare_pairs "${PAIRS[@]}"

leaks_after_down
finish
