#!/usr/bin/env bash
# trainer/optim/lr_scheduler.h's schedulers against Python's torch.optim.lr_scheduler:
# lr_scheduler_table prints every case's lrs (and momentums) over 50 steps,
# lr_scheduler_check.py builds the same cases in PyTorch and compares to 1e-12.
set -euo pipefail
table="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/lr_scheduler_python"
rm -rf "$tmp"; mkdir -p "$tmp"
"$table" > "$tmp/table.txt"
"$python" "$checker" "$tmp/table.txt" || fail "the C++ schedulers differ from PyTorch's"
echo PASS
