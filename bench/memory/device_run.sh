#!/usr/bin/env bash
# One-shot memory benchmark on a lent machine (x86-64, 16 cores, 128 GiB, no
# Bazel, no network, a Python 3 with the same torch 2.11 wheel as .deps/venv):
# peak RSS per rank at every phase (construction, step, full save, sharded
# save, full load, sharded load), ShardTrain next to PyTorch FSDP2 + DCP, for
# the ~1B GPT (20 layers, d 2048, 1007.4M parameters) and the 201.7M GPT.
#
# Here (a machine with Bazel):
#   tools/device/prepare_carry.sh [nccl]     # builds into .devcarry/ (ignored by git)
# On the lent machine, in a copy of the working tree, with carry [".devcarry"]:
#   bash bench/memory/device_run.sh          # $OUT receives the results
#
# What it does, in this order, within DEVICE_BUDGET_S seconds (default 480):
#   1. .devcarry/nccl_communicator_test, if present (timeout 120) -> $OUT/nccl_test.log
#   2. a smoke run of memory_bench (a 2-layer model, W=1): if the binary does
#      not start, the error and ldd's view go to progress.log and only the
#      PyTorch side runs; then each side's --mode=self_test (does its peak
#      method see a 256 MiB transient? the answer goes to progress.log);
#   3. the plan DEVICE_PLAN (default "1b:4 1b:2 200m:1 200m:2 200m:4 1b:1"),
#      each entry ShardTrain (train, load_full, load_sharded) then PyTorch;
#      every process gets a timeout from what is left of the budget (at most
#      DEVICE_PROC_CAP_S), so a partial result still comes back; checkpoints are deleted after each
#      entry (1B: ~12 GB full + ~12 GB sharded per implementation).
# $OUT (default ./device-out) receives, rewritten after every process (at most 8 files):
#   progress.log   timestamped progress, machine facts, timings per process
#   results.jsonl  one JSON line per rank and phase (rss_method says how the peak was measured)
#   report.md      the tables of docs/benchmarks.md "Memory at every phase", one per model
#   memory_phases_<size>.png  at the end, where the Python has matplotlib
#   runs.log       stdout/stderr of every process (tail 200 KB each)
#   nccl_test.log  only when the NCCL test was carried
# Knobs: DEVICE_BUDGET_S; DEVICE_PROC_CAP_S (one process's limit, default
# 240, so a hang does not eat the budget); DEVICE_PLAN; DEVICE_SIZES ("small
# mid": the plan's 1b and 200m replaced, for a rehearsal); DEVICE_WORK
# (checkpoint folder; default the roomiest of /tmp, /var/tmp and the tree,
# tmpfs last); DEVCARRY (default ./.devcarry); PYTHON; ST_RSS_SAMPLER=1
# (force the VmRSS sampler on both sides). Rehearse here from a copy of the
# tree outside the repository (no Bazel rpath), e.g.
#   OUT=/tmp/o PYTHON=$PWD/.deps/venv/bin/python3 DEVICE_SIZES="small mid" bash bench/memory/device_run.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/device-out}"
mkdir -p "$OUT"
START=$(date +%s)
BUDGET="${DEVICE_BUDGET_S:-480}"
PROC_CAP="${DEVICE_PROC_CAP_S:-240}"  # the most one process may take (a hang costs no more)
DEADLINE=$((START + BUDGET))
CARRY="$(cd "${DEVCARRY:-$ROOT/.devcarry}" 2>/dev/null && pwd || echo "${DEVCARRY:-$ROOT/.devcarry}")"
PROGRESS="$OUT/progress.log"
RESULTS="$OUT/results.jsonl"
RUNLOG="$OUT/runs.log"
: > "$RESULTS"
: > "$RUNLOG"

log() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - START))s] $*" | tee -a "$PROGRESS" >&2; }
left() { echo $((DEADLINE - $(date +%s))); }
avail_mib() { awk '/^MemAvailable:/ {m = int($2 / 1024)} END {print (m == "" ? 999999 : m)}' /proc/meminfo 2>/dev/null || echo 999999; }

log "device_run.sh: budget ${BUDGET}s; out $OUT; carry $CARRY; looking for python3 with torch"
# --- Python with torch -------------------------------------------------------
PY="" PYINFO=""
for c in ${PYTHON:-} python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python; do
  command -v "$c" >/dev/null 2>&1 || continue
  if PYINFO="$("$c" -c 'import os, sys, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))
print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__)' 2>/dev/null)"; then
    PY="$(command -v "$c")"; break
  fi
done
if [[ -z "$PY" ]]; then
  log "ERROR: no python3 with torch found (tried \$PYTHON, python3, python, /usr/bin, /usr/local/bin, /opt/conda)"
  exit 1
