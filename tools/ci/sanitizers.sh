#!/usr/bin/env bash
# Sanitizer runs of the comm and sharding tests (docs/reliability.md, "Bad input,
# fuzzing and sanitizers"):
#
#   tools/ci/sanitizers.sh [asan|tsan|fuzz|all] [-- BAZEL TARGETS...]
#
#   asan  (default) --config=asan (AddressSanitizer + UndefinedBehaviorSanitizer) on
#         //tests/comm/... and //tests/sharding/...
#   tsan  --config=tsan on //tests/comm:gloo_communicator_test (see the docs for why
#         no more: LibTorch and Gloo are not instrumented)
#   fuzz  tools/fuzz/run_checkpoint_fuzzer.sh for $SHARDTRAIN_FUZZ_SECONDS (60)
#   all   asan, then fuzz
#
# LibTorch, Gloo and the other prebuilt libraries are not instrumented. The
# suppression files in tools/ci/sanitizers/ hold only third-party entries, each
# with its reason; Bazel gets them by absolute path (a test's environment
# cannot name a workspace-relative file). Each step prints its wall time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
MODE="${1:-asan}"
shift || true
[[ "${1:-}" == "--" ]] && shift
SUPP="$ROOT/tools/ci/sanitizers"

timed() {
  local t0=$SECONDS
  echo "+ $*"
  "$@"
  echo "<== [sanitizers] ok in $((SECONDS - t0)) s: $1 ${2:-} ${3:-} ${4:-}"
}

run_asan() {
  local targets=("$@")
  ((${#targets[@]})) || targets=(//tests/comm/... //tests/sharding/...)
  timed tools/bazel test --config=ci --config=asan \
    --test_env=ASAN_OPTIONS=detect_leaks=1:suppressions="$SUPP/asan.supp" \
    --test_env=LSAN_OPTIONS=suppressions="$SUPP/lsan.supp":print_suppressions=0 \
    --test_env=UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions="$SUPP/ubsan.supp" \
    "${targets[@]}"
}

run_tsan() {
  local targets=("$@")
  ((${#targets[@]})) || targets=(//tests/comm:gloo_communicator_test)
  timed tools/bazel test --config=ci --config=tsan \
    --test_env=TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions="$SUPP/tsan.supp" \
    "${targets[@]}"
}

case "$MODE" in
  asan) run_asan "$@" ;;
  tsan) run_tsan "$@" ;;
  fuzz) timed tools/fuzz/run_checkpoint_fuzzer.sh "${SHARDTRAIN_FUZZ_SECONDS:-60}" ;;
  all)
    run_asan
    timed tools/fuzz/run_checkpoint_fuzzer.sh "${SHARDTRAIN_FUZZ_SECONDS:-60}"
    ;;
  *) echo "usage: tools/ci/sanitizers.sh [asan|tsan|fuzz|all] [-- TARGETS...]" >&2; exit 2 ;;
esac
