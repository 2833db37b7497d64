#!/usr/bin/env bash
# The skip rule (tests/testing/skip.h, tests/cluster/lib.sh): a test that
# lacks something of the machine skips and passes on a developer's machine,
# and fails under CI=true, where every test must run.
set -uo pipefail
probe="$1"; lib="$2"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
out="${TEST_TMPDIR:-$(mktemp -d)}"

# C++: ST_SKIP_UNLESS_CI.
env -u CI -u XML_OUTPUT_FILE -u TEST_PREMATURE_EXIT_FILE "$probe" >"$out/dev.log" 2>&1 || fail "without CI the probe must pass (skipped): $(tail -3 "$out/dev.log")"
grep -q "SKIPPED" "$out/dev.log" || fail "without CI the probe must say it skipped"
grep -q "the probe's tool is missing" "$out/dev.log" || fail "the skip must give its reason"
if env -u XML_OUTPUT_FILE -u TEST_PREMATURE_EXIT_FILE CI=true "$probe" >"$out/ci.log" 2>&1; then fail "under CI=true the probe must fail"; fi
grep -q "CI=true: this test would be skipped" "$out/ci.log" || fail "under CI the failure must say why: $(tail -3 "$out/ci.log")"
grep -q "the probe's tool is missing" "$out/ci.log" || fail "under CI the failure must give the reason too"

# Shell: cluster_skip_unless_possible, with a hosts.sh that cannot make hosts.
fake="$out/fake_hosts.sh"
printf '#!/usr/bin/env bash\necho "skipped: no namespaces (probe)"; exit 3\n' >"$fake"; chmod +x "$fake"
cluster_skip() {  # sources lib.sh as a cluster test does, then asks to skip
  bash -c 'source "$1" skip_probe; HOSTS_SH="$2"; cluster_skip_unless_possible; echo RAN' _ "$lib" "$fake" 2>&1
}
dev="$(unset CI XML_OUTPUT_FILE; cluster_skip)"; rc=$?
[[ $rc -eq 0 && "$dev" == *"SKIPPED skip_probe: no namespaces (probe)"* && "$dev" != *RAN* ]] ||
  fail "without CI the cluster skip must exit 0 before the test runs (rc $rc): $dev"
ci="$(export CI=true; unset XML_OUTPUT_FILE; cluster_skip)"; rc=$?
[[ $rc -ne 0 && "$ci" == *"CI=true: this test would be skipped (no namespaces (probe))"* && "$ci" != *RAN* ]] ||
  fail "under CI the cluster skip must fail and say why (rc $rc): $ci"

((failures == 0)) && echo "skip rule: skips here, fails under CI (C++ and cluster tests)"
exit $((failures > 0))
