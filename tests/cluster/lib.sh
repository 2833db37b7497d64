# Shared by the tests in tests/cluster (source it): paths, the skip rule,
# the cluster's life (up, clean-up on every exit), /dev/shm leak checks, and
# failure bookkeeping.
#
#   source lib.sh NAME         NAME: the test's name (messages, XML)
#   cluster_skip_unless_possible   prints "skipped: <reason>" and exits 0 when
#                              namespace hosts cannot be made here
#   cluster_start N            makes h0..h(N-1); removes them on any exit
#   on_exit CMD                runs CMD (before the hosts go) on any exit
#   H run|addr|... ARGS        hosts.sh with the cluster's state
#   fail MSG / finish          count a failure / exit 1 if any, else 0

TEST_NAME="$1"
export PATH="$PATH:/usr/sbin:/sbin"  # ip, munged, slurmctld, slurmd (Bazel's test PATH has no sbin)
CLUSTER_DIR="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
REPO_ROOT="$(cd "$CLUSTER_DIR/../.." && pwd)"
HOSTS_SH="$CLUSTER_DIR/hosts.sh"
TORCHRUN="${SHARDTRAIN_TORCHRUN:-$REPO_ROOT/.deps/venv/bin/torchrun}"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/$TEST_NAME"
rm -rf "$OUT"; mkdir -p "$OUT"
FAILURES=0
T0=$SECONDS
export OMP_NUM_THREADS=1

abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }
fail() { echo "FAIL [$TEST_NAME]: $*" >&2; FAILURES=$((FAILURES + 1)); }
die() { echo "$TEST_NAME: $*" >&2; exit 1; }
H() { "$HOSTS_SH" "$@"; }
elapsed() { echo $((SECONDS - T0)); }

# Bazel 4 counts a test that exits 0 as passed, and has no run-time "skipped"
# status; the reason goes to stdout in capitals and into the XML report as
# <skipped>, which newer Bazel (8+) and CI report readers count as skipped.
# Under CI=true (.ci/run) a skip is a failure: CI's machine is set up for
# every test, so a missing privilege or tool there must turn CI red.
cluster_skip_unless_possible() {
  local why
  why="$("$HOSTS_SH" check)" && return 0
  if [[ "${CI:-}" == true ]]; then
    echo "FAIL [$TEST_NAME]: CI=true: this test would be skipped (${why#skipped: }), and CI counts a skip as a" \
      "failure (its machine is set up for every test)" >&2
    exit 1
  fi
  echo "=================================================================="
  echo "SKIPPED $TEST_NAME: ${why#skipped: }"
  echo "$why"
  echo "=================================================================="
  if [[ -n "${XML_OUTPUT_FILE:-}" ]]; then
    local msg="${why//&/&amp;}"; msg="${msg//\"/&quot;}"; msg="${msg//</&lt;}"; msg="${msg//>/&gt;}"
    cat >"$XML_OUTPUT_FILE" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="1" failures="0" errors="0" skipped="1">
  <testsuite name="$TEST_NAME" tests="1" failures="0" errors="0" skipped="1">
    <testcase name="$TEST_NAME" classname="tests.cluster"><skipped message="$msg"/></testcase>
  </testsuite>
</testsuites>
EOF
  fi
  exit 0
}

# Ends process PID (TERM; KILL after 5 s) and reaps it if it is our child.
stop_pid() {
  local pid="$1" t st
  kill -TERM "$pid" 2>/dev/null
  for ((t = 0; t < 50; ++t)); do
    st="$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)"
    [[ -z "$st" || "$st" == Z ]] && break
    sleep 0.1
  done
  [[ -n "$st" && "$st" != Z ]] && kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return 0
}

EXIT_HOOKS=()
on_exit() { EXIT_HOOKS+=("$*"); }
run_exit_hooks() {
  trap - EXIT INT TERM
  local i
  for ((i = ${#EXIT_HOOKS[@]} - 1; i >= 0; --i)); do eval "${EXIT_HOOKS[$i]}" >/dev/null 2>&1; done
  [[ -n "${SHARDTRAIN_CLUSTER:-}" ]] && "$HOSTS_SH" down
}
trap 'run_exit_hooks' EXIT
trap 'run_exit_hooks; exit 130' INT
trap 'run_exit_hooks; exit 143' TERM

cluster_start() {
  "$HOSTS_SH" gc
  local out
  out="$(SHARDTRAIN_CLUSTER_OWNER=$$ "$HOSTS_SH" up "$1")" || die "hosts.sh up $1 failed"
  export SHARDTRAIN_CLUSTER="${out#SHARDTRAIN_CLUSTER=}"
  CLUSTER_PREFIX="$(sed -n 's/^PREFIX=//p' "$SHARDTRAIN_CLUSTER/cluster")"
}

# /dev/shm entries now (names).
shm_snapshot() { ls -1 /dev/shm 2>/dev/null | sort >"$1"; }
# Entries that are new since snapshot $1, still there after a second, and
# mapped or held open by no process: what a crashed or careless rank leaks.
# (Live segments of other tests running at the same time are mapped.)
shm_leaks() {
  local now="$OUT/shm.now" name leaks=()
  sleep 1
  shm_snapshot "$now"
  for name in $(comm -13 "$1" "$now"); do
    if ! grep -qs "/dev/shm/$name" /proc/[0-9]*/maps 2>/dev/null &&
       ! ls -l /proc/[0-9]*/fd 2>/dev/null | grep -q "/dev/shm/$name"; then
      leaks+=("$name")
    fi
  done
  echo "${leaks[*]}"
}

finish() {
  echo "$TEST_NAME: $(elapsed) s"
  if ((FAILURES)); then echo "$TEST_NAME: $FAILURES failure(s)" >&2; exit 1; fi
  echo "$TEST_NAME: all passed"
  exit 0
}
