#!/usr/bin/env bash
# Consumer-workspace test: proves that another Bazel workspace can depend on
# ShardTrain and link only the communication layer, or the trainer with one
# FSDP flavour (fsdp_native) and not the other (fsdp).
#
# It writes a scratch workspace under $TEST_TMPDIR (outside the repository) that
#   - declares `local_repository(name = "shardtrain", path = <this checkout>)`,
#   - loads @shardtrain//third_party:deps.bzl and calls shardtrain_dependencies(),
#   - has one cc_binary, //:consumer, depending only on @shardtrain//:comm,
#     @shardtrain//:gloo and @shardtrain//:rendezvous,
#   - and a second, //:consumer_trainer, depending on
#     @shardtrain//strategies/fsdp_native and @shardtrain//trainer,
# then, with a nested Bazel, checks that neither //:consumer nor
# @shardtrain//comm/... depends on anything under strategies/ or trainer/,
# that //:consumer_trainer has no @shardtrain//strategies/fsdp: label, builds
# and runs //:consumer (a 1-rank Gloo all-gather) and analyses
# //:consumer_trainer (`build --nobuild`: every label, visibility and
# repository resolves from the consumer's side). Compiling the trainer a
# second time, under external/shardtrain, took ~400 s of a cold CI and proves
# little more: //tests/consumer:fsdp_native_only_test builds that same graph
# in this workspace and runs it (fsdp_native registered, fsdp not, a fit).
#
# The nested Bazel keeps its output bases under ~/.cache/shardtrain/consumer and
# shares ShardTrain's disk cache (~/.cache/shardtrain/bazel-disk), so a rerun
# only recompiles what changed.
set -euo pipefail

say() { echo "[consumer_test] $*"; }
fail() { echo "[consumer_test] FAIL: $*" >&2; exit 1; }

# --- Where things are -------------------------------------------------------
RUNFILES="${RUNFILES_DIR:-${TEST_SRCDIR:-$0.runfiles}}"
rlocation() {  # rlocation shardtrain/<path>: a runfile's real path
  local p="$RUNFILES/$1"
  if [[ -e "$p" ]]; then readlink -f "$p"; return; fi
  if [[ -n "${RUNFILES_MANIFEST_FILE:-}" ]]; then
    local hit; hit="$(grep -m1 "^$1 " "$RUNFILES_MANIFEST_FILE" | cut -d' ' -f2-)"
    [[ -n "$hit" ]] && { readlink -f "$hit"; return; }
  fi
  fail "runfile $1 not found"
}
WS_NAME="${TEST_WORKSPACE:-shardtrain}"
DEPS_BZL="$(rlocation "$WS_NAME/third_party/deps.bzl")"
MAIN_CC="$(rlocation "$WS_NAME/tests/consumer/consumer_main.cc")"
TRAINER_CC="$(rlocation "$WS_NAME/tests/consumer/consumer_trainer_main.cc")"
# The checkout itself: runfiles are symlinks into the source tree.
SHARDTRAIN="$(cd "$(dirname "$DEPS_BZL")/.." && pwd -P)"
[[ -f "$SHARDTRAIN/WORKSPACE" && -f "$SHARDTRAIN/comm/BUILD.bazel" ]] || fail "$SHARDTRAIN is not a ShardTrain checkout"

BAZEL="${BAZEL_REAL:-$(command -v bazel-4 || true)}"
[[ -x "$BAZEL" ]] || fail "no Bazel 4 binary (set BAZEL_REAL or install bazel-bootstrap)"

HOME_DIR="${HOME:-}"
[[ -n "$HOME_DIR" && -d "$HOME_DIR" && -w "$HOME_DIR" ]] || HOME_DIR="$TEST_TMPDIR/home"
mkdir -p "$HOME_DIR"
CACHE="$HOME_DIR/.cache/shardtrain"  # as in .bazelrc (~/.cache/shardtrain)
mkdir -p "$CACHE/consumer" "$CACHE/bazel-disk"

WS="$TEST_TMPDIR/consumer_ws"
rm -rf "$WS"
mkdir -p "$WS"
say "ShardTrain checkout: $SHARDTRAIN"
say "scratch workspace:   $WS"
say "bazel:               $BAZEL"

# --- The consumer workspace ---------------------------------------------------
cat >"$WS/WORKSPACE" <<EOF
workspace(name = "consumer")

local_repository(
    name = "shardtrain",
    path = "$SHARDTRAIN",
)

load("@shardtrain//third_party:deps.bzl", "shardtrain_dependencies")

shardtrain_dependencies()
EOF

