#!/usr/bin/env bash
# //examples/llama:train in every cell of {fsdp_native FULL_SHARD,
# fsdp_native HYBRID_SHARD, fsdp, ddp} x {32-true, bf16-mixed} x {full,
# sharded checkpoint} (sharded checkpoints are fsdp_native's state_dict_type;
# fsdp and ddp write full ones only), 2 ranks, a tiny model: 4 steps in one
# run that also saves at step 2 (--checkpoint_every_n_steps=2), and a second
# run resumed from that step=2.ckpt to 4 — it must say where it resumed
# (global step 2), train only steps 3 and 4, with the losses of the
# uninterrupted run's steps 3 and 4 and its final validation loss (as
# printed, 4 decimals; a high constant lr makes every step move the loss).
# Two launches per cell, not three (a separate 2-step run to save), on the
# first 300 KB of the fortunes corpus (--data): each rank of a launch encodes
# the whole text, ~7 s of a launch on 2 cores for the whole corpus, ~1 s here.
#
#   llama_matrix_test.sh LLAMA_TRAIN
set -u
die() { echo "llama_matrix_test: $*" >&2; exit 1; }
[[ $# -eq 1 ]] || die "usage: llama_matrix_test.sh LLAMA_TRAIN"
abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }
TRAIN="$(abspath "$1")"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/llama_matrix"
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=1
FAILURES=0
FORTUNES=/usr/share/games/fortunes
[[ -d "$FORTUNES" ]] || die "no $FORTUNES (Debian's fortunes package; tools/bootstrap.sh installs it)"
find "$FORTUNES" -maxdepth 1 -type f ! -name '*.*' | sort | xargs cat 2>/dev/null | head -c 300000 >"$OUT/text.txt"
common=(--data="$OUT/text.txt" --devices=2 --block_size=16 --batch_size=4 --val_samples=16 --hidden_size=32 --intermediate_size=64
        --num_layers=2 --num_heads=2 --num_kv_heads=1 --vocab_size=1024 --sample_tokens=0 --num_workers=0
        --eval_every=1000 --tokenizer_cache_dir="$OUT/tok" --lr_scheduler=none --lr=0.03 --log_every_n_steps=1)
final_loss() { sed -nE 's/^validation loss: [0-9.]+ -> ([0-9.]+);.*/\1/p' "$1" | tail -1; }

cell() {  # name, strategy, strategy_options, precision
  local name="$1" strategy="$2" options="$3" precision="$4"
  local args=("${common[@]}" --strategy="$strategy" --strategy_options="$options" --precision="$precision")
  "$TRAIN" "${args[@]}" --max_steps=4 --checkpoint_every_n_steps=2 --default_root_dir="$OUT/$name/whole" \
    >"$OUT/$name.whole.out" 2>"$OUT/$name.whole.err"
  local rc=$? at_two
  at_two="$(find "$OUT/$name/whole" -name 'step=2.ckpt' | head -1)"
  if [[ $rc -eq 0 && -n "$at_two" ]]; then
    "$TRAIN" "${args[@]}" --max_steps=4 --default_root_dir="$OUT/$name/resumed" --ckpt_path="$at_two" \
      >"$OUT/$name.resumed.out" 2>"$OUT/$name.resumed.err"
    rc=$?
  elif [[ $rc -eq 0 ]]; then
    rc=1; echo "no step=2.ckpt under $OUT/$name/whole" >"$OUT/$name.resumed.err"
  fi
  local whole resumed why=""
  whole="$(final_loss "$OUT/$name.whole.out")"; resumed="$(final_loss "$OUT/$name.resumed.out")"
  [[ $rc -eq 0 ]] || why="exit $rc"
  [[ -n "$whole" && "$whole" == "$resumed" ]] || why="$why; final validation loss: uninterrupted '$whole', resumed '$resumed'"
  grep -qE "resumed from .*step=2.ckpt .* global step 2$" "$OUT/$name.resumed.err" || why="$why; no 'resumed from ... global step 2'"
  ! grep -qE "step [12]/4 loss" "$OUT/$name.resumed.out" || why="$why; the resumed run trained steps 1-2 again"
  for step in 3 4; do
    local want
    want="$(grep -E "step $step/4 loss" "$OUT/$name.whole.out" | sed -E 's/.*(loss [0-9.]+).*/\1/')"
    [[ -n "$want" ]] && grep -qE "step $step/4 $want " "$OUT/$name.resumed.out" ||
      why="$why; step $step: the uninterrupted run's '$want' not in the resumed run"
  done
  if [[ -n "$why" ]]; then
    echo "FAIL [$name]: ${why#; }" >&2
    tail -5 "$OUT/$name".*.err >&2
    FAILURES=$((FAILURES + 1))
  else
    echo "ok [$name]: resumed at global step 2; steps 3-4 and the final validation loss $resumed as uninterrupted"
  fi
}

for precision in 32-true bf16-mixed; do
  for type in full sharded; do
    cell "fsdp_native_full_${precision}_${type}" fsdp_native "state_dict_type=$type" "$precision"
    cell "fsdp_native_hybrid_${precision}_${type}" fsdp_native \
      "sharding_strategy=HYBRID_SHARD,state_dict_type=$type" "$precision"
  done
  cell "fsdp_${precision}_full" fsdp "" "$precision"
  cell "ddp_${precision}_full" ddp "" "$precision"
done
[[ $FAILURES -eq 0 ]] || die "$FAILURES cell(s) failed"
echo "llama_matrix_test: all 12 cells passed"
