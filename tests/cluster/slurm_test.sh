#!/usr/bin/env bash
# SLURM across namespace hosts: the test starts munged, slurmctld (on h0) and
# one slurmd per host (h0, h1), each with its own configuration file, spool,
# state and log directories under the test's temporary directory (no
# systemd, nothing in /etc or /var), waits until sinfo shows both nodes
# idle, then runs the GPT example
#   - with `srun -N2 --ntasks-per-node=2` (from h0, the "login node"), and
#   - as an `sbatch -N2 --ntasks-per-node=2 --wait` job whose script runs srun,
# and checks both equal the W=4 run on one host bit for bit (every logged
# loss and the final checkpoint's tensors), for fsdp_native FULL_SHARD and
# HYBRID_SHARD (shard inside a node, replicate across nodes). Ranks find
# rank 0 as SLURM users' programs do: the first node of SLURM_NODELIST (h0,
# resolved by the hosts' /etc/hosts) and a port from SLURM_JOB_ID.
# Every daemon is stopped at the end, also on failure.
#
#   slurm_test.sh GPT_TRAIN COMPARE_RUNS_PY    (runfiles paths; Bazel passes them)
set -u
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh" slurm_test
[[ $# -eq 2 ]] || die "usage: slurm_test.sh GPT_TRAIN COMPARE_RUNS_PY"
GPT="$(abspath "$1")"
COMPARE="$(abspath "$2")"
PYTHON="$REPO_ROOT/.deps/venv/bin/python"
cluster_skip_unless_possible
for tool in munged mungekey slurmctld slurmd srun sbatch sinfo scontrol; do
  command -v "$tool" >/dev/null || die "'$tool' is not installed: tools/bootstrap.sh installs munge, slurmctld, slurmd and slurm-client"
done
shm_snapshot "$OUT/shm.before"
cluster_start 2
source "$CLUSTER_DIR/gpt_runs.sh"

# A short path: munged's socket path must fit in 108 bytes, which Bazel's
# TEST_TMPDIR does not leave room for.
S="$(mktemp -d /tmp/shardtrain-slurm.XXXXXX)" || die "mktemp failed"
on_exit "rm -rf '$S'"
mkdir -p "$S/munge" "$S/ctl/state" "$S/h0/spool" "$S/h1/spool"
chmod 755 "$S" "$S/munge"
mungekey --create --keyfile="$S/munge/munge.key" || die "mungekey failed"
chmod 400 "$S/munge/munge.key"
MUNGE_SOCKET="$S/munge/munge.socket"

write_conf() {  # file
  cat >"$1" <<EOF
# Written by tests/cluster/slurm_test.sh: a 2-node cluster of namespace hosts.
ClusterName=shardtrain
SlurmctldHost=h0($(H addr h0))
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$S/ctl/state
SlurmctldPidFile=$S/ctl/slurmctld.pid
SlurmctldLogFile=$S/ctl/slurmctld.log
SlurmdSpoolDir=$S/%n/spool
SlurmdPidFile=$S/%n/slurmd.pid
SlurmdLogFile=$S/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=5
NodeName=h0 NodeAddr=$(H addr h0) CPUs=2 State=UNKNOWN
NodeName=h1 NodeAddr=$(H addr h1) CPUs=2 State=UNKNOWN
PartitionName=main Nodes=h0,h1 Default=YES MaxTime=10 State=UP OverSubscribe=YES
EOF
}
for d in ctl h0 h1; do write_conf "$S/$d/slurm.conf"; done
export SLURM_CONF="$S/ctl/slurm.conf"

# Daemons in the foreground, in the background of this script, so their pids
# are known; each stops on any exit (and `hosts.sh down` kills what is left).
DAEMONS=()  # name:pid
start_daemon() {  # name, host, command...
  local name="$1" host="$2"; shift 2
  "$HOSTS_SH" run "$host" "$@" >"$S/$name.out" 2>&1 &  # not via H(): $! must be the daemon
  local pid=$!
  DAEMONS+=("$name:$pid")
  on_exit "stop_pid $pid"
}
start_daemon munged h0 munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$S/munge/munge.key" \
  --log-file="$S/munge/munged.log" --pid-file="$S/munge/munged.pid" --seed-file="$S/munge/munged.seed"
for ((t = 0; t < 50; ++t)); do [[ -S "$MUNGE_SOCKET" ]] && break; sleep 0.1; done
[[ -S "$MUNGE_SOCKET" ]] || { cat "$S/munged.out" "$S/munge/munged.log" >&2; die "munged did not start"; }
start_daemon slurmctld h0 slurmctld -D -i -f "$S/ctl/slurm.conf"
for h in h0 h1; do start_daemon "slurmd.$h" "$h" slurmd -D -N "$h" -f "$S/$h/slurm.conf"; done

# Wait until both nodes are idle.
idle=0
deadline=$((SECONDS + 30))
while ((SECONDS < deadline)); do
  states="$(H run h0 timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')"
  [[ "$states" == "h0 idle h1 idle " ]] && { idle=1; break; }
  sleep 0.1
done
if ((idle == 0)); then
  fail "the nodes did not become idle within 30 s (sinfo: '$states')"
  for f in "$S"/*.out "$S"/ctl/*.log "$S"/h*/*.log; do [[ -f "$f" ]] && { echo "--- $f"; tail -n 20 "$f"; } >&2; done
  finish
fi
echo "slurm: nodes idle after $(elapsed) s: $states"

PAIRS=()
for cfg in "${GPT_CONFIGS[@]}"; do
  name="${cfg%%|*}"; sargs="${cfg#*|}"
  case "$name" in full_shard | hybrid_shard) ;; *) continue ;; esac
  # srun from h0.
  t0=$SECONDS
  # shellcheck disable=SC2086
  H run h0 timeout -k 5 "$RUN_TIMEOUT" srun -N2 --ntasks-per-node=2 --job-name="$name" --kill-on-bad-exit=1 "$GPT" "${GPT_ARGS[@]}" $sargs \
    --default_root_dir="$OUT/$name.srun" >"$OUT/$name.srun.out" 2>"$OUT/$name.srun.err"
  run_done "$name.srun" $? $((SECONDS - t0))
  # sbatch --wait: the job script runs srun inside the allocation.
  cat >"$OUT/$name.sbatch.sh" <<EOF
