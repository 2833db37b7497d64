#!/usr/bin/env bash
# examples/llama against Python transformers (pinned by tools/bootstrap.sh):
# random tiny Llamas of several shapes built in Python at test time (no
# download), saved as Hugging Face directories; ShardTrain's model gives the
# same logits (1e-5), the same greedy ids and teacher-forced logits
# (llama_test check), and its export loads in Python bit for bit with the same
# logits and no missing or unexpected keys (llama_test export, check-export);
# 10 AdamW steps of fsdp_native FULL_SHARD at W=2 from a checkpoint give the
# losses and weights of PyTorch FSDP2 on the transformers model (1e-5;
# llama_hf_check.py fsdp2, llama_test fit); and model_parallel at 2x2 (W=4)
# gives the losses and weights of PyTorch's DTensor tensor parallel + FSDP2
# on the same 2x2 mesh (llama_hf_check.py tp, llama_test fit-tp).
set -euo pipefail
tool="$1"; checker="$2"; defs="$3"; generate="$4"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module transformers llama_hf_python_test
pyserve_start
tmp="${TEST_TMPDIR:-$(mktemp -d)}/llama_hf"
rm -rf "$tmp"; mkdir -p "$tmp"
pyrun "$checker" make "$tmp" || fail "Python could not build the reference models"
for case in gqa_untied_sharded mqa_tied_llama3_headdim mha_bias_linear_bf16; do
  "$tool" check "$tmp/$case" "$tmp/$case.expected.safetensors" || fail "$case: ShardTrain differs from transformers"
done
# The generate program: greedy ids equal transformers' generate.
for case in gqa_untied_sharded mqa_tied_llama3_headdim; do
  want="$(cat "$tmp/$case.generated.txt")"
  got="$("$generate" --hf_checkpoint="$tmp/$case" --prompt_ids="$(cat "$tmp/$case.prompt.txt")" --greedy \
    --max_new_tokens=12 --print_ids | sed -n 's/^ids: //p')"
  [[ "$got" == "$want" ]] || fail "$case: generate --greedy gave $got, transformers $want"
  echo "$case: generate --greedy: the same 12 ids as transformers"
done
"$generate" --hf_checkpoint="$tmp/gqa_untied_sharded" --prompt_ids=5,6 --max_new_tokens=4 --top_k=5 --top_p=0.9 \
  --seed=3 --print_ids | grep -qE '^ids: 5,6(,[0-9]+){4}$' || fail "sampled generation"
if "$generate" --hf_checkpoint="$tmp/gqa_untied_sharded" --prompt_ids=5,999 2>"$tmp/bad_ids.err"; then
  fail "an id outside the vocabulary was accepted"
fi
grep -q "'999' is not a token id (valid: integers in \[0, 97)" "$tmp/bad_ids.err" || fail "bad id message: $(cat "$tmp/bad_ids.err")"
# Training from the checkpoint against PyTorch FSDP2 (fully_shard, Gloo, W=2): untied GQA and tied MQA.
pyrun "$checker" fsdp2 "$tmp/gqa_untied_sharded" "$tmp/gqa.fsdp2.safetensors" \
  "$tmp/mqa_tied_llama3_headdim" "$tmp/mqa.fsdp2.safetensors" || fail "PyTorch FSDP2 could not train the models"
"$tool" fit "$tmp/gqa_untied_sharded" "$tmp/gqa.fsdp2.safetensors" || fail "gqa: fsdp_native differs from FSDP2"
"$tool" fit "$tmp/mqa_tied_llama3_headdim" "$tmp/mqa.fsdp2.safetensors" || fail "mqa: fsdp_native differs from FSDP2"
# Tensor parallel x FSDP (2x2) against PyTorch's DTensor TP + FSDP2 on the same mesh: GQA, untied head.
pyrun "$checker" tp "$tmp/gqa_untied_sharded" "$tmp/gqa.tp.safetensors" || fail "PyTorch TP + FSDP2 could not train"
"$tool" fit-tp "$tmp/gqa_untied_sharded" "$tmp/gqa.tp.safetensors" || fail "gqa: model_parallel differs from TP + FSDP2"
# Import -> export with no training: sharded (small limit) and single-file.
"$tool" export "$tmp/gqa_untied_sharded" "$tmp/export_sharded" 30KB fp32
[[ -f "$tmp/export_sharded/model.safetensors.index.json" ]] || fail "a 30KB limit did not shard the export"
pyrun "$checker" check-export "$tmp/gqa_untied_sharded" "$tmp/export_sharded" || fail "export_sharded"
"$tool" export "$tmp/mqa_tied_llama3_headdim" "$tmp/export_tied" 50GB fp32
pyrun "$checker" check-export "$tmp/mqa_tied_llama3_headdim" "$tmp/export_tied" || fail "export_tied"
"$tool" export "$tmp/mha_bias_linear_bf16" "$tmp/export_bf16" 50GB bf16
pyrun "$checker" check-export "$tmp/mha_bias_linear_bf16" "$tmp/export_bf16" || fail "export_bf16"
echo PASS
