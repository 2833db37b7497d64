#!/usr/bin/env bash
# Python's torch.load(path, weights_only=True) reads an archive that
# trainer/checkpoint_io/archive.h's ArchiveWriter streamed (archive_test write <path>).
set -euo pipefail
writer="$1"; checker="$2"; defs="$3"
fail() { echo "FAIL: $*" >&2; exit 1; }
libdir="$(sed -n 's/^LIBTORCH_LIB_DIR = "\(.*\)"$/\1/p' "$defs")"
python="${SHARDTRAIN_PYTHON:-$(cd "$libdir/../../../../.." 2>/dev/null && pwd)/bin/python}"
[[ -x "$python" ]] && "$python" -c "import torch" 2>/dev/null || fail "no Python with torch at $python; set SHARDTRAIN_PYTHON"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/archive_python"
rm -rf "$tmp"; mkdir -p "$tmp"
"$writer" write "$tmp/a.pt"
"$python" "$checker" "$tmp/a.pt" || fail "Python could not read the archive"
echo PASS