#!/bin/sh
exec srun --kill-on-bad-exit=1 "$GPT" ${GPT_ARGS[*]} $sargs --default_root_dir="$OUT/$name.sbatch"
EOF
  t0=$SECONDS
  H run h0 timeout -k 5 "$RUN_TIMEOUT" sbatch --wait -N2 --ntasks-per-node=2 --job-name="$name.sbatch" --output="$OUT/$name.sbatch.job" \
    "$OUT/$name.sbatch.sh" >"$OUT/$name.sbatch.out" 2>"$OUT/$name.sbatch.err"
  rc=$?
  cat "$OUT/$name.sbatch.job" >>"$OUT/$name.sbatch.out" 2>/dev/null
  run_done "$name.sbatch" "$rc" $((SECONDS - t0))
  # One-host reference (as in torchrun_test).
  reference_gpt "$name" "$sargs"
  PAIRS+=("$name.srun=$OUT/$name.srun:$OUT/$name.onehost" "$name.sbatch=$OUT/$name.sbatch:$OUT/$name.onehost")
done
grep -q "4 rank(s) via slurm" "$OUT/full_shard.srun.out" || { fail "srun's run did not report 4 ranks via slurm"; cat "$OUT/full_shard.srun.out" >&2; }
grep -q "4 rank(s) via slurm" "$OUT/full_shard.sbatch.out" || { fail "sbatch's run did not report 4 ranks via slurm"; cat "$OUT/full_shard.sbatch.out" >&2; }
compare_pairs "${PAIRS[@]}"

# Stop the daemons (slurmds, slurmctld, munged) now and check that they went.
run_exit_hooks
trap 'run_exit_hooks' EXIT
for d in "${DAEMONS[@]}"; do
  pid="${d#*:}"
  [[ -e "/proc/$pid" ]] && fail "${d%%:*} (pid $pid) still exists after being stopped: $(cat "/proc/$pid/stat")"
done
((${#DAEMONS[@]} == 4)) || fail "expected 4 daemons (munged, slurmctld, 2 slurmd), started: ${DAEMONS[*]}"
[[ ! -e "$S" ]] || fail "the SLURM directory $S is left"
leaks="$(shm_leaks "$OUT/shm.before")"
[[ -z "$leaks" ]] || fail "/dev/shm segments left behind: $leaks"
finish
