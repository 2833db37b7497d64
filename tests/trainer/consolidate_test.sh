#!/usr/bin/env bash
# //tools:consolidate end to end: a sharded checkpoint (W=2, fsdp_native
# state_dict_type=sharded) consolidated into one file equals the full
# checkpoint of the same state (compared in C++ and in Python with torch.load
# and its default weights_only=True, which also reads every sharded file),
# and a broken checkpoint is a clear error that writes nothing.
set -euo pipefail
fixture="$1"; consolidate="$2"; checker="$3"; defs="$4"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"

tmp="${TEST_TMPDIR:-$(mktemp -d)}/consolidate"
rm -rf "$tmp"; mkdir -p "$tmp"
"$fixture" make "$tmp/sharded.ckpt" "$tmp/full.ckpt"
[[ -d "$tmp/sharded.ckpt" && -f "$tmp/sharded.ckpt/.metadata" ]] || fail "no sharded (DCP) checkpoint directory"

"$consolidate" "$tmp/sharded.ckpt" "$tmp/consolidated.ckpt"
"$fixture" compare "$tmp/consolidated.ckpt" "$tmp/full.ckpt" || fail "consolidated != full (C++)"
"$python" "$checker" "$tmp/consolidated.ckpt" "$tmp/full.ckpt" "$tmp/sharded.ckpt" || fail "consolidated != full (Python)"

# A missing shard file: exit status 1, the file named, nothing written.
cp -r "$tmp/sharded.ckpt" "$tmp/broken.ckpt"
rm "$tmp/broken.ckpt/__1_0.distcp"
set +e
err="$("$consolidate" "$tmp/broken.ckpt" "$tmp/out.ckpt" 2>&1)"; rc=$?
set -e
echo "$err"
[[ $rc -eq 1 ]] || fail "exit status $rc for a missing shard file"
[[ "$err" == *"$tmp/broken.ckpt/__1_0.distcp"* ]] || fail "the error does not name the missing file"
[[ ! -e "$tmp/out.ckpt" ]] || fail "a broken checkpoint produced output"
set +e
"$consolidate" >/dev/null 2>&1; rc=$?
set -e
[[ $rc -eq 2 ]] || fail "usage error exit status $rc"
echo PASS
