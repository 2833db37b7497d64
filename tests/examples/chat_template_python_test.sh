#!/usr/bin/env bash
# Chat templates against Python (transformers, jinja2, tokenizers; pinned by
# tools/bootstrap.sh):
#   1. six templates saved through transformers (chat_template.jinja, a
#      string in tokenizer_config.json, a list of named templates) render
#      five conversations (three of them also one with tool calls and
#      content lists), without and with the generation prompt, to the
#      texts transformers' apply_chat_template gives, and those texts to its
#      token ids (the template's raise_exception refuses the same ones);
#   2. //examples/llama:train fine-tunes on chat lines ("messages" and
#      conversational prompt/completion) through the checkpoint's template:
#      its completion-only validation loss before training equals the loss
#      transformers computes on the same renderings; without a template, a
#      chat line is refused by name.
set -euo pipefail
train="$1"; tool="$2"; checker="$3"; defs="$4"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module transformers chat_template_python_test
skip_without_module tokenizers chat_template_python_test
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/chat_template"
rm -rf "$tmp"; mkdir -p "$tmp"

# 1: renderings and ids.
pyrun "$checker" fixtures "$tmp"
for name in header chatml inst tags features tools; do
  "$tool" render "$tmp/$name" "$tmp/$name/conversations.json" "$tmp/$name/ours.json"
  pyrun "$checker" compare "$tmp/$name/expected.json" "$tmp/$name/ours.json" ||
    fail "$name: ShardTrain's rendering differs from transformers'"
done

# 2: chat fine-tuning data through the template.
pyrun "$checker" sft-setup "$tmp/hf" "$tmp/chat.jsonl"
args=(--hf_checkpoint="$tmp/hf" --sft_data="$tmp/chat.jsonl" --devices=1 --batch_size=4 --val_samples=4
      --block_size=160 --max_steps=2 --eval_every=1000 --lr=1e-3 --num_workers=0 --sample_tokens=4
      --default_root_dir="$tmp/runs")
"$train" "${args[@]}" | tee "$tmp/sft.log"
grep -q "chat template $tmp/hf/chat_template.jinja" "$tmp/sft.log" || fail "the checkpoint's template was not used"
grep -q "36+4 fine-tuning examples (40 chats; padded" "$tmp/sft.log" || fail "the chat lines were not all read"
ours="$(sed -n 's/^step 0 | val loss \([0-9.]*\).*/\1/p' "$tmp/sft.log" | tail -1)"
pyrun "$checker" sft-loss "$tmp/hf" "$tmp/chat.jsonl" 160 4 | tee "$tmp/python_sft.log"
theirs="$(sed -n 's/python sft loss \([0-9.]*\).*/\1/p' "$tmp/python_sft.log")"
tokens="$(sed -n 's/.* \([0-9]*\) completion tokens.*/\1/p' "$tmp/python_sft.log")"
grep -q "+$tokens completion tokens" "$tmp/sft.log" || fail "transformers takes the loss on $tokens validation tokens"
echo "completion-only validation loss of the chats: transformers $theirs, ShardTrain $ours"
# The program prints 4 decimals: agreement within rounding.
"$python" -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) > 1.5e-4)" \
  "$ours" "$theirs" || fail "transformers' completion-only loss is $theirs, the program printed $ours"
mkdir -p "$tmp/plain"
cp "$tmp/hf"/{config.json,model.safetensors,tokenizer.json,tokenizer_config.json} "$tmp/plain/"
if "$train" "${args[@]}" --hf_checkpoint="$tmp/plain" > "$tmp/plain.log" 2>&1; then
  fail "a chat line trained without a chat template"
fi
grep -q "chat.jsonl:1: a chat line needs the checkpoint's chat template" "$tmp/plain.log" ||
  fail "no chat template: $(tail -3 "$tmp/plain.log")"
echo PASS