cat >"$WS/BUILD.bazel" <<'EOF'
cc_binary(
    name = "consumer",
    srcs = ["main.cc"],
    deps = [
        "@shardtrain//:comm",
        "@shardtrain//:gloo",
        "@shardtrain//:rendezvous",
    ],
)

cc_binary(
    name = "consumer_trainer",
    srcs = ["trainer_main.cc"],
    deps = [
        "@shardtrain//strategies/fsdp_native",
        "@shardtrain//trainer",
    ],
)
EOF

cp "$MAIN_CC" "$WS/main.cc"
cp "$TRAINER_CC" "$WS/trainer_main.cc"

# What a consumer needs from ShardTrain's .bazelrc: C++20, no sandbox (LibTorch
# has ~10k headers), strict action env.
cat >"$WS/.bazelrc" <<EOF
build --cxxopt=-std=c++20 --host_cxxopt=-std=c++20
build --spawn_strategy=local
build --incompatible_strict_action_env --action_env=PATH=/usr/local/bin:/usr/bin:/bin
build --copt=-O2 --copt=-g0 --strip=always
build --disk_cache=$CACHE/bazel-disk
build --curses=no --color=no --show_progress_rate_limit=30
EOF

# --- Nested Bazel --------------------------------------------------------------
# A clean environment: nothing of the outer test (TEST_TMPDIR would otherwise
# become the nested Bazel's output root) leaks in; LibTorch/CUDA overrides do.
ENV=(env -i "HOME=$HOME_DIR" "PATH=/usr/local/bin:/usr/bin:/bin" "USER=${USER:-$(id -un)}")
for v in LIBTORCH_HOME CUDA_HOME NCCL_HOME SHARDTRAIN_TORCH_STAMP JAVA_HOME; do
  [[ -n "${!v:-}" ]] && ENV+=("$v=${!v}")
done
# The system rc stays: Debian's Bazel finds its install base through it.
STARTUP=(--nohome_rc "--output_user_root=$CACHE/consumer" --max_idle_secs=60)
nested() { (cd "$WS" && "${ENV[@]}" "$BAZEL" "${STARTUP[@]}" "$@"); }
trap 'nested shutdown >/dev/null 2>&1 || true' EXIT

check_no_heavy_deps() {  # $1: query expression
  local out="$TEST_TMPDIR/query.txt"
  say "bazel query '$1'"
  nested query --noshow_progress "$1" >"$out" || fail "bazel query '$1' failed"
  local n; n="$(wc -l <"$out")"
  [[ "$n" -gt 0 ]] || fail "bazel query '$1' returned nothing"
  if grep -E '^@shardtrain//(strategies|trainer)[/:]' "$out"; then
    fail "'$1' pulls in the labels above from strategies/ or trainer/"
  fi
  grep -q '^@shardtrain//comm:' "$out" || fail "'$1' has no @shardtrain//comm targets"
  say "  $n targets, none from @shardtrain//strategies or @shardtrain//trainer"
}

check_no_heavy_deps 'deps(//:consumer)'
check_no_heavy_deps 'deps(@shardtrain//comm/...)'

# The trainer with fsdp_native only: strategies/fsdp must not be in the graph.
q='deps(//:consumer_trainer)'
say "bazel query '$q'"
nested query --noshow_progress "$q" >"$TEST_TMPDIR/query_trainer.txt" || fail "bazel query '$q' failed"
grep -q '^@shardtrain//strategies/fsdp_native:fsdp_native$' "$TEST_TMPDIR/query_trainer.txt" ||
  fail "'$q' lacks @shardtrain//strategies/fsdp_native"
grep -q '^@shardtrain//trainer:trainer$' "$TEST_TMPDIR/query_trainer.txt" || fail "'$q' lacks @shardtrain//trainer"
if grep -E '^@shardtrain//strategies/fsdp:' "$TEST_TMPDIR/query_trainer.txt"; then
  fail "'$q' pulls in the labels above from @shardtrain//strategies/fsdp"
fi
say "  $(wc -l <"$TEST_TMPDIR/query_trainer.txt") targets, none from @shardtrain//strategies/fsdp"

say "bazel build //:consumer"
nested build //:consumer || fail "building //:consumer failed"

say "running //:consumer"
out="$("$WS/bazel-bin/consumer")" || fail "//:consumer exited with $?"
echo "$out"
[[ "$out" == "consumer: gloo all_gather over 1 rank -> 1 2 3" ]] || fail "unexpected output: $out"

say "bazel build --nobuild //:consumer_trainer (analysis only; fsdp_native_only_test builds and runs it)"
nested build --nobuild //:consumer_trainer || fail "analysing //:consumer_trainer failed"
say "PASS"
