#!/usr/bin/env bash
# Bad command lines of the example programs: every numeric and enum flag out of
# its range makes the real binary exit with status 2 (usage error) at once,
# with "error: --FLAG=VALUE is not valid ...; valid: ..." on stderr and no
# LibTorch stack trace; a good command line still trains (a few GPT steps at
# W=1) and its hparams.yaml keeps a small learning rate exactly (1e-07, not
# std::to_string's 0.000000).
#
#   example_flags_test.sh FASHION_MNIST_TRAIN GPT_TRAIN LLAMA_TRAIN   (runfiles paths; Bazel passes them)
set -u

die() { echo "example_flags_test: $*" >&2; exit 1; }
[[ $# -eq 3 ]] || die "usage: example_flags_test.sh FASHION_MNIST_TRAIN GPT_TRAIN LLAMA_TRAIN"
abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }
FM="$(abspath "$1")"
GPT="$(abspath "$2")"
LLAMA="$(abspath "$3")"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/example_flags"
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=1
FAILURES=0
CASES=0

# bad BINARY FLAG VALUE [more args...]: exits 2, names --FLAG=VALUE and a valid range.
bad() {
  local bin="$1" flag="$2" value="$3"; shift 3
  local name; name="$(basename "$(dirname "$bin")")_${flag}_${value//[^A-Za-z0-9.-]/_}"
  CASES=$((CASES + 1))
  timeout 60 "$bin" --devices=1 --default_root_dir="$OUT/runs" "--$flag=$value" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  local why=""
  [[ $rc == 2 ]] || why="exit status $rc, expected 2"
  grep -qF -- "--$flag=$value is not valid" "$OUT/$name.err" || why="$why; stderr does not name --$flag=$value"
  grep -qE -- "valid: .+" "$OUT/$name.err" || why="$why; stderr names no valid range"
  ! grep -qE "Exception raised from|frame #[0-9]" "$OUT/$name.err" || why="$why; LibTorch stack trace on stderr"
  [[ ! -d "$OUT/runs/lightning_logs" ]] || why="$why; a run directory was created"
  if [[ -n "$why" ]]; then
    echo "FAIL [$name]: $why" >&2; echo "--- stderr:"; head -20 "$OUT/$name.err"
    FAILURES=$((FAILURES + 1))
  fi
}

# --- the issue's cases
bad "$GPT" block_size 0
bad "$GPT" nonfinite warn
bad "$GPT" stall_timeout_s 1800   # not below --timeout_s=1800
bad "$GPT" stall_timeout_s -1
bad "$GPT" stall_warning_s 1800   # not below --timeout_s=1800
bad "$GPT" stall_warning_s 10 --timeout_s=10
bad "$GPT" stall_warning_s -1
bad "$GPT" lr -1
bad "$GPT" dropout 2
bad "$GPT" checkpoint_every_n_steps -1
bad "$GPT" val_samples 0
# --- every other numeric flag of the GPT example, just outside its range
bad "$GPT" max_steps 0
bad "$GPT" batch_size 0
bad "$GPT" block_size 65537
bad "$GPT" n_layer 0
bad "$GPT" n_head 0
bad "$GPT" n_embd -4
bad "$GPT" n_embd 130          # not a multiple of --n_head=4
bad "$GPT" dropout 1
bad "$GPT" dropout -0.1
bad "$GPT" lr 0
bad "$GPT" lr_scheduler linear
bad "$GPT" warmup_steps 300     # not below --max_steps=300
bad "$GPT" lr nan
bad "$GPT" lr inf
bad "$GPT" weight_decay -0.01
bad "$GPT" grad_clip -1
bad "$GPT" eval_every 1
bad "$GPT" log_every_n_steps 0
bad "$GPT" sample_tokens -1
bad "$GPT" temperature 0
bad "$GPT" top_k -1
bad "$GPT" num_workers -1
bad "$GPT" num_workers 257
# --- the flags every example shares (trainer_flags)
bad "$GPT" strategy fsdp_nativ
bad "$GPT" strategy_options sharding_strategy
bad "$GPT" strategy_options shard_strategy=FULL_SHARD
bad "$GPT" devices 0
bad "$GPT" devices two
bad "$GPT" accelerator tpu
bad "$GPT" precision 16
# --- Fashion-MNIST
bad "$FM" max_epochs 0
bad "$FM" max_epochs -2
bad "$FM" max_steps 0
bad "$FM" batch_size 0
bad "$FM" num_workers -1
bad "$FM" lr -0.001
bad "$FM" lr_schedule linear
bad "$FM" lr_schedule cosine --max_epochs=-1 --max_steps=-1
bad "$FM" dropout 1.5
bad "$FM" val_size -1
bad "$FM" val_size 60000      # checked against the training images once read
bad "$FM" log_every_n_steps 0
bad "$FM" precision fp16
# --- Llama (its own flags; the shared ones as GPT's)
bad "$LLAMA" vocab_size 259
bad "$LLAMA" hidden_size 0
bad "$LLAMA" num_heads 3         # does not divide --hidden_size=128
bad "$LLAMA" num_kv_heads 3      # does not divide --num_heads=4
bad "$LLAMA" num_kv_heads 5      # more than --num_heads=4
bad "$LLAMA" top_p 0
bad "$LLAMA" top_p 1.5
bad "$LLAMA" save_hf_dtype fp16
bad "$LLAMA" save_hf_max_shard_size 5TB
bad "$LLAMA" lr_scheduler linear
bad "$LLAMA" block_size 0
bad "$LLAMA" sft_data /nonexistent.jsonl
bad "$LLAMA" sft_packing true

# --- a good command line still trains, and hparams keep a small learning rate exactly
CASES=$((CASES + 1))
timeout 300 "$GPT" --devices=1 --max_steps=2 --n_layer=1 --n_head=2 --n_embd=16 --block_size=16 --batch_size=2 \
  --eval_every=2 --val_samples=2 --sample_tokens=4 --lr=1e-7 --default_root_dir="$OUT/good" \
  >"$OUT/good.out" 2>"$OUT/good.err"
rc=$?
if [[ $rc != 0 ]] || ! grep -q "^checkpoint: " "$OUT/good.out"; then
  echo "FAIL [good]: exit status $rc, expected 0 and a checkpoint line" >&2
  echo "--- stdout:"; cat "$OUT/good.out"; echo "--- stderr (tail):"; tail -20 "$OUT/good.err"
  FAILURES=$((FAILURES + 1))
elif ! grep -qx "lr: 1e-07" "$OUT/good/lightning_logs/version_0/hparams.yaml"; then
  echo "FAIL [good]: hparams.yaml does not hold 'lr: 1e-07'" >&2; cat "$OUT/good/lightning_logs/version_0/hparams.yaml"
  FAILURES=$((FAILURES + 1))
fi

echo "example_flags_test: $CASES cases, $FAILURES failed"
[[ $FAILURES == 0 ]]
