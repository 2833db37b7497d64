#!/usr/bin/env bash
# Open MPI across namespace hosts: from h0,
#   mpirun -np 4 --host h0:2,h1:2 --mca plm_rsh_agent mpi_agent.sh
#          -x MASTER_ADDR=h0 -x MASTER_PORT=29500 <gpt> ...
# (mpi_agent.sh enters the namespace host instead of ssh; as root also
# --allow-run-as-root). Ranks take their place from OMPI_COMM_WORLD_* and meet
# at MASTER_ADDR:MASTER_PORT (Open MPI exports no rank-0 address). The GPT
# example through fsdp_native FULL_SHARD, HYBRID_SHARD and ddp equals the W=4
# run on one host bit for bit (every logged loss, the final checkpoint).
#
#   mpi_test.sh GPT_TRAIN COMPARE_RUNS_PY    (runfiles paths; Bazel passes them)
set -u
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh" mpi_test
[[ $# -eq 2 ]] || die "usage: mpi_test.sh GPT_TRAIN COMPARE_RUNS_PY"
GPT="$(abspath "$1")"
COMPARE="$(abspath "$2")"
PYTHON="$REPO_ROOT/.deps/venv/bin/python"
cluster_skip_unless_possible
command -v mpirun >/dev/null || die "mpirun is not installed: tools/bootstrap.sh installs Debian's openmpi-bin"
[[ -x "$TORCHRUN" ]] || die "torchrun not found at $TORCHRUN (tools/bootstrap.sh installs the pinned torch)"
shm_snapshot "$OUT/shm.before"
cluster_start 2
source "$CLUSTER_DIR/gpt_runs.sh"

ROOT_FLAG=()
[[ $(id -u) -eq 0 ]] && ROOT_FLAG=(--allow-run-as-root)
PAIRS=()
for cfg in "${GPT_CONFIGS[@]}"; do
  name="${cfg%%|*}"; sargs="${cfg#*|}"
  case "$name" in full_shard | hybrid_shard | ddp) ;; *) continue ;; esac
  t0=$SECONDS
  # shellcheck disable=SC2086
  H run h0 timeout -k 5 "$RUN_TIMEOUT" mpirun "${ROOT_FLAG[@]}" -np 4 --host h0:2,h1:2 --mca plm_rsh_agent "$CLUSTER_DIR/mpi_agent.sh" \
    --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
    -x SHARDTRAIN_CLUSTER -x OMP_NUM_THREADS -x MASTER_ADDR=h0 -x MASTER_PORT=29500 \
    "$GPT" "${GPT_ARGS[@]}" $sargs --default_root_dir="$OUT/$name.mpi" >"$OUT/$name.mpi.out" 2>"$OUT/$name.mpi.err"
  run_done "$name.mpi" $? $((SECONDS - t0))
  reference_gpt "$name" "$sargs"
  PAIRS+=("$name.mpi=$OUT/$name.mpi:$OUT/$name.onehost")
done
grep -q "4 rank(s) via mpi" "$OUT/full_shard.mpi.out" || { fail "mpirun's run did not report 4 ranks via mpi"; cat "$OUT/full_shard.mpi.out" >&2; }
# Ranks 2 and 3 ran on h1 (the rendezvous log names each rank's host).
compare_pairs "${PAIRS[@]}"
leaks_after_down
finish
