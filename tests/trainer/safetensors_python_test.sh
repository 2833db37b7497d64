#!/usr/bin/env bash
# Python's safetensors reads what trainer/checkpoint_io/safetensors.h writes,
# and ShardTrain reads what Python's safetensors writes (safetensors_check.py;
# archive_test's safetensors-write / safetensors-compare modes), every tensor
# bit for bit against a torch.save copy of the same tensors.
set -euo pipefail
tool="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module safetensors safetensors_python_test
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/safetensors_python"
rm -rf "$tmp"; mkdir -p "$tmp"
pyrun "$checker" write "$tmp" || fail "Python could not write its safetensors file"
"$tool" safetensors-compare "$tmp/py.safetensors" "$tmp/py.pt" || fail "ShardTrain read Python's file differently"
"$tool" safetensors-write "$tmp/st.safetensors" "$tmp/st.pt"
pyrun "$checker" check "$tmp/st.safetensors" "$tmp/st.pt" || fail "Python read ShardTrain's file differently"
echo PASS
