#!/usr/bin/env bash
# Sharded checkpoints (PyTorch DCP) between ShardTrain, PyTorch FSDP2 and
# Lightning, both ways (dcp_interop_check.py says what each step checks):
#   ShardTrain writes st_sharded (fsdp_native, 2 ranks) and st_full.ckpt of the
#   same state, and continues st_sharded itself at W=2; PyTorch reads it
#   (dcp_to_torch_save), FSDP2 resumes it at W=1, 2, 4 with the same losses,
#   Lightning consolidates it; FSDP2 writes py_sharded (keys "model", "optim")
#   and continues it; ShardTrain resumes py_sharded at W=1, 2, 4 with FSDP2's
#   losses, and at W=3 too (global batches of 6 there: it only has to load);
#   ShardTrain resumes (W=2) the DCP save of an unsharded module's state_dict();
#   model_parallel (the example GPT at 2x2) writes st_tp, which PyTorch reads
#   (dcp_to_torch_save, DTensor TP + FSDP2 at 2x2); PyTorch re-saves it as
#   py_tp (its 2-D DTensor chunks), and ShardTrain resumes st_tp and py_tp at
#   1x4 and 4x1 with exactly the losses of resuming the full checkpoint.
set -euo pipefail
fixture="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module lightning dcp_interop_test
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/dcp_interop"
rm -rf "$tmp"; mkdir -p "$tmp"
"$fixture" save_sharded "$tmp/st_sharded" "$tmp/st_full.ckpt"
"$fixture" resume_sharded "$tmp/st_sharded" 2 3 "$tmp/st_cont.txt"
pyrun "$checker" python "$tmp" || fail "PyTorch / FSDP2 / Lightning on ShardTrain's sharded checkpoint"
for w in 1 2 4; do
  "$fixture" resume_sharded "$tmp/py_sharded" "$w" 1 "$tmp/st_cont_py$w.txt" no_scheduler
  pyrun "$checker" compare "$tmp/py_cont.txt" "$tmp/st_cont_py$w.txt" || fail "ShardTrain at W=$w on FSDP2's checkpoint"
done
"$fixture" resume_sharded "$tmp/py_sharded" 3 1 "$tmp/st_cont_py3.txt" no_scheduler
# An unsharded model's state_dict() saved by DCP: weights only, a fresh optimizer.
"$fixture" resume_sharded "$tmp/py_plain" 2 1 "$tmp/st_cont_plain.txt" no_scheduler
pyrun "$checker" compare "$tmp/py_plain_cont.txt" "$tmp/st_cont_plain.txt" || fail "ShardTrain on an unsharded model's DCP checkpoint"
# Tensor parallel x FSDP: model_parallel's DCP checkpoint and PyTorch TP + FSDP2's, both ways.
"$fixture" save_tp "$tmp/st_tp" "$tmp/st_tp_full.ckpt"
pyrun "$checker" tp "$tmp" || fail "PyTorch TP + FSDP2 on ShardTrain's model_parallel checkpoint"
for tp in 4 1; do  # each against the full checkpoint of the same state (another reader)
  "$fixture" resume_tp "$tmp/st_tp_full.ckpt" "$tp" "$tmp/full_tp_cont$tp.txt"
  [[ "$(wc -l < "$tmp/full_tp_cont$tp.txt")" == 2 ]] || fail "resume_tp at tp=$tp: $(cat "$tmp/full_tp_cont$tp.txt")"
  for src in st_tp py_tp; do
    "$fixture" resume_tp "$tmp/$src" "$tp" "$tmp/${src}_cont$tp.txt"
    cmp "$tmp/full_tp_cont$tp.txt" "$tmp/${src}_cont$tp.txt" ||
      fail "model_parallel at tp=$tp: $src gave $(cat "$tmp/${src}_cont$tp.txt"), the full checkpoint $(cat "$tmp/full_tp_cont$tp.txt")"
  done
  echo "model_parallel at tp=$tp resumed its own and PyTorch TP + FSDP2's DCP checkpoints as the full one"
done
echo PASS
