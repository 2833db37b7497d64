#!/usr/bin/env bash
# examples/llama against Python transformers (pinned by tools/bootstrap.sh):
# random tiny Llamas of several shapes built in Python at test time (no
# download), saved as Hugging Face directories; ShardTrain's model gives the
# same logits (1e-5), the same greedy ids and teacher-forced logits
# (llama_test check), and its export loads in Python bit for bit with the same
# logits and no missing or unexpected keys (llama_test export, check-export).
set -euo pipefail
tool="$1"; checker="$2"; defs="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../testing/python.sh" "$defs"
skip_without_module transformers llama_hf_python_test
tmp="${TEST_TMPDIR:-$(mktemp -d)}/llama_hf"
rm -rf "$tmp"; mkdir -p "$tmp"
"$python" "$checker" make "$tmp" || fail "Python could not build the reference models"
for case in gqa_untied_sharded mqa_tied_llama3_headdim mha_bias_linear_bf16; do
  "$tool" check "$tmp/$case" "$tmp/$case.expected.safetensors" || fail "$case: ShardTrain differs from transformers"
done
# Import -> export with no training: sharded (small limit) and single-file.
"$tool" export "$tmp/gqa_untied_sharded" "$tmp/export_sharded" 30KB fp32
[[ -f "$tmp/export_sharded/model.safetensors.index.json" ]] || fail "a 30KB limit did not shard the export"
"$python" "$checker" check-export "$tmp/gqa_untied_sharded" "$tmp/export_sharded" || fail "export_sharded"
"$tool" export "$tmp/mqa_tied_llama3_headdim" "$tmp/export_tied" 50GB fp32
"$python" "$checker" check-export "$tmp/mqa_tied_llama3_headdim" "$tmp/export_tied" || fail "export_tied"
"$tool" export "$tmp/mha_bias_linear_bf16" "$tmp/export_bf16" 50GB bf16
"$python" "$checker" check-export "$tmp/mha_bias_linear_bf16" "$tmp/export_bf16" || fail "export_bf16"
echo PASS
