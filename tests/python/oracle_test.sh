#!/usr/bin/env bash
# Sharded training (ShardTrain, FULL_SHARD, W=2) against plain training in
# Python PyTorch from the pinned torch, on the same weights and batches.
# Python is the one whose torch Bazel links (LIBTORCH_LIB_DIR in @libtorch//:defs.bzl),
# or $SHARDTRAIN_PYTHON.
set -euo pipefail
dump="$1"; script="$2"; defs="$3"
libdir="$(sed -n 's/^LIBTORCH_LIB_DIR = "\(.*\)"$/\1/p' "$defs")"
python="${SHARDTRAIN_PYTHON:-$(cd "$libdir/../../../../.." 2>/dev/null && pwd)/bin/python}"
if [[ ! -x "$python" ]] || ! "$python" -c "import torch" 2>/dev/null; then
  echo "FAIL: no Python with torch at $python (LibTorch at $libdir); run tools/bootstrap.sh or set SHARDTRAIN_PYTHON" >&2
  exit 1
fi
out="${TEST_TMPDIR:-/tmp}/oracle.pt"
"$dump" "$out" 20
"$python" "$script" "$out"
