#!/usr/bin/env bash
# comm/ with real processes: collective_worker ranks over real Gloo on loopback,
# rendezvous through a c10d TCPStore (or FileStore), started by
#   - comm's launcher binary (shardtrain_launch --nproc 3),
#   - torchrun --no-python from the pinned torch (<repo>/.deps/venv/bin/torchrun),
#     whose agent store makes every rank a TCPStore client under
#     /worker/attempt_<restart count>; also across a restart (attempt 1);
# and the faults: a rank killed mid-collective (rank 1, and rank 0, which also
# serves the TCPStore), a rank that stops issuing collectives (timeout), bad
# input; a rank stopped with SIGSTOP (stall warning, then SIGCONT; stall
# timeout). Survivors must name the faulty rank (from the peers' heartbeats).
#
#   process_test.sh WORKER LAUNCHER     (runfiles paths; Bazel passes them)
#
# torchrun is looked up as $SHARDTRAIN_TORCHRUN, else <repo>/.deps/venv/bin/torchrun
# where <repo> is the source tree this script lives in; if it is missing the test
# FAILS (it does not skip).
set -u

die() { echo "process_test: $*" >&2; exit 1; }
[[ $# -eq 2 ]] || die "usage: process_test.sh WORKER LAUNCHER"
abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }
WORKER="$(abspath "$1")"
LAUNCHER="$(abspath "$2")"
[[ -x "$WORKER" ]] || die "worker binary not found: $WORKER"
[[ -x "$LAUNCHER" ]] || die "launcher binary not found: $LAUNCHER"

# The repository root: the runfiles entry of this script is a symlink into the source tree.
SCRIPT_REAL="$(readlink -f "${BASH_SOURCE[0]}")"
REPO_ROOT="$(cd "$(dirname "$SCRIPT_REAL")/../.." && pwd)"
TORCHRUN="${SHARDTRAIN_TORCHRUN:-$REPO_ROOT/.deps/venv/bin/torchrun}"

OUT_BASE="${TEST_TMPDIR:-$(mktemp -d)}/process_test"
rm -rf "$OUT_BASE"
mkdir -p "$OUT_BASE"

FAILURES=0
CASE=""
CASE_DIR=""
CASE_FAILED=0

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

fail() {
  echo "FAIL [$CASE]: $*" >&2
  CASE_FAILED=1
}

begin_case() {
  CASE="$1"
  CASE_DIR="$OUT_BASE/$CASE"
  CASE_FAILED=0
  mkdir -p "$CASE_DIR"
  echo "=== $CASE"
}

end_case() {
  if [[ $CASE_FAILED -ne 0 ]]; then
    FAILURES=$((FAILURES + 1))
    echo "--- $CASE stdout:"; cat "$CASE_DIR/stdout" 2>/dev/null
    echo "--- $CASE stderr:"; cat "$CASE_DIR/stderr" 2>/dev/null
    echo "=== $CASE FAILED"
  else
    echo "=== $CASE passed (${ELAPSED_MS} ms)"
  fi
}

# The sanitizer runtimes' options (tools/ci/sanitizers.sh sets them: the
# suppression files) survive the clean environments below.
SAN_ENV=()
for v in ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS; do
  [[ -n "${!v:-}" ]] && SAN_ENV+=("$v=${!v}")
done

# Runs a command with a clean environment (no RANK, SLURM_*, OMPI_*, ... from
# the caller) and a hard limit, capturing stdout/stderr, exit code and time.
RC=0
ELAPSED_MS=0
run() {
  local limit="$1"
  shift
  local start
  start="$(now_ms)"
  timeout --kill-after=5 "$limit" env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="${HOME:-/tmp}" \
    TMPDIR="${TEST_TMPDIR:-/tmp}" OMP_NUM_THREADS=1 "${SAN_ENV[@]+"${SAN_ENV[@]}"}" "$@" >"$CASE_DIR/stdout" \
    2>"$CASE_DIR/stderr"
  RC=$?
  ELAPSED_MS=$(( $(now_ms) - start ))
  if [[ $RC -eq 124 || $RC -eq 137 ]]; then fail "hung: killed after ${limit} s: $*"; fi
}

expect_rc() { [[ $RC -eq $1 ]] || fail "exit code $RC, expected $1"; }
expect_rc_nonzero() { [[ $RC -ne 0 ]] || fail "exit code 0, expected a failure"; }
expect_in() {  # expect_in FILE FIXED-STRING
  grep -qF -- "$2" "$CASE_DIR/$1" || fail "$1 lacks: $2"
}
expect_elapsed_below() { [[ $ELAPSED_MS -lt $1 ]] || fail "took ${ELAPSED_MS} ms, expected < $1 ms"; }

free_port() {
  "$(dirname "$TORCHRUN")/python" -c \
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# torchrun with a fresh free port (TORCHRUN_PORT); retried (twice) only if the
# port was taken meanwhile.
TORCHRUN_PORT=0
run_torchrun() {
  local attempt
  for attempt in 1 2 3; do
    TORCHRUN_PORT="$(free_port)" || { fail "cannot pick a free port with $(dirname "$TORCHRUN")/python"; return; }
    run 120 "$TORCHRUN" --no-python --nproc-per-node=2 --master-addr=127.0.0.1 --master-port="$TORCHRUN_PORT" \
      --monitor-interval=0.1 "$@"
    grep -qiE "address already in use|EADDRINUSE" "$CASE_DIR/stderr" || return 0
    echo "port $TORCHRUN_PORT was taken; retrying"
  done
}

# The survivors of a fault: each printed the CommError naming operation, group
# and the faulty rank with what happened to it (extended regex WHY), within
# `max_ms` of the fault, and exited 3 after tearing down.
check_survivors() {  # check_survivors WORLD FAULTY_RANK MAX_MS WHY
  local world="$1" faulty="$2" max_ms="$3" why="$4" r line ms
  for ((r = 0; r < world; ++r)); do
    [[ $r -eq $faulty ]] && continue
    line="$(grep -E "^rank $r/$world: CommError in iteration" "$CASE_DIR/stderr" | head -n1)"
    if [[ -z "$line" ]]; then
      fail "rank $r printed no CommError"
      continue
    fi
    echo "$line" | grep -qE "(AllGather|ReduceScatter|AllReduce|Broadcast|Barrier) on gloo group 'world' \(rank $r/$world\) (failed|timed out)" ||
      fail "rank $r's error does not name the operation and group: $line"
    echo "$line" | grep -qE "rank $faulty of group 'world'$why" ||
      fail "rank $r's error does not name rank $faulty as the cause (expected \"rank $faulty of group 'world'$why\"): $line"
    ms="$(echo "$line" | sed -nE 's/.*failed_after_fault_ms=(-?[0-9]+).*/\1/p')"
    [[ -n "$ms" && $ms -lt $max_ms ]] || fail "rank $r failed ${ms:-?} ms after the fault, expected < $max_ms ms"
    if [[ "$(cat "$CASE_DIR/rank_$r.exit" 2>/dev/null)" != "3" ]]; then
      fail "rank $r did not exit with code 3 (status file: $(cat "$CASE_DIR/rank_$r.exit" 2>/dev/null || echo missing))"
    fi
  done
  [[ ! -e "$CASE_DIR/rank_$faulty.exit" ]] || fail "faulty rank $faulty wrote an exit status"
}

# ---------------------------------------------------------------------------
begin_case launcher_3_ranks
run 120 "$LAUNCHER" --nproc 3 -- "$WORKER" --timeout_ms=30000
expect_rc 0
for r in 0 1 2; do expect_in stdout "rank $r/3 ok (source=torchrun agent_store=0 restart_count=0"; done
end_case

# Strangers at the launcher job's store (the launcher gives its ranks a
# secret, so rank 0 serves the authenticated store): an HTTP request, c10d's
# protocol and a 4 GiB frame announced, each sent and hung up, are dropped
# and logged by rank 0 while the job completes.
begin_case launcher_store_strangers
STORE_PORT="$(free_port)"
# The strangers connect only once the job's own store listens on the port:
# before, the port may belong to any process, e.g. a concurrently running
# test's Gloo pair (the likely cause of one gloo_communicator_tcp_test failure
# in CI: "Connection closed by peer" while connecting its mesh).
store_is_ours() {
  local pid exe
  for pid in $(ss -Hltnp "sport = :$STORE_PORT" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2); do
    exe="$(readlink -f "/proc/$pid/exe" 2>/dev/null)"
    [[ "$exe" == "$(readlink -f "$LAUNCHER")" || "$exe" == "$(readlink -f "$WORKER")" ]] && return 0
  done
  return 1
}
(
  for payload in 'GET / HTTP/1.0\r\n\r\n' '\x00\xce\xf7\x85\x3c\x01' '\xff\xff\xff\xff'; do
    for _ in $(seq 200); do
      store_is_ours && { exec 3<>"/dev/tcp/127.0.0.1/$STORE_PORT"; } 2>/dev/null && break
      sleep 0.05
    done
    printf "$payload" >&3 2>/dev/null
    exec 3>&-
  done
) &
STRANGERS_PID=$!
run 120 "$LAUNCHER" --nproc 3 --master_port "$STORE_PORT" -- "$WORKER" --timeout_ms=30000
wait "$STRANGERS_PID"
expect_rc 0
for r in 0 1 2; do expect_in stdout "rank $r/3 ok"; done
DROPPED="$(grep -c "dropped the connection from 127.0.0.1" "$CASE_DIR/stderr")"
[[ "$DROPPED" -eq 3 ]] || fail "rank 0 logged $DROPPED dropped strangers, expected 3"
expect_in stderr "announced a handshake message of 542393671 bytes"
expect_in stderr "it speaks c10d's TCPStore protocol"
expect_in stderr "announced a handshake message of 4294967295 bytes"
end_case

begin_case launcher_2_ranks_file_store
run 120 "$LAUNCHER" --nproc 2 -- "$WORKER" --timeout_ms=30000 --rendezvous=file --file_path="$CASE_DIR/store"
expect_rc 0
for r in 0 1; do expect_in stdout "rank $r/2 ok"; done
end_case

begin_case torchrun_2_ranks_agent_store
if [[ ! -x "$TORCHRUN" ]]; then
  fail "torchrun not found at $TORCHRUN (run tools/bootstrap.sh, or set SHARDTRAIN_TORCHRUN)"
else
  run_torchrun "$WORKER" --timeout_ms=30000
  expect_rc 0
  # torchrun sets TORCHELASTIC_USE_AGENT_STORE=True: every rank is a client of the
  # agent's store; the worker checks its keys land under /worker/attempt_0/.
  for r in 0 1; do expect_in stdout "rank $r/2 ok (source=torchrun agent_store=1 restart_count=0 master=127.0.0.1:$TORCHRUN_PORT agent_store_prefix_checked)"; done
fi
end_case

begin_case torchrun_restart_attempt_1
if [[ ! -x "$TORCHRUN" ]]; then
  fail "torchrun not found at $TORCHRUN (run tools/bootstrap.sh, or set SHARDTRAIN_TORCHRUN)"
else
  # Attempt 0 connects, then rank 1 exits 7; torchrun restarts both ranks, which
  # must rendezvous afresh under /worker/attempt_1 in the same agent store (the
  # worker finds attempt 0's key under /worker/attempt_0/ and its own under attempt_1).
  run_torchrun --max-restarts=1 "$WORKER" --timeout_ms=30000 --fail_attempt=0
  expect_rc 0
  expect_in stderr "rank 1/2: failing attempt 0 on purpose"
  for r in 0 1; do expect_in stdout "rank $r/2 ok (source=torchrun agent_store=1 restart_count=1 master=127.0.0.1:$TORCHRUN_PORT agent_store_prefix_checked)"; done
fi
end_case

# Three ranks under the launcher, whose survivors note and ignore its SIGTERM
# (--defer_sigterm), so each must fail on its own; the launcher's grace before
# SIGKILL outlasts their timeout. Args: [NAME=VALUE ...] (environment), then
# the worker's own flags.
run_three_ranks() {
  local envs=()
  while [[ $# -gt 0 && "$1" != --* ]]; do envs+=("$1"); shift; done
  run 120 "${envs[@]+"${envs[@]}"}" "$LAUNCHER" --nproc 3 --kill_grace_ms 20000 -- "$WORKER" --die_after_ms=1000 \
    --defer_sigterm --status_dir="$CASE_DIR" "$@"
}

# Rank 1 is killed mid-collective. Args: [NAME=VALUE ...] (environment).
rank_1_killed_mid_collective() {
  run_three_ranks "$@" --timeout_ms=5000 --die_rank=1
  expect_rc_nonzero
  expect_in stderr "rank 1/3: killing myself with SIGKILL now"
  grep -qE "ShardTrain launcher: rank 1 \(pid [0-9]+\) was killed by signal 9" "$CASE_DIR/stderr" ||
    fail "the launcher did not name rank 1 as the failed rank"
  check_survivors 3 1 5000 " \(pid [0-9]+ on this host\) has died \([0-9]+ collectives issued"
  expect_elapsed_below 30000
}

begin_case launcher_rank_killed_mid_collective
rank_1_killed_mid_collective
end_case

begin_case launcher_rank_killed_mid_collective_over_tcp
# The same with shared memory off: every collective on Gloo's TCP connections.
rank_1_killed_mid_collective SHARDTRAIN_GLOO_SHM=0
end_case

begin_case launcher_store_host_killed
# Rank 0 also serves the TCPStore: survivors cannot read heartbeats any more,
# yet name rank 0 (pid check on this host) and say that the store is gone.
run_three_ranks --timeout_ms=5000 --die_rank=0
expect_rc_nonzero
expect_in stderr "rank 0/3: killing myself with SIGKILL now"
check_survivors 3 0 5000 " \(pid [0-9]+ on this host\) has died"
grep -E "^rank [12]/3: CommError in iteration" "$CASE_DIR/stderr" | grep -qF "the rendezvous store could not be read" ||
  fail "no survivor said that the rendezvous store could not be read"
expect_elapsed_below 30000
end_case

begin_case launcher_rank_stalls_timeout
# Rank 1 stays alive but stops issuing collectives: the survivors' collectives
# time out (3 s); the launcher then terminates rank 1 (SIGTERM -> exit 143).
run_three_ranks --timeout_ms=3000 --stall_rank=1
expect_rc_nonzero
expect_in stderr "rank 1/3: stalling after"
expect_in stderr "timed out after 3000 ms"
expect_in stderr "rank 1/3: stalled rank terminated"
grep -qE "ShardTrain launcher: rank [02] \(pid [0-9]+\) exited with code 3" "$CASE_DIR/stderr" ||
  fail "the launcher did not name a survivor (rank 0 or 2, exit code 3) as the failed rank"
check_survivors 3 1 6000 " is alive \(heartbeat [0-9.]+ s ago\) but has issued [0-9]+ collectives while this rank is at #[0-9]+ \((AllGather|ReduceScatter|AllReduce|Broadcast)\): it has not reached this collective"
expect_elapsed_below 30000
end_case

# A rank stopped with SIGSTOP (not dead: its pid lives, its heartbeat thread is
# frozen). Runs 2 ranks under the launcher in the background, waits for rank 1's
# "stopping myself" line, then for rank 0's stall report; STOP_TO_REPORT_MS is
# the time between the two (polled every 20 ms). Args: [NAME=VALUE ...]
# (environment), then the worker's own flags.
STOP_TO_REPORT_MS=-1
LAUNCH_PID=0
JOB_START_MS=0
start_stopped_rank_job() {
  local envs=()
  while [[ $# -gt 0 && "$1" != --* ]]; do envs+=("$1"); shift; done
  ls /dev/shm >"$CASE_DIR/shm_before" 2>/dev/null
  JOB_START_MS="$(now_ms)"
  timeout --kill-after=5 60 env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="${HOME:-/tmp}" TMPDIR="${TEST_TMPDIR:-/tmp}" \
    OMP_NUM_THREADS=1 "${SAN_ENV[@]+"${SAN_ENV[@]}"}" "${envs[@]+"${envs[@]}"}" "$LAUNCHER" --nproc 2 --kill_grace_ms 1000 -- "$WORKER" \
    --stop_rank=1 --die_after_ms=1000 --heartbeat_ms=250 --status_dir="$CASE_DIR" "$@" \
    >"$CASE_DIR/stdout" 2>"$CASE_DIR/stderr" &
  LAUNCH_PID=$!
}
# Polls stderr for fixed string $1 for at most $2 ms; prints the time it was seen.
wait_for_line() {
  local deadline=$(( $(now_ms) + $2 ))
  while (( $(now_ms) < deadline )); do
    if grep -qF -- "$1" "$CASE_DIR/stderr"; then now_ms; return 0; fi
    sleep 0.02
  done
  return 1
}
measure_stop_to_report() {  # measure_stop_to_report REPORT_TEXT MAX_MS
  local stopped seen
  STOP_TO_REPORT_MS=-1
  stopped="$(wait_for_line "rank 1/2: stopping myself with SIGSTOP now" 20000)" || { fail "rank 1 never stopped itself"; return; }
  seen="$(wait_for_line "$1" "$2")" || { fail "no \"$1\" within $2 ms of rank 1's SIGSTOP"; return; }
  STOP_TO_REPORT_MS=$(( seen - stopped ))
  echo "SIGSTOP -> \"$1\": ${STOP_TO_REPORT_MS} ms"
  echo "$STOP_TO_REPORT_MS" >>"$OUT_BASE/stop_to_report_ms"
}
# No rank process, no new /dev/shm entry left behind.
expect_nothing_left() {
  local r pid
  for r in 0 1; do
    pid="$(cat "$CASE_DIR/rank_$r.pid" 2>/dev/null)" || { fail "rank $r wrote no pid file"; continue; }
    if kill -0 "$pid" 2>/dev/null; then fail "rank $r (pid $pid) still runs"; kill -KILL "$pid" 2>/dev/null; fi
  done
  ls /dev/shm >"$CASE_DIR/shm_after" 2>/dev/null
  grep -q shardtrain <(comm -13 "$CASE_DIR/shm_before" "$CASE_DIR/shm_after") && fail "a /dev/shm segment was left behind"
  return 0
}
# The report names rank 1 (its pid) and its last collective, on rank 0's stderr.
# With shared memory (no SHARDTRAIN_GLOO_SHM=0 among the case's arguments) the
# count is exact: "its latest collective is #M" with N <= M <= N+2, where N is
# what rank 1 printed just before its SIGSTOP (its main thread may issue one
# more collective before the stop lands); over TCP it is the heartbeat's.
expect_stall_report() {  # expect_stall_report PREFIX [CASE ARGS...]
  local pid1 ops="(AllGather|ReduceScatter|AllReduce|Broadcast|Barrier)" prefix="$1" n m
  shift
  pid1="$(cat "$CASE_DIR/rank_1.pid" 2>/dev/null)"
  if [[ " $* " == *" SHARDTRAIN_GLOO_SHM=0 "* ]]; then
    grep -qE "${prefix}rank 1 of group 'world' \(pid $pid1, host [^)]+\) has made no progress for [0-9.]+ s: .*its last heartbeat says collective #[0-9]+ \($ops\); this rank \(0\) waits in collective #[0-9]+ \($ops\)" "$CASE_DIR/stderr" ||
      fail "no report naming rank 1 (pid $pid1), its last heartbeat's collective and rank 0's"
    return
  fi
  grep -qE "${prefix}rank 1 of group 'world' \(pid $pid1, host [^)]+\) has made no progress for [0-9.]+ s: .*its latest collective is #[0-9]+ \($ops\); this rank \(0\) waits in collective #[0-9]+ \($ops\)" "$CASE_DIR/stderr" ||
    { fail "no report naming rank 1 (pid $pid1), its latest collective and rank 0's"; return; }
  n="$(grep -oE "rank 1/2: stopping myself with SIGSTOP now \(--stop_rank\), [0-9]+ collectives issued" "$CASE_DIR/stderr" | grep -oE "[0-9]+ collectives" | grep -oE "[0-9]+")"
  m="$(grep -oE "${prefix}rank 1 of group 'world' .*its latest collective is #[0-9]+" "$CASE_DIR/stderr" | head -1 | grep -oE "#[0-9]+$" | tr -d '#')"
  echo "rank 1 printed $n collectives issued before its SIGSTOP; rank 0's report: #$m"
  [[ -n "$n" && -n "$m" ]] || { fail "cannot read the stopped rank's count ('$n') or the report's ('$m')"; return; }
  (( m > 0 && m >= n && m <= n + 2 )) || fail "the report names collective #$m, but rank 1 had issued $n (expected $n..$((n + 2)))"
}

# Warning only: rank 0 reports rank 1 once, well within the collective timeout
# (30 s); after SIGCONT the job goes on and both ranks finish (exit 0).
stopped_rank_warning() {
  start_stopped_rank_job "$@" --timeout_ms=30000 --loop_ms=6000 --stall_warning_ms=1500
  measure_stop_to_report "stalled peer: rank 1 of group 'world'" 6000
  expect_stall_report "stalled peer: " "$@"
  kill -CONT "$(cat "$CASE_DIR/rank_1.pid")" 2>/dev/null || fail "cannot SIGCONT rank 1"
  wait "$LAUNCH_PID"
  RC=$?
  ELAPSED_MS=$(( $(now_ms) - JOB_START_MS ))
  expect_rc 0
  expect_in stderr "rank 1/2: continued after SIGSTOP"
  [[ "$(grep -c "stalled peer: rank 1 of group" "$CASE_DIR/stderr")" == 1 ]] || fail "the stall was not reported exactly once"
  expect_nothing_left
}

begin_case launcher_rank_sigstopped_warning
stopped_rank_warning
end_case

begin_case launcher_rank_sigstopped_warning_over_tcp
stopped_rank_warning SHARDTRAIN_GLOO_SHM=0
end_case

# With stall_timeout (3 s): rank 0's collective fails naming rank 1 (exit 3);
# the launcher then kills the stopped rank 1 (SIGTERM stays pending on a
# stopped process; SIGKILL after its 1 s grace).
stopped_rank_fails() {
  start_stopped_rank_job "$@" --timeout_ms=30000 --loop_ms=20000 --stall_warning_ms=1500 --stall_timeout_ms=3000
  measure_stop_to_report "rank 0/2: CommError" 9000
  wait "$LAUNCH_PID"
  RC=$?
  ELAPSED_MS=$(( $(now_ms) - JOB_START_MS ))
  expect_rc_nonzero
  [[ $RC -ne 124 && $RC -ne 137 ]] || fail "the job hung until the test's limit"
  expect_stall_report "rank 0/2: CommError in iteration .*stalled peer: " "$@"
  expect_in stderr "giving up after GlooOptions::stall_timeout = 3.0 s"
  [[ "$(cat "$CASE_DIR/rank_0.exit" 2>/dev/null)" == 3 ]] || fail "rank 0 did not exit with code 3"
  # Well before the collective timeout (30 s): stall 3 s + the launcher's 1 s grace + start-up.
  expect_elapsed_below 20000
  expect_nothing_left
}

begin_case launcher_rank_sigstopped_fails
stopped_rank_fails
end_case

begin_case launcher_rank_sigstopped_fails_over_tcp
stopped_rank_fails SHARDTRAIN_GLOO_SHM=0
end_case

begin_case bad_input
run 60 "$WORKER" --rendezvous=bogus
expect_rc 2
expect_in stderr "invalid argument: unknown rendezvous kind 'bogus'; valid: tcp, file, hash"
cp "$CASE_DIR/stderr" "$CASE_DIR/stderr.rendezvous"
run 60 "$WORKER" --no_such_flag=1
expect_rc 2
expect_in stderr "unknown flag --no_such_flag"
run 60 "$LAUNCHER" --nproc 2 -- "$WORKER" --rendezvous=bogus
expect_rc_nonzero
grep -qE "ShardTrain launcher: rank [01] \(pid [0-9]+\) exited with code 2" "$CASE_DIR/stderr" ||
  fail "the launcher did not report a rank's exit code 2"
expect_in stderr "unknown rendezvous kind 'bogus'"
end_case

# ---------------------------------------------------------------------------
if [[ $FAILURES -ne 0 ]]; then
  echo "process_test: $FAILURES case(s) failed"
  exit 1
fi
echo "process_test: all cases passed"
