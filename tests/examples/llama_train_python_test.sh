#!/usr/bin/env bash
# //examples/llama:train against Python (transformers, sentencepiece; pinned by
# tools/bootstrap.sh), end to end at W=2 fsdp_native on a fixed text:
#   1. the tokenizer it trains encodes the text (and a multilingual sample)
#      token for token as Python sentencepiece does with the same model; three
#      byte-level BPE tokenizer.json files Python `tokenizers` trains (Llama 3,
#      Qwen2 and GPT-2 styles) encode the text, the sample and a text with
#      special tokens token for token as `tokenizers` does, and decode alike;
#      the program trains and exports with one (tokenizer.json travels along);
#   2. trained from scratch, its --save_hf export loads in transformers and
#      gives the validation loss the program printed;
#   3. Python continues training that export (300 AdamW steps); the program, started from
#      Python's directory (--hf_checkpoint), reports the validation loss
#      Python measured before it trains;
#   4. fine-tuned from it on prompt/completion pairs (--sft_data), its
#      completion-only validation loss before training equals transformers'
#      (padded batch with an attention mask, labels -100 on the prompt), and
#      transformers evaluates its export to the loss it printed at the end;
#      packed batches (--sft_packing) train too.
set -euo pipefail
train="$1"; tool="$2"; checker="$3"; defs="$4"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module transformers llama_train_python_test
skip_without_module sentencepiece llama_train_python_test
skip_without_module tokenizers llama_train_python_test
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/llama_train"
rm -rf "$tmp"; mkdir -p "$tmp"
pyrun "$checker" corpus "$tmp/corpus.txt" "$tmp/multilingual.txt" "$tmp/special.txt"
common=(--data="$tmp/corpus.txt" --tokenizer_cache_dir="$tmp/tok" --vocab_size=512 --devices=2
        --strategy=fsdp_native --block_size=32 --batch_size=8 --val_samples=64 --hidden_size=64
        --intermediate_size=176 --num_layers=2 --num_heads=4 --num_kv_heads=2 --sample_tokens=8
        --num_workers=0 --default_root_dir="$tmp/runs")
val_of() { sed -n "s/^step $2 | val loss \([0-9.]*\).*/\1/p" "$1" | tail -1; }
close() { "$python" -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(abs(a - b) > 2e-4 * max(1, abs(b)))" "$1" "$2"; }

# 1-2: from scratch, exported in fp32.
"$train" "${common[@]}" --max_steps=30 --eval_every=1000 --save_hf="$tmp/st_hf" --save_hf_dtype=fp32 \
  --save_hf_max_shard_size=100KB | tee "$tmp/scratch.log"
[[ -f "$tmp/st_hf/model.safetensors.index.json" ]] || fail "a 100KB limit did not shard the export"
model="$(ls "$tmp"/tok/*.model)"
"$tool" tokenize "$model" "$tmp/ids.safetensors" "$tmp/corpus.txt" "$tmp/multilingual.txt"
pyrun "$checker" tokens "$model" "$tmp/ids.safetensors" "$tmp/corpus.txt" "$tmp/multilingual.txt" ||
  fail "the tokenizer differs from Python's"
pyrun "$checker" bpe "$tmp/bpe" "$tmp/corpus.txt"
texts=("$tmp/corpus.txt" "$tmp/multilingual.txt" "$tmp/special.txt")
for kind in llama3 qwen2 gpt2; do
  "$tool" tokenize "$tmp/bpe/$kind/tokenizer.json" "$tmp/$kind.ids.safetensors" "${texts[@]}"
  pyrun "$checker" tokens "$tmp/bpe/$kind/tokenizer.json" "$tmp/$kind.ids.safetensors" "${texts[@]}" ||
    fail "$kind: the byte-level BPE tokenizer differs from Python tokenizers'"
done
"$train" "${common[@]}" --tokenizer="$tmp/bpe/llama3/tokenizer.json" --max_steps=2 \
  --eval_every=1000 --save_hf="$tmp/bpe_hf" | tee "$tmp/bpe.log"
grep -q "tokenizer byte-level BPE $tmp/bpe/llama3/tokenizer.json" "$tmp/bpe.log" || fail "not trained with tokenizer.json"
cmp "$tmp/bpe/llama3/tokenizer.json" "$tmp/bpe_hf/tokenizer.json" || fail "the export lacks tokenizer.json"
[[ -f "$tmp/bpe_hf/tokenizer_config.json" ]] || fail "the export lacks tokenizer_config.json"
ours="$(val_of "$tmp/scratch.log" 30)"
theirs="$(pyrun "$checker" val-loss "$tmp/st_hf" "$tmp/corpus.txt" 32 64 | sed -n 's/python val loss //p')"
echo "final validation loss: ShardTrain $ours, transformers on the export $theirs"
close "$ours" "$theirs" || fail "transformers evaluates the export to $theirs, the program printed $ours"

# 3: Python trains on; ShardTrain starts where Python left it.
pyrun "$checker" continue "$tmp/st_hf" "$tmp/py_hf" "$tmp/corpus.txt" 32 300
theirs="$(pyrun "$checker" val-loss "$tmp/py_hf" "$tmp/corpus.txt" 32 64 | sed -n 's/python val loss //p')"
"$train" "${common[@]}" --hf_checkpoint="$tmp/py_hf" --max_steps=2 --eval_every=1000 --lr=1e-4 | tee "$tmp/fine.log"
ours="$(val_of "$tmp/fine.log" 0)"
echo "validation loss of Python's checkpoint: transformers $theirs, ShardTrain after loading it $ours"
close "$ours" "$theirs" || fail "ShardTrain starts Python's checkpoint at $ours, Python measured $theirs"
# 4: fine-tuning on prompt/completion pairs, one rank, the validation examples in one batch.
pyrun "$checker" sft-data "$tmp/sft.jsonl" "$tmp/corpus.txt" 200
sft=(--hf_checkpoint="$tmp/py_hf" --sft_data="$tmp/sft.jsonl" --devices=1 --batch_size=20 --val_samples=20
     --block_size=48 --max_steps=6 --eval_every=1000 --lr=1e-3)
"$train" "${common[@]}" "${sft[@]}" --save_hf="$tmp/sft_hf" --save_hf_dtype=fp32 | tee "$tmp/sft.log"
grep -q "180+20 fine-tuning examples (padded" "$tmp/sft.log" || fail "the program did not report padded SFT data"
for pair in "py_hf 0" "sft_hf 6"; do
  set -- $pair
  theirs="$(pyrun "$checker" sft-loss "$tmp/$1" "$tmp/sft.jsonl" 48 20 | sed -n 's/python sft loss \([0-9.]*\).*/\1/p')"
  ours="$(val_of "$tmp/sft.log" "$2")"
  echo "completion-only validation loss of $1: transformers $theirs, ShardTrain $ours (step $2)"
  close "$ours" "$theirs" || fail "$1: transformers' completion-only loss is $theirs, the program printed $ours"
done
"$train" "${common[@]}" "${sft[@]}" --sft_packing --max_steps=2 | tee "$tmp/packed.log"
grep -q "180+20 fine-tuning examples (packed into" "$tmp/packed.log" || fail "--sft_packing did not pack"
echo PASS
