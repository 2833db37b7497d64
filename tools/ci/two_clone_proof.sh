#!/usr/bin/env bash
# The two-clone proof that builds share a remote cache across checkouts (.ci/run
# runs it right after this checkout's own `//...` build and test, which filled the
# cache at URL):
#   tools/ci/two_clone_proof.sh URL [MIN_PERCENT]
# It copies this checkout's files (tracked and untracked-but-not-ignored, as git
# sees them) to a second clone at another absolute path, whose .deps is a link
# to this one's (so LibTorch is found through another path too), and there runs
#   tools/bazel --output_base=<new> test --config=ci --config=remote \
#     --remote_cache=URL --disk_cache= --test_tag_filters=-exclusive,-local //...
# with a fresh output base and no disk cache. It passes when at least MIN_PERCENT
# (default 99) of the spawned actions (Bazel's "N processes: ..." summary, less
# its "internal" ones) were remote cache hits and every test ran was "(cached)".
# Tests tagged exclusive or local are left out: Bazel 4 runs them locally and never
# takes their results from a cache (the consumer test's nested Bazel, the Python
# oracle tests, the examples' result runs); the first build already ran them.
# With SHARDTRAIN_PROOF_EXEC_LOG=1 it writes --execution_log_json_file (about 1 MB
# per action: every compile lists LibTorch's ~10k headers) and, on failure, lists
# the actions that missed; diff such an entry's inputs, environment and arguments
# against an execution log of the same build in the first clone to find the path
# or value that differs. SHARDTRAIN_PROOF_KEEP=1 keeps the scratch dir;
# SHARDTRAIN_CI_TARGETS (default //...) narrows the targets, as in .ci/run.
set -euo pipefail
URL="${1:?usage: $0 REMOTE_CACHE_URL [MIN_PERCENT]}"
MIN="${2:-99}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BAZEL="${BAZEL_REAL:-$(command -v bazel-4 || echo /usr/bin/bazel-4)}"
say() { echo "[two_clone_proof] $*"; }
die() { echo "[two_clone_proof] FAIL: $*" >&2; exit 1; }

git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1 || die "$ROOT is not a git checkout; the proof copies the files git lists"
[[ -e "$ROOT/.deps/venv" ]] || die "no $ROOT/.deps/venv: run tools/bootstrap.sh first"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/shardtrain-proof.XXXXXX")"
B="$SCRATCH/another/path/ShardTrain-b"
OB="$SCRATCH/output_base"
cleanup() {
  "$BAZEL" --output_base="$OB" shutdown >/dev/null 2>&1 || true
  if [[ "${SHARDTRAIN_PROOF_KEEP:-0}" != 1 ]]; then chmod -R u+w "$SCRATCH" 2>/dev/null; rm -rf "$SCRATCH"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # a cancelled CI also shuts clone B's Bazel down and removes the scratch dir

mkdir -p "$B"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -c) | tar -x -C "$B"
rm -f "$B/.deps"  # a link that git lists (.gitignore names the directory)
ln -s "$ROOT/.deps" "$B/.deps"
say "clone A: $ROOT"
say "clone B: $B (output base $OB, .deps -> $ROOT/.deps)"

LOG="$SCRATCH/b.log"
EXEC_LOG="$SCRATCH/b.exec.json"
t0=$SECONDS
set +e
exec_log=(); [[ "${SHARDTRAIN_PROOF_EXEC_LOG:-0}" == 1 ]] && exec_log=(--execution_log_json_file="$EXEC_LOG")
"$B/tools/bazel" --output_base="$OB" test --config=ci --config=remote --remote_cache="$URL" --disk_cache= \
  --test_tag_filters=-exclusive,-local --test_summary=short "${exec_log[@]+"${exec_log[@]}"}" \
  -- ${SHARDTRAIN_CI_TARGETS:-//...} 2>&1 | tee "$LOG"  # `--`: negative patterns (-//x) are targets
rc=${PIPESTATUS[0]}
set -e
say "clone B's build and test took $((SECONDS - t0)) s (exit $rc)"
((rc == 0)) || die "clone B's 'bazel test ${SHARDTRAIN_CI_TARGETS:-//...}' failed (exit $rc)"

# "INFO: 812 processes: 20 internal, 792 remote cache hit." (one line per command)
line="$(grep -E '^INFO: [0-9]+ processes?:' "$LOG" | tail -n1)"
[[ -n "$line" ]] || die "no 'INFO: N processes: ...' line in clone B's output ($LOG)"
total="$(sed -E 's/^INFO: ([0-9]+) process.*/\1/' <<<"$line")"
count() { grep -oE "[0-9]+ $1" <<<"$line" | grep -oE '^[0-9]+' || echo 0; }
internal="$(count internal)"
hits="$(count 'remote cache hit')"
spawned=$((total - internal))
say "actions: $line"
((spawned > 0)) || die "clone B spawned no action (a fresh output base always does): is the output base really new?"
if ((hits * 100 < MIN * spawned)); then
  [[ -f "$EXEC_LOG" ]] || say "rerun with SHARDTRAIN_PROOF_EXEC_LOG=1 SHARDTRAIN_PROOF_KEEP=1 to list the actions that missed"
  [[ -f "$EXEC_LOG" ]] && say "actions that did not come from the remote cache (execution log $EXEC_LOG):"
  [[ -f "$EXEC_LOG" ]] && python3 - "$EXEC_LOG" <<'PY' || true
import json, sys
text = open(sys.argv[1]).read()
dec, i, n = json.JSONDecoder(), 0, 0
while True:
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        break
    e, i = dec.raw_decode(text, i)
    if not e.get("remoteCacheHit") and e.get("runner") != "remote cache hit":
        n += 1
        print("  %s %s (%s)" % (e.get("mnemonic"), (e.get("listedOutputs") or ["?"])[0], e.get("runner")))
PY
  die "only $hits of $spawned actions came from the remote cache (need >= $MIN%); diff their execution-log entries against a build in $ROOT"
fi
tests="$(grep -cE '^//[^ ]+ +(\(cached\) )?(PASSED|FAILED|FLAKY|TIMEOUT|NO STATUS)' "$LOG" || true)"
cached="$(grep -cE '^//[^ ]+ +\(cached\) PASSED' "$LOG" || true)"
((tests > 0)) || die "clone B ran no test"
if ((cached != tests)); then
  grep -E '^//[^ ]+ +(PASSED|FAILED|FLAKY|TIMEOUT|NO STATUS)' "$LOG" | sed 's/^/  not cached: /' >&2
  die "only $cached of $tests tests came from the remote cache"
fi
say "PASS: $hits of $spawned actions ($((hits * 100 / spawned))%, need >= $MIN%) and $cached of $tests tests came from the remote cache"
echo "$hits $spawned $cached $tests $((SECONDS - t0))" >"${SHARDTRAIN_PROOF_RESULT:-/dev/null}"
