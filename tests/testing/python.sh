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
fail() { echo "FAIL: $*" >&2; exit 1; }
st_libdir="$(sed -n 's/^LIBTORCH_LIB_DIR = "\(.*\)"$/\1/p' "$1")"
python="${SHARDTRAIN_PYTHON:-$(cd "$st_libdir/../../../../.." 2>/dev/null && pwd)/bin/python}"
[[ -x "$python" ]] && "$python" -c "import torch" 2>/dev/null || fail "no Python with torch at $python; set SHARDTRAIN_PYTHON"

skip_without_module() {
  "$python" -c "import $1" 2>/dev/null && return 0
  local why="no $1 in $python (tools/bootstrap.sh installs it)"
  [[ "${CI:-}" == "true" ]] && fail "CI=true: this test would be skipped ($why)"
  echo "SKIPPED $2: $why"
  if [[ -n "${XML_OUTPUT_FILE:-}" ]]; then
    printf '<?xml version="1.0" encoding="UTF-8"?>\n<testsuites tests="1" failures="0" errors="0" skipped="1"><testsuite name="%s" tests="1" failures="0" errors="0" skipped="1"><testcase name="%s"><skipped message="%s"/></testcase></testsuite></testsuites>\n' "$2" "$2" "$why" >"$XML_OUTPUT_FILE"
  fi
  exit 0
}
