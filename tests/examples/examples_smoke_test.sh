#!/usr/bin/env bash
# The example programs end to end, briefly (a few steps each), with real
# processes over Gloo on loopback:
#   - fashion_mnist: 2 ranks started by the program itself (fsdp_native), then a
#     resume from its last.ckpt (--ckpt_path=last); test accuracy over all
#     10 000 test images at 3 ranks (padding not counted); a missing data
#     directory names the Debian package and the flag;
#   - gpt: 2 ranks under torchrun --no-python (pinned torch), then a resume that
#     must continue exactly (same losses as an uninterrupted run); and 2 ranks
#     started by the program with --strategy=model_parallel (tensor parallel
#     over both, sequence parallel): progress, validation, a sample drawn from
#     the gathered logits, a checkpoint.
#
#   examples_smoke_test.sh FASHION_MNIST_TRAIN GPT_TRAIN   (runfiles paths; Bazel passes them)
#
# torchrun: $SHARDTRAIN_TORCHRUN, else <repo>/.deps/venv/bin/torchrun. The
# Fashion-MNIST files: Debian's dataset-fashion-mnist (tools/bootstrap.sh).
set -u

die() { echo "examples_smoke_test: $*" >&2; exit 1; }
[[ $# -eq 2 ]] || die "usage: examples_smoke_test.sh FASHION_MNIST_TRAIN GPT_TRAIN"
abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }
FM="$(abspath "$1")"
GPT="$(abspath "$2")"
SCRIPT_REAL="$(readlink -f "${BASH_SOURCE[0]}")"
REPO_ROOT="$(cd "$(dirname "$SCRIPT_REAL")/../.." && pwd)"
TORCHRUN="${SHARDTRAIN_TORCHRUN:-$REPO_ROOT/.deps/venv/bin/torchrun}"
[[ -x "$TORCHRUN" ]] || die "torchrun not found at $TORCHRUN (tools/bootstrap.sh installs the pinned torch)"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/examples_smoke"
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=1
FAILURES=0

run_case() {  # name, command...
  local name="$1"; shift
  echo "=== $name: $*"
  "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  echo "$rc" >"$OUT/$name.rc"
  return 0
}
expect() {  # name, condition description, grep pattern (on stdout)
  if ! grep -qE -- "$3" "$OUT/$1.out"; then
    echo "FAIL [$1]: $2 (no line matching '$3')" >&2
    echo "--- stdout:"; cat "$OUT/$1.out"; echo "--- stderr (tail):"; tail -20 "$OUT/$1.err"
    FAILURES=$((FAILURES + 1))
  fi
}
expect_rc() {  # name, rc
  local rc; rc="$(cat "$OUT/$1.rc")"
  if [[ "$rc" != "$2" ]]; then
    echo "FAIL [$1]: exit code $rc, expected $2" >&2
    echo "--- stdout:"; cat "$OUT/$1.out"; echo "--- stderr (tail):"; tail -20 "$OUT/$1.err"
    FAILURES=$((FAILURES + 1))
  fi
}

# --- Fashion-MNIST: own launcher, 2 ranks, then resume.
run_case fm_first "$FM" --devices=2 --max_steps=8 --log_every_n_steps=4 --default_root_dir="$OUT/fm"
expect_rc fm_first 0
expect fm_first "2 ranks with fsdp_native" "strategy fsdp_native, 2 rank\(s\),"
expect fm_first "test accuracy over the whole test set" "^test accuracy: [0-9.]+% \([0-9]+/10000\)"
expect fm_first "a checkpoint" "^checkpoint: .*/version_0/checkpoints/last.ckpt"
run_case fm_resume "$FM" --devices=2 --max_steps=12 --log_every_n_steps=1 --default_root_dir="$OUT/fm" --ckpt_path=last
expect_rc fm_resume 0
expect fm_resume "resumes from the first run" "^resuming from .*/version_0/checkpoints/last.ckpt"
# The Trainer logs where it resumed, and the first step it then trains (the
# progress line of every step, --log_every_n_steps=1) is step 9.
if ! grep -qE "resumed from .*last.ckpt .* global step 8$" "$OUT/fm_resume.err"; then
  echo "FAIL [fm_resume]: no 'resumed from ... global step 8' log line" >&2; tail -20 "$OUT/fm_resume.err"
  FAILURES=$((FAILURES + 1))
fi
first_step="$(grep -E "^epoch [0-9]+ step [0-9]+/12 loss" "$OUT/fm_resume.out" | head -1 | sed -E 's/^epoch [0-9]+ step ([0-9]+)\/12.*/\1/')"
if [[ "$first_step" != 9 ]]; then
  echo "FAIL [fm_resume]: the first step after resuming is '${first_step}', expected 9" >&2; cat "$OUT/fm_resume.out"
  FAILURES=$((FAILURES + 1))
fi
expect fm_resume "reaches step 12" "step 12/12"
expect fm_resume "ends after 12 steps" "after 0 epoch\(s\), 12 steps"
run_case fm_w3 "$FM" --devices=3 --strategy=ddp --max_steps=2 --default_root_dir="$OUT/fm3"
expect_rc fm_w3 0
expect fm_w3 "counts each test image once at 3 ranks" "^test accuracy: [0-9.]+% \([0-9]+/10000\)"
run_case fm_nodata "$FM" --devices=2 --data_dir="$OUT/nowhere"
expect_rc fm_nodata 1
if ! grep -q "dataset-fashion-mnist" "$OUT/fm_nodata.err" || ! grep -q -- "--data_dir" "$OUT/fm_nodata.err"; then
  echo "FAIL [fm_nodata]: the error does not name the package and the flag:" >&2; cat "$OUT/fm_nodata.err"
  FAILURES=$((FAILURES + 1))
fi

# --- GPT under torchrun: 6 steps uninterrupted; 3 steps + resume to 6 must match.
# A constant lr: the default cosine schedule is planned over --max_steps, so a
# 3-step run is not the start of a 6-step one (resuming itself restores the
# schedule exactly: tests/trainer lr_scheduler_test).
GPT_ARGS=(--n_layer=2 --n_embd=64 --batch_size=8 --eval_every=3 --val_samples=32 --sample_tokens=20 --log_every_n_steps=1
          --lr_scheduler=none)
run_case gpt_full "$TORCHRUN" --no-python --standalone --nproc-per-node=2 "$GPT" "${GPT_ARGS[@]}" --max_steps=6 \
  --default_root_dir="$OUT/gpt_full"
expect_rc gpt_full 0
expect gpt_full "joins torchrun's 2 ranks" "2 rank\(s\) via torchrun"
expect gpt_full "validation loss before and after" "^validation loss: [0-9.]+ -> [0-9.]+"
expect gpt_full "a sample" "^--- sample ---"
run_case gpt_a "$TORCHRUN" --no-python --standalone --nproc-per-node=2 "$GPT" "${GPT_ARGS[@]}" --max_steps=3 \
  --default_root_dir="$OUT/gpt_split"
expect_rc gpt_a 0
run_case gpt_b "$TORCHRUN" --no-python --standalone --nproc-per-node=2 "$GPT" "${GPT_ARGS[@]}" --max_steps=6 \
  --default_root_dir="$OUT/gpt_split" --ckpt_path=last
expect_rc gpt_b 0
expect gpt_b "resumes" "^resuming from .*/version_0/checkpoints/last.ckpt"
for step in 4 5 6; do
  line="$(grep -E "step $step/6 loss" "$OUT/gpt_full.out" | sed -E 's/.*(loss [0-9.]+).*/\1/')"
  [[ -n "$line" ]] || { echo "FAIL [gpt_b]: no step $step in the uninterrupted run" >&2; FAILURES=$((FAILURES + 1)); continue; }
  expect gpt_b "step $step continues exactly ($line)" "step $step/6 $line "
done

# --- GPT with tensor parallelism, the program its own launcher.
run_case gpt_tp "$GPT" "${GPT_ARGS[@]}" --max_steps=3 --devices=2 --strategy=model_parallel \
  --strategy_options=tensor_parallel_size=2,sequence_parallel=true --default_root_dir="$OUT/gpt_tp"
expect_rc gpt_tp 0
expect gpt_tp "model_parallel over 2 ranks" "strategy model_parallel .*tensor_parallel_size=2.*, 2 rank\(s\)"
expect gpt_tp "a progress line per step" "^epoch 0 step 3/3 loss [0-9.]+ "
expect gpt_tp "validation loss before and after" "^validation loss: [0-9.]+ -> [0-9.]+"
expect gpt_tp "a sample" "^--- sample ---"
expect gpt_tp "a checkpoint" "^checkpoint: .*/version_0/checkpoints/last.ckpt"

if [[ $FAILURES -ne 0 ]]; then
  echo "examples_smoke_test: $FAILURES failure(s)" >&2
  exit 1
fi
echo "examples_smoke_test: all passed"
