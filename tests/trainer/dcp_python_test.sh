#!/usr/bin/env bash
# PyTorch's DCP (the pinned torch) reads the DCP directory
# trainer/checkpoint_io/dcp.h writes, and dcp.h reads one that two Gloo ranks
# of PyTorch wrote with DTensor shards (dim 0 uneven, dim 1) and values.
set -euo pipefail
fixture="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/dcp_python"
rm -rf "$tmp"; mkdir -p "$tmp/ours" "$tmp/theirs"
"$fixture" write "$tmp/ours" "$tmp/ours_expected.pt"
pyrun "$checker" check "$tmp/ours" "$tmp/ours_expected.pt" || fail "PyTorch could not read ShardTrain's DCP directory"
pyrun "$checker" write "$tmp/theirs" "$tmp/theirs_expected.pt" || fail "PyTorch could not write the DCP directory"
"$fixture" read "$tmp/theirs" "$tmp/theirs_expected.pt" || fail "ShardTrain could not read PyTorch's DCP directory"
echo PASS
