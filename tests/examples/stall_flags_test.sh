#!/usr/bin/env bash
# --stall_warning_s and --stall_timeout_s reach the communicator: the GPT
# example at W=2 on the CPU (the Trainer as its own launcher: rank 0 starts
# rank 1 as its child), --stall_warning_s=1 --stall_timeout_s=6; once rank 0
# has trained a step, rank 1 gets SIGSTOP. Asserts:
#   - rank 0 logs "stalled peer: rank 1 of group 'world' (pid <rank 1's pid>, ...)"
#     with "(warning after GlooOptions::stall_warning = 1.0 s", within 5 s of
#     the SIGSTOP and before the failure (a rank stopped inside the collective
#     rank 0 waits in is named once its heartbeat is 3 periods old: ~3 s;
#     one stopped before issuing it, after ~1 s; with the default 60 s, none);
#   - the run exits non-zero with "error: ... stalled peer: rank 1 ... giving up
#     after GlooOptions::stall_timeout = 6.0 s" (CommTimeoutError), within 20 s
#     of the SIGSTOP (the collective timeout, --timeout_s=60, is far later);
#   - no rank process is left.
# Prints the time from the SIGSTOP to the warning and to the failure (stderr
# polled every 20 ms).
#   stall_flags_test.sh GPT_TRAIN   (runfiles path; Bazel passes it)
set -u
die() { echo "stall_flags_test: $*" >&2; exit 1; }
[[ $# -eq 1 ]] || die "usage: stall_flags_test.sh GPT_TRAIN"
GPT="$(readlink -f "$1")"
[[ -x "$GPT" ]] || die "not found: $1"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/stall_flags"
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=1
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
FAILURES=0
fail() { echo "FAIL: $*" >&2; FAILURES=$((FAILURES + 1)); }

"$GPT" --devices=2 --max_steps=100000 --n_layer=1 --n_head=2 --n_embd=16 --block_size=16 --batch_size=2 \
  --eval_every=100000 --val_samples=2 --sample_tokens=0 --num_workers=0 --log_every_n_steps=1 \
  --timeout_s=60 --stall_warning_s=1 --stall_timeout_s=6 --default_root_dir="$OUT/run" \
  >"$OUT/stdout" 2>"$OUT/stderr" &
RANK0=$!
cleanup() { kill -KILL "$RANK0" ${RANK1:+"$RANK1"} 2>/dev/null; }
trap cleanup EXIT

# Polls $1 (a file) for extended regex $2 for at most $3 ms; prints the time it was seen.
wait_for() {
  local deadline=$(( $(now_ms) + $3 ))
  while (( $(now_ms) < deadline )); do
    if grep -qaE -- "$2" "$1"; then now_ms; return 0; fi
    sleep 0.02
  done
  return 1
}

# Training runs once the progress shows a step (logged every step).
wait_for "$OUT/stdout" "step +[1-9]|[1-9][0-9]*/[0-9]+" 120000 >/dev/null ||
  wait_for "$OUT/stderr" "step +[1-9]|[1-9][0-9]*/[0-9]+" 1000 >/dev/null ||
  { tail -20 "$OUT/stdout" "$OUT/stderr"; die "rank 0 trained no step within 120 s"; }
RANK1="$(pgrep -P "$RANK0" | head -1)"
[[ -n "$RANK1" ]] || die "rank 0 (pid $RANK0) has no child process (rank 1)"
kill -STOP "$RANK1" || die "cannot SIGSTOP rank 1 (pid $RANK1)"
T_STOP=$(now_ms)
echo "rank 1 (pid $RANK1) stopped"

WARNING="stalled peer: rank 1 of group 'world' \(pid $RANK1, host [^)]+\) has made no progress for [0-9.]+ s: .*\(warning after GlooOptions::stall_warning = 1.0 s"
if T_WARN=$(wait_for "$OUT/stderr" "$WARNING" 5000); then
  echo "SIGSTOP -> warning: $(( T_WARN - T_STOP )) ms (--stall_warning_s=1; load $(cut -d' ' -f1-3 /proc/loadavg))"
else
  fail "no stalled-peer warning naming rank 1 (pid $RANK1) with stall_warning = 1.0 s within 5 s"
fi
FAILURE="error: .*stalled peer: rank 1 of group 'world' \(pid $RANK1, .*giving up after GlooOptions::stall_timeout = 6.0 s"
if T_FAIL=$(wait_for "$OUT/stderr" "$FAILURE" 20000); then
  echo "SIGSTOP -> failure: $(( T_FAIL - T_STOP )) ms (--stall_timeout_s=6)"
else
  fail "no 'error: ... stalled peer: rank 1 ... giving up after GlooOptions::stall_timeout = 6.0 s' within 20 s"
fi
for _ in $(seq 1 500); do kill -0 "$RANK0" 2>/dev/null || break; sleep 0.02; done
if kill -0 "$RANK0" 2>/dev/null; then
  fail "rank 0 still runs 10 s after the failure"
else
  wait "$RANK0"; RC=$?
  [[ $RC -ne 0 ]] || fail "exit status 0 after a stall failure"
fi
sleep 0.5
kill -0 "$RANK1" 2>/dev/null && fail "rank 1 (pid $RANK1) still runs"
if [[ -n "${T_WARN:-}" && -n "${T_FAIL:-}" ]] && (( T_WARN > T_FAIL )); then fail "the warning came after the failure"; fi
grep -aF "stalled peer:" "$OUT/stderr" | cut -c1-400
if [[ $FAILURES -ne 0 ]]; then
  echo "--- stdout (tail)"; tail -5 "$OUT/stdout"; echo "--- stderr (tail)"; tail -20 "$OUT/stderr"
  exit 1
fi
echo "stall_flags_test: passed"
