#!/usr/bin/env bash
# Python's torch.load(path, weights_only=True) reads an archive that
# trainer/checkpoint_io/archive.h's ArchiveWriter streamed (archive_test write <path>),
# and zipfile verifies the CRC-32s of it and of ZipWriter's archives (archive_test zip <dir>).
set -euo pipefail
writer="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/archive_python"
rm -rf "$tmp"; mkdir -p "$tmp"
"$writer" write "$tmp/a.pt"
pyrun "$checker" "$tmp/a.pt" || fail "Python could not read the archive"
mkdir -p "$tmp/zips"
"$writer" zip "$tmp/zips"
pyrun "$checker" --zips "$tmp/zips" || fail "Python's zipfile refused ZipWriter's archives"
echo PASS
