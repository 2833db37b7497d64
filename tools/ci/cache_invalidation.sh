#!/usr/bin/env bash
# Checks that the remote cache's keys change with what the outputs depend on but
# Bazel does not hash (tools/ci/build_identity.sh), so a new compiler, LibTorch
# build or CUDA toolkit gives misses, never stale hits:
#   tools/ci/cache_invalidation.sh URL [OUTPUT_BASE] [TARGET]
# In an output base that has built TARGET (default //base:logging, one compile and
# one archive) with the remote cache at URL (as .ci/run's first build does), it
# rebuilds TARGET with, in turn,
#   SHARDTRAIN_CC_ID changed          (a compiler/linker/C library update)
#   SHARDTRAIN_TORCH_STAMP changed    (another LibTorch build)
#   SHARDTRAIN_CUDA_ID changed        (another CUDA toolkit)
# each to a value never seen before, and requires that no action was a remote
# cache hit and at least one ran; results of these runs are not uploaded. After
# each, with the real values again, every action must be a remote cache hit
# (which shows that hits are seen at all). Before that it checks that the values
# follow their sources: a compiler reporting another version ($CC) and a LibTorch
# with another version.py ($LIBTORCH_HOME) give other identities.
set -euo pipefail
URL="${1:?usage: $0 REMOTE_CACHE_URL [OUTPUT_BASE] [TARGET]}"
OB="${2:-}"
TARGET="${3:-//base:logging}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BAZEL="${BAZEL_REAL:-$(command -v bazel-4 || echo /usr/bin/bazel-4)}"
say() { echo "[cache_invalidation] $*"; }
die() { echo "[cache_invalidation] FAIL: $*" >&2; exit 1; }
cd "$ROOT"
"$ROOT/tools/bootstrap.sh"
# shellcheck source=tools/ci/build_identity.sh
source "$ROOT/tools/ci/build_identity.sh"
shardtrain_build_identity "$ROOT"
startup=(); [[ -n "$OB" ]] && startup=(--output_base="$OB")
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

# build NAME EXPECT [VAR=VALUE] [bazel flags...]: EXPECT is "hits", "misses" or "any".
build() {
  local name="$1" expect="$2"; shift 2
  local envs=() flags=()
  for a in "$@"; do if [[ "$a" == SHARDTRAIN_*=* ]]; then envs+=("$a"); else flags+=("$a"); fi; done
  env "${envs[@]+"${envs[@]}"}" "$BAZEL" "${startup[@]+"${startup[@]}"}" build --config=ci --config=remote \
    --remote_cache="$URL" --disk_cache= "${flags[@]+"${flags[@]}"}" "$TARGET" >"$LOG" 2>&1 \
    || { cat "$LOG" >&2; die "$name: bazel build $TARGET failed"; }
  local line total internal hits ran
  line="$(grep -E '^INFO: [0-9]+ processes?:' "$LOG" | tail -n1 || true)"
  total="$(sed -E 's/^INFO: ([0-9]+) process.*/\1/' <<<"${line:-INFO: 0 processes}")"
  internal="$(grep -oE '[0-9]+ internal' <<<"$line" | grep -oE '^[0-9]+' || echo 0)"
  hits="$(grep -oE '[0-9]+ remote cache hit' <<<"$line" | grep -oE '^[0-9]+' || echo 0)"
  ran=$((total - internal - hits))
  say "$name: ${line:-no actions}"
  if [[ "$expect" == any ]]; then
    :
  elif [[ "$expect" == misses ]]; then
    ((hits == 0 && ran > 0)) || die "$name: expected only misses, got $hits remote cache hits and $ran actions run"
  else
    ((ran == 0 && hits > 0)) || die "$name: expected only remote cache hits, got $hits hits and $ran actions run"
  fi
}

# First, that the identities follow what they describe: a compiler that reports
# another version and a LibTorch with another version.py give other values.
scratch="$(mktemp -d)"
trap 'rm -f "$LOG"; rm -rf "$scratch"' EXIT
printf '#!/bin/sh\necho "gcc version 99.1.0 (not the real one)"\n' >"$scratch/cc"
chmod +x "$scratch/cc"
mkdir -p "$scratch/torch/include" "$scratch/torch/lib"
echo "__version__ = '9.9.9+changed'" >"$scratch/torch/version.py"
other_cc="$(CC="$scratch/cc" bash -c 'source "$1"; shardtrain_build_identity "$2"; echo "$SHARDTRAIN_CC_ID"' _ "$ROOT/tools/ci/build_identity.sh" "$ROOT")"
other_torch="$(LIBTORCH_HOME="$scratch/torch" bash -c 'source "$1"; shardtrain_build_identity "$2"; echo "$SHARDTRAIN_TORCH_STAMP"' _ "$ROOT/tools/ci/build_identity.sh" "$ROOT")"
[[ "$other_cc" != "$SHARDTRAIN_CC_ID" ]] || die "SHARDTRAIN_CC_ID did not change with a compiler that reports another version ('$other_cc')"
[[ "$other_torch" != "$SHARDTRAIN_TORCH_STAMP" ]] || die "SHARDTRAIN_TORCH_STAMP did not change with another LibTorch version.py ('$other_torch')"
say "identities follow their sources: another gcc version gives SHARDTRAIN_CC_ID '$other_cc', another torch version.py gives SHARDTRAIN_TORCH_STAMP $other_torch (real: $SHARDTRAIN_TORCH_STAMP)"

new="changed $(date +%s%N)"
build "baseline (real values)" any
build "compiler changed" misses "SHARDTRAIN_CC_ID=$SHARDTRAIN_CC_ID $new" --remote_upload_local_results=false
build "compiler restored" hits
build "LibTorch changed" misses "SHARDTRAIN_TORCH_STAMP=$new" --remote_upload_local_results=false
build "LibTorch restored" hits
build "CUDA changed" misses "SHARDTRAIN_CUDA_ID=$SHARDTRAIN_CUDA_ID $new" --remote_upload_local_results=false
build "CUDA restored" hits
say "PASS: each identity change gave misses, each restore gave remote cache hits"
