#!/usr/bin/env bash
# TensorBoardLogger's event file read back in Python by a hand-written reader
# (tensorboard_reader.py: TFRecord CRCs and protobuf fields decoded by hand).
set -euo pipefail
writer="$1"; reader="$2"; defs="$3"
libdir="$(sed -n 's/^LIBTORCH_LIB_DIR = "\(.*\)"$/\1/p' "$defs")"
python="${SHARDTRAIN_PYTHON:-$(cd "$libdir/../../../../.." 2>/dev/null && pwd)/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
out="${TEST_TMPDIR:-$(mktemp -d)}/tb"
rm -rf "$out"; mkdir -p "$out"
"$writer" "$out" >"$out/expected.tsv"
"$python" "$reader" "$out" "$out/expected.tsv"