fi
TORCH_LIB="$(head -1 <<< "$PYINFO")"
SITE="$(dirname "$(dirname "$TORCH_LIB")")"
ST_LD="$CARRY/lib:$TORCH_LIB"
for d in "$SITE"/nvidia/*/lib "$SITE"/nvidia/*/lib64; do [[ -d "$d" ]] && ST_LD="$ST_LD:$d"; done
ST_LD="$ST_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$CARRY/lib-fallback"
BIN="$CARRY/bin/memory_bench"
NPROC="$(nproc)"
# Threads per rank: cores / W, set by each side (ShardTrain's launcher, torch_memory.py --threads).
unset OMP_NUM_THREADS MKL_NUM_THREADS
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

# --- checkpoint folder -----------------------------------------------------------
pick_work() {
  local best="" best_kb=0 d kb fs
  for d in /tmp /var/tmp "$ROOT"; do
    [[ -d "$d" && -w "$d" ]] || continue
    kb="$(df -Pk "$d" | awk 'NR==2 {print $4}')"
    fs="$(df -PT "$d" | awk 'NR==2 {print $2}')"
    [[ "$fs" == tmpfs ]] && kb=$((kb / 4))  # in memory: last resort
    if (( kb > best_kb )); then best="$d"; best_kb="$kb"; fi
  done
  echo "$best"
}
WORK="${DEVICE_WORK:-$(pick_work)}/st-membench.$$"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT

log "python $PY; checkpoints under $WORK"
{
  echo "== machine"
  uname -a
  grep -m1 PRETTY_NAME /etc/os-release 2>/dev/null
  ldd --version 2>&1 | head -1
  echo "cores $NPROC"; free -g; df -hT "$WORK" 2>/dev/null
  tail -1 <<< "$PYINFO"
  echo "carry: $(head -2 "$CARRY/MANIFEST" 2>/dev/null | tr '\n' ' ')"
  echo "LD_LIBRARY_PATH for memory_bench: $ST_LD"
  printf 'clear_refs: '; (echo 5 > /proc/self/clear_refs) 2>&1 && echo writable
} >> "$PROGRESS" 2>&1

# --- running one process group with a deadline -------------------------------------
# run_one TIMEOUT_S NAME CMD...: its own process group; killed (the whole group)
# at the timeout or when MemAvailable falls below 2 GiB. Returns its status
# (124: timeout, 137: memory guard).
run_one() {
  local limit="$1" name="$2"; shift 2
  local t0 why="" rc pid tmp="$WORK/run.log"
  t0=$(date +%s)
  setsid "$@" > "$tmp" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if (( $(date +%s) - t0 >= limit )); then why="timeout after ${limit}s"; fi
    if (( $(avail_mib) < 2048 )); then why="MemAvailable < 2 GiB"; fi
    if [[ -n "$why" ]]; then
      kill -TERM -- -"$pid" 2>/dev/null; sleep 3; kill -KILL -- -"$pid" 2>/dev/null
      break
    fi
    sleep 0.5
  done
  wait "$pid"; rc=$?
  [[ "$why" == timeout* ]] && rc=124
  [[ "$why" == MemAvailable* ]] && rc=137
  { echo "===== $name (rc $rc${why:+, $why}, $(($(date +%s) - t0))s)"; tail -c 200000 "$tmp"; } >> "$RUNLOG"
  if [[ -n "$why" ]]; then echo "{\"stopped\": \"$name: $why\"}" >> "$RESULTS"; fi
  log "$name: rc $rc${why:+ ($why)} in $(($(date +%s) - t0))s; MemAvailable $(avail_mib) MiB"
  return "$rc"
}

# --- 1. the NCCL test ---------------------------------------------------------------------
if [[ -x "$CARRY/nccl_communicator_test" ]]; then
  log "nccl_communicator_test (timeout 120)"
  timeout -k 5 120 env LD_LIBRARY_PATH="$ST_LD" "$CARRY/nccl_communicator_test" > "$OUT/nccl_test.log" 2>&1
  log "nccl_communicator_test: rc $?"
fi

# --- 2. does memory_bench start? ----------------------------------------------------------
ST_OK=0
if [[ -x "$BIN" ]] && run_one 90 "smoke memory_bench W=1 2-layer" env LD_LIBRARY_PATH="$ST_LD" "$BIN" --mode=train \
    --devices=1 --n_layer=2 --n_embd=64 --n_head=2 --dir="$WORK/smoke" --out="$WORK/smoke.jsonl" --label=smoke; then
  ST_OK=1
  log "memory_bench starts; its peak RSS method: $(grep -o 'vmhwm_clear_refs\|vmrss_sampler_2ms' "$WORK/smoke.jsonl" | head -1)"
