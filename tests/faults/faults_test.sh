#!/usr/bin/env bash
# Faults at every point, with real processes under the own launcher
# (shardtrain_launch --nproc 2 running fault_worker: fsdp_native, 6 steps, a
# checkpoint every 2 steps, stall timeout 3 s; rank 0 prints "step N loss L";
# one case with the Trainer as its own launcher, rank 0 starting rank 1).
# For each point (forward, backward, optimizer of step 3; the full and the
# sharded save after step 4) and each signal (SIGKILL, SIGSTOP) to rank 1,
# and for SIGKILL to rank 0 (the launcher, the file's writer) inside a full
# save:
#   - the job exits non-zero within 60 s; the launcher names a killed rank;
#     each surviving rank prints an error naming the faulty rank and the
#     collective it was waiting in (with the Trainer as launcher, rank 0 is
#     the launcher: it names the killed rank and ends at once);
#   - a job with a stopped rank ends within 7.5 s of the SIGSTOP (the
#     launcher sends SIGCONT with its SIGTERM, not SIGKILL after 5 s);
#   - no rank process is left, no new /dev/shm/shardtrain-* segment, and no
#     temporary checkpoint (.NAME.tmp.<pid>, .NAME.tmp-sharded) except the
#     one a killed writer could not remove;
#   - resume=auto removes that temporary, continues from the newest complete
#     checkpoint, reaches step 6, and every step's loss equals the
#     uninterrupted run's bit for bit.
# Prints "TIME case detect_ms exit_ms" per case: from the fault to the first
# survivor's error, and to the exit of the last process.
#   faults_test.sh WORKER LAUNCHER
set -u
die() { echo "faults_test: $*" >&2; exit 1; }
[[ $# -eq 2 ]] || die "usage: faults_test.sh WORKER LAUNCHER"
WORKER="$(readlink -f "$1")"
LAUNCHER="$(readlink -f "$2")"
[[ -x "$WORKER" ]] || die "worker not found: $1"
[[ -x "$LAUNCHER" ]] || die "launcher not found: $2"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/faults"
rm -rf "$OUT"; mkdir -p "$OUT"
FAILURES=0
CASE=setup
fail() { echo "FAIL [$CASE]: $*" >&2; FAILURES=$((FAILURES + 1)); }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
export OMP_NUM_THREADS=1

T0=$(now_ms)
"$WORKER" "$OUT/base" 6 > "$OUT/base.out" 2> "$OUT/base.err" || die "baseline run failed: $(tail -5 "$OUT/base.err")"
[[ $(grep -ac '^step ' "$OUT/base.out") -eq 6 ]] || die "baseline printed no 6 steps: $(cat "$OUT/base.out")"
declare -A BASE
while read -r _ step _ loss; do BASE[$step]=$loss; done < <(grep -a '^step ' "$OUT/base.out")
echo "baseline: $(( $(now_ms) - T0 )) ms"

same_losses() {  # FILE
  local n=0 step loss
  while read -r _ step _ loss; do
    n=$((n + 1))
    [[ "${BASE[$step]:-}" == "$loss" ]] || { fail "step $step: loss $loss, uninterrupted ${BASE[$step]:-none}"; return; }
  done < <(grep -a '^step ' "$1")
  [[ $n -gt 0 ]] || fail "no steps in $1"
}

shm_segments() { ls /dev/shm 2>/dev/null | grep '^shardtrain-' | sort; }

# Processes whose command line names this case's directory (the ranks).
ranks_of() { pgrep -f -- "$WORKER $1 " || true; }

temporaries() { find "$1" -name '.*.tmp.*' -o -name '.*.tmp-sharded' 2>/dev/null; }

# fault_case NAME POINT SIGNAL RANK STEP FORMAT [trainer]  (trainer: the Trainer launches rank 1)
fault_case() {
  CASE=$1
  local point=$2 sig=$3 frank=$4 fstep=$5 format=$6 how=${7:-launcher} dir="$OUT/$1"
  local launch=("$LAUNCHER" --nproc 2 --)
  [[ $how == trainer ]] && launch=()
  local survivor=$(( 1 - frank ))
  local shm_before; shm_before=$(shm_segments)
  local t0; t0=$(now_ms)
  FAULT_POINT=$point FAULT_SIGNAL=$sig FAULT_RANK=$frank FAULT_STEP=$fstep \
    timeout 60 "${launch[@]+"${launch[@]}"}" "$WORKER" "$dir" 6 never "$format" > "$dir.out" 2> "$dir.err"
  local rc=$?
  # Rank 1 outlives a killed rank 0 (the launcher) by the time it takes to notice.
  for _ in $(seq 1 400); do [[ -z "$(ranks_of "$dir")" ]] && break; sleep 0.05; done
  local t_end; t_end=$(now_ms)
  [[ $rc -ne 0 ]] || fail "exit status 0"
  [[ $rc -ne 124 ]] || fail "still running after 60 s"
  local left; left=$(ranks_of "$dir")
  if [[ -n "$left" ]]; then
    fail "processes left: $left"
    for p in $left; do kill -9 "$p"; done
  fi
  # -o: the line may follow another process's unfinished line on the shared stderr.
  local fault_line; fault_line=$(grep -ao "FAULT rank $frank SIG$sig at $point step [0-9]* t_ms=[0-9]*" "$dir.err" | head -1)
  [[ -n "$fault_line" ]] || { fail "the fault was not injected: $(tail -3 "$dir.err")"; return; }
  local t_fault=${fault_line##*t_ms=}
  if [[ $sig == KILL ]]; then
    grep -aq "ShardTrain launcher: rank $frank (pid [0-9]*) was killed by signal 9" "$dir.err" ||
      fail "the launcher did not name rank $frank"
  fi
  local detected; detected=$(grep -ao "DETECTED rank $survivor t_ms=[0-9]* error: .*" "$dir.err" | head -1)
  if [[ $how == trainer && $sig == KILL ]]; then
    # Rank 0 is the launcher: its monitor names the dead rank and ends the job at once.
    local named; named=$(grep -an "ShardTrain launcher: rank $frank" "$dir.err" | head -1)
    echo "TIME $CASE detect_ms=launcher exit_ms=$(( t_end - t_fault )) case_ms=$(( t_end - t0 ))"
    echo "  $named" | cut -c1-300
  elif [[ -z "$detected" ]]; then
    fail "rank $survivor printed no error"
  else
    local t_det=${detected#*t_ms=}; t_det=${t_det%% *}
    grep -qE "^DETECTED rank $survivor .*rank $frank" <<< "$detected" || fail "rank $survivor's error does not name rank $frank: $detected"
    grep -qiE "^DETECTED rank $survivor .*(all_?gather|reduce_?scatter|all_?reduce|broadcast|barrier|all_?to_?all)" <<< "$detected" ||
      fail "rank $survivor's error names no collective: $detected"
    echo "TIME $CASE detect_ms=$(( t_det - t_fault )) exit_ms=$(( t_end - t_fault )) case_ms=$(( t_end - t0 ))"
    # A stopped rank must not sit out the launcher's 5 s grace: it gets SIGCONT with its SIGTERM.
    [[ $sig != STOP || $(( t_end - t_fault )) -lt 7500 ]] ||
      fail "the job ended $(( t_end - t_fault )) ms after the SIGSTOP (stall timeout 3 s; the stopped rank waited for SIGKILL?)"
    echo "  $detected" | cut -c1-400
  fi
  local shm_after; shm_after=$(shm_segments)
  if [[ "$shm_after" != "$shm_before" ]]; then
    sleep 1  # another job's segments live only while its ranks connect
    local new; new=$(comm -13 <(echo "$shm_before") <(shm_segments))
    [[ -z "$new" ]] || fail "/dev/shm segments left: $new"
  fi
  local tmps; tmps=$(temporaries "$dir")
  if [[ $frank -eq 0 && $point == save && $sig == KILL ]]; then
    [[ -n "$tmps" ]] || fail "expected the killed writer's temporary file (the case would not test its removal)"
  elif [[ $how == trainer ]]; then
    :  # the launcher (rank 0) ends at once, also in the middle of a save: the next start removes what it left
  else
    [[ -z "$tmps" ]] || fail "temporary files left: $tmps"
  fi
  # Resume from the newest complete checkpoint.
  local last_ckpt; last_ckpt=$(ls -t "$dir"/lightning_logs/version_0/checkpoints/ 2>/dev/null | grep -v '^\.' | head -1)
  "$WORKER" "$dir" 6 auto "$format" > "$dir.resumed.out" 2> "$dir.resumed.err" ||
    { fail "resume failed: $(tail -3 "$dir.resumed.err")"; return; }
  local first; first=$(grep -a '^step ' "$dir.resumed.out" | head -1 | awk '{print $2}')
  local want=$(( ${last_ckpt//[^0-9]/} + 1 ))
  [[ "$first" == "$want" ]] || fail "resumed at step $first; newest complete checkpoint $last_ckpt"
  same_losses "$dir.resumed.out"
  [[ $(grep -a '^step ' "$dir.resumed.out" | tail -1 | awk '{print $2}') == 6 ]] || fail "resumed run did not reach step 6"
  tmps=$(temporaries "$dir")
  [[ -z "$tmps" ]] || fail "temporary files left after the resume: $tmps"
  if [[ $frank -eq 0 && $point == save && $sig == KILL ]]; then
    grep -aq "left by a save that was killed" "$dir.resumed.err" || fail "the resume did not report removing the temporary"
  fi
  echo "$CASE: resumed after $last_ckpt at step $first; $(( $(now_ms) - t0 )) ms in all"
}

for sig in KILL STOP; do
  lower=$(tr 'A-Z' 'a-z' <<< "$sig")
  fault_case "${lower}_forward" forward "$sig" 1 3 full
  fault_case "${lower}_backward" backward "$sig" 1 3 full
  fault_case "${lower}_optimizer" optimizer "$sig" 1 3 full
  fault_case "${lower}_save_full" save "$sig" 1 4 full
  fault_case "${lower}_save_sharded" save "$sig" 1 4 sharded
done
fault_case kill_rank0_save_full save KILL 0 4 full
fault_case kill_forward_trainer_launcher forward KILL 1 3 full trainer

echo "all cases: $(( $(now_ms) - T0 )) ms"
if [[ $FAILURES -ne 0 ]]; then
  for f in "$OUT"/*.err; do echo "--- $f"; tail -15 "$f"; done
  echo "$FAILURES failure(s)"; exit 1
fi
echo "all fault cases passed"
