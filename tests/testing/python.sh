# Sourced by the shell tests that compare with Python (the pinned torch and
# the packages tools/bootstrap.sh installs beside it in .deps/venv):
#
#   source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
#
# sets $python to the interpreter of the venv whose LibTorch this build links
# (found from @libtorch//:defs.bzl; SHARDTRAIN_PYTHON overrides), or fails
# the test when it has no torch. Defines fail MESSAGE and
# skip_without_module MODULE TEST: when MODULE does not import, the test ends
# as skipped (the reason on stdout and as <skipped> in Bazel's XML report, as
# tests/cluster/lib.sh does), never as passed; under CI=true it fails instead.
# pyserve_start and pyrun run many Python calls in one interpreter (below).
fail() { echo "FAIL: $*" >&2; exit 1; }
st_libdir="$(sed -n 's/^LIBTORCH_LIB_DIR = "\(.*\)"$/\1/p' "$1")"
python="${SHARDTRAIN_PYTHON:-$(cd "$st_libdir/../../../../.." 2>/dev/null && pwd)/bin/python}"
# Whether the interpreter has module $1 (found, not imported: importing torch or
# transformers takes seconds).
has_module() { "$python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
[[ -x "$python" ]] && has_module torch || fail "no Python with torch at $python; set SHARDTRAIN_PYTHON"

skip_without_module() {
  has_module "$1" && return 0
  local why="no $1 in $python (tools/bootstrap.sh installs it)"
  [[ "${CI:-}" == "true" ]] && fail "CI=true: this test would be skipped ($why)"
  echo "SKIPPED $2: $why"
  if [[ -n "${XML_OUTPUT_FILE:-}" ]]; then
    printf '<?xml version="1.0" encoding="UTF-8"?>\n<testsuites tests="1" failures="0" errors="0" skipped="1"><testsuite name="%s" tests="1" failures="0" errors="0" skipped="1"><testcase name="%s"><skipped message="%s"/></testcase></testsuite></testsuites>\n' "$2" "$2" "$why" >"$XML_OUTPUT_FILE"
  fi
  exit 0
}

# pyserve_start starts one interpreter (tests/testing/pyserve.py, which the test
# lists in its data) that then runs each `pyrun SCRIPT ARGS...` as
# `"$python" SCRIPT ARGS...` would: the same stdout, stderr and exit status,
# so torch and transformers are imported once per test, not once per call.
# Call it in the test's own shell (not in $(...)); pyrun works anywhere after.
# It sets the EXIT trap (closing the requests ends the server): a test that
# needs its own EXIT trap calls pyserve_stop from it.
pyserve_start() {
  local server; server="$(dirname "${BASH_SOURCE[0]}")/pyserve.py"
  # The FIFOs' opens below wait for the server: it must be there to start.
  [[ -f "$server" ]] || fail "no $server: list //tests/testing:pyserve.py in the test's data"
  _pyserve_dir="$(mktemp -d "${TEST_TMPDIR:-/tmp}/pyserve.XXXXXX")"
  mkfifo "$_pyserve_dir/in" "$_pyserve_dir/out"
  "$python" "$server" "$_pyserve_dir" 2>>"$_pyserve_dir/server.err" &
  _pyserve_pid=$!
  exec {_pyserve_in}>"$_pyserve_dir/in" {_pyserve_out}<"$_pyserve_dir/out"
  _pyserve_n=0
  trap pyserve_stop EXIT
}
pyserve_stop() {
  [[ -n "${_pyserve_pid:-}" ]] || return 0
  exec {_pyserve_in}>&- {_pyserve_out}<&-
  wait "$_pyserve_pid" 2>/dev/null || true
  _pyserve_pid=""
}
pyrun() {
  [[ -n "${_pyserve_pid:-}" ]] || fail "pyrun $1: call pyserve_start first"
  _pyserve_n=$((_pyserve_n + 1))
  # A call in $(...) or a pipeline runs in a subshell and cannot count for the
  # parent: its number carries the subshell's PID so that none is reused.
  local call="$_pyserve_dir/${BASHPID}_$_pyserve_n" status
  printf '%s\0' "$@" >"$call.args"
  echo "${call##*/}" >&"$_pyserve_in"
  read -r status <&"$_pyserve_out" || status=""
  cat "$call.out" 2>/dev/null
  cat "$call.err" "$_pyserve_dir/server.err" >&2 2>/dev/null
  : >"$_pyserve_dir/server.err"
  [[ -n "$status" ]] || fail "the Python server ended (killed?) before answering: $*"
  return "$status"
}