else
  log "ERROR: memory_bench does not start ($BIN); ShardTrain rows are skipped, PyTorch rows still run. ldd says:"
  LD_LIBRARY_PATH="$ST_LD" ldd "$BIN" >> "$PROGRESS" 2>&1
  tail -20 "$WORK/run.log" >> "$PROGRESS" 2>/dev/null
fi
rm -rf "$WORK/smoke" "$WORK/smoke.jsonl"
# Does each side's peak method see a 256 MiB transient (freed after 50 ms)?
if [[ "$ST_OK" == 1 ]]; then
  log "self test: $(timeout 60 env LD_LIBRARY_PATH="$ST_LD" "$BIN" --mode=self_test 2>&1 | grep self_test || echo "shardtrain: failed to run")"
fi
log "self test: $(timeout 60 "$PY" bench/memory/torch_memory.py --mode=self_test --dir=. --out=- 2>&1 | grep self_test || echo "pytorch: failed to run")"

# --- 3. the plan ----------------------------------------------------------------------------
model_args() {  # size -> label and flags
  case "$1" in
    1b) echo "gpt-1007.4M --n_layer=20 --n_embd=2048 --n_head=16" ;;
    200m) echo "gpt-201.7M --n_layer=16 --n_embd=1024 --n_head=16" ;;
    mid) echo "gpt-12.7M --n_layer=4 --n_embd=512 --n_head=8" ;;
    small) echo "small --n_layer=2 --n_embd=64 --n_head=2" ;;
    *) return 1 ;;
  esac
}
report() {  # report [final]: the PNGs (when matplotlib is there) only in the final one
  local label size png
  local tmp="$WORK/report.md"
  : > "$tmp"
  for size in 1b 200m mid small; do
    read -r label _ <<< "$(model_args "$size")"
    grep -q "\"model\": *\"$label\"" "$RESULTS" || continue
    read -r _ flags <<< "$(model_args "$size")"
    # shellcheck disable=SC2086
    png=""; [[ "${1:-}" == final ]] && png="$OUT/memory_phases_$size.png"
    "$PY" bench/memory/report.py "$RESULTS" --label="$label" --png="$png" $flags \
      >> "$tmp" 2>> "$PROGRESS"
    echo >> "$tmp"
  done
  cp "$tmp" "$OUT/report.md"
}

PLAN="${DEVICE_PLAN:-1b:4 1b:2 200m:1 200m:2 200m:4 1b:1}"
if [[ -n "${DEVICE_SIZES:-}" ]]; then
  read -r big medium _ <<< "$DEVICE_SIZES"
  PLAN="$(echo "$PLAN" | sed "s/1b:/$big:/g; s/200m:/${medium:-$big}:/g")"
fi
declare -A DONE=() SKIPPED=()
for entry in $PLAN; do
  [[ -n "${DONE[$entry]:-}" ]] && continue
  DONE[$entry]=1
  size="${entry%%:*}"; W="${entry##*:}"
  if ! spec="$(model_args "$size")"; then log "unknown size '$size' in the plan (valid: 1b 200m mid small)"; continue; fi
  read -r label flags <<< "$spec"
  # shellcheck disable=SC2206
  MODEL=($flags)
  for impl in shardtrain pytorch; do
    [[ "$impl" == shardtrain && "$ST_OK" != 1 ]] && continue
    dir="$WORK/$impl-$size-$W"
    mkdir -p "$dir"
    for mode in train load_full load_sharded; do
      remaining=$(($(left) - 5))
      (( remaining > PROC_CAP )) && remaining=$PROC_CAP
      if (( remaining < 15 )); then
        [[ -z "${SKIPPED[$entry]:-}" ]] && log "budget spent: skipping $label W=$W ($impl $mode and what follows)"
        SKIPPED[$entry]=1
        continue
      fi
      if [[ "$mode" != train && ! -e "$dir/$( [[ $impl == shardtrain ]] && echo full.ckpt || echo full.pt)" ]]; then
        log "no checkpoint from the train run: skipping $impl $label W=$W $mode"; continue
      fi
      if [[ "$impl" == shardtrain ]]; then
        run_one "$remaining" "$impl $label W=$W $mode" env LD_LIBRARY_PATH="$ST_LD" "$BIN" --mode="$mode" \
          --devices="$W" --dir="$dir" --out="$RESULTS" --label="$label" "${MODEL[@]}"
      else
        run_one "$remaining" "$impl $label W=$W $mode" "$PY" bench/memory/torch_memory.py --mode="$mode" --world="$W" \
          --threads=$((NPROC / W > 0 ? NPROC / W : 1)) --dir="$dir" --out="$RESULTS" --label="$label" "${MODEL[@]}"
      fi
      [[ "$mode" == train ]] && log "checkpoints: $(du -sh "$dir" 2>/dev/null | cut -f1)"
      report
    done
    rm -rf "$dir"
  done
done
report final
log "done; $(wc -l < "$RESULTS") result lines; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
