#!/usr/bin/env bash
# Full checkpoints between ShardTrain and Python Lightning, both ways
# (lightning_interop_check.py says what each step checks):
#   ShardTrain writes st.ckpt (fsdp_native, 2 ranks) and continues it itself;
#   Python loads it (torch.load, load_from_checkpoint, torch.optim), Lightning
#   resumes it with the same losses; Lightning (ddp) writes py.ckpt of its own
#   and continues it itself; ShardTrain resumes py.ckpt with Lightning's losses.
set -euo pipefail
fixture="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module lightning lightning_interop_test
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/lightning_interop"
rm -rf "$tmp"; mkdir -p "$tmp"
"$fixture" save "$tmp/st.ckpt"
"$fixture" resume "$tmp/st.ckpt" 3 "$tmp/st_cont.txt"
pyrun "$checker" python "$tmp" || fail "Python / Lightning on ShardTrain's checkpoint"
"$fixture" resume "$tmp/py.ckpt" 2 "$tmp/st_cont2.txt"
pyrun "$checker" compare "$tmp/py_cont.txt" "$tmp/st_cont2.txt" || fail "ShardTrain on Lightning's checkpoint"
echo PASS
