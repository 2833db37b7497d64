"""The Python side of llama_hf_python_test.sh: transformers is the reference.

  llama_hf_check.py make OUT
      builds tiny random LlamaForCausalLM models of several shapes (MQA, GQA,
      tied and untied heads, head_dim of its own, biases, llama3 and linear
      rope, a sharded index, bf16 weights, a config in the 4.x schema), saves
      each as OUT/<case> and writes OUT/<case>.expected.safetensors: input ids,
      their logits, a prompt, transformers' greedy generation from it and the
      teacher-forced logits over that sequence (and, as comma-separated text,
      the first prompt and its greedy continuation: <case>.prompt.txt,
      <case>.generated.txt).
  llama_hf_check.py check-export SRC DST
      loads ShardTrain's export DST with from_pretrained: no missing or
      unexpected keys, every tensor bit-identical to SRC's, the same logits.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()
MARGIN = 1e-3  # top-2 logit margin every greedy step must exceed

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
CASES = {
    # name: (config overrides, save options, weights dtype)
    "gqa_untied_sharded": (dict(num_key_value_heads=2), dict(max_shard_size="20KB"), torch.float32),
    "mqa_tied_llama3_headdim": (dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                                     rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=32)),
                                {}, torch.float32),
    "mha_bias_linear_bf16": (dict(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
                                  rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0)),
                             {}, torch.bfloat16),
}


def random_model(overrides, seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**BASE, **overrides)).eval()
    with torch.no_grad():  # larger than the default init, so greedy choices are not near-ties
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def greedy(model, prompt, new_tokens):
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    margins = [(s.topk(2).values[:, 0] - s.topk(2).values[:, 1]).min().item() for s in out.scores]
    return out.sequences, min(margins)


def to_v4_schema(path):
    """Rewrites config.json the way transformers 4.x wrote it (rope_theta, rope_scaling with "type")."""
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else {"type": rope.pop("rope_type"), **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def make(out):
    for i, (name, (overrides, save, dtype)) in enumerate(CASES.items()):
        for seed in range(100 * i, 100 * i + 20):
            model = random_model(overrides, seed)
            if dtype != torch.float32:  # the reference runs in fp32 on the rounded weights (buffers stay fp32)
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(p.to(dtype))
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(3, BASE["vocab_size"], (2, 11), generator=g)
            prompt = torch.randint(3, BASE["vocab_size"], (2, 5), generator=g)
            with torch.no_grad():
                generated, margin = greedy(model, prompt, 12)
            if margin > MARGIN:
                break
        else:
            sys.exit(f"{name}: no seed gave greedy margins above {MARGIN}")
        with torch.no_grad():
            logits = model(ids).logits
            generated_logits = model(generated).logits
        d = os.path.join(out, name)
        model.to(dtype).save_pretrained(d, **save)
        if name.startswith("mqa"):
            to_v4_schema(os.path.join(d, "config.json"))
        with open(d + ".prompt.txt", "w") as f:
            f.write(",".join(str(i) for i in prompt[0].tolist()))
        with open(d + ".generated.txt", "w") as f:
            f.write(",".join(str(i) for i in generated[0].tolist()))
        save_file({"input_ids": ids, "logits": logits.contiguous(), "prompt_ids": prompt,
                   "generated_ids": generated.contiguous(), "generated_logits": generated_logits.contiguous()},
                  d + ".expected.safetensors")
        files = sorted(os.listdir(d))
        print(f"{name}: seed {seed}, greedy margin {margin:.4f}, {generated.shape[1] - 5} new tokens, files {files}")


def check_export(src, dst):
    ref = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    got, info = LlamaForCausalLM.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"from_pretrained({dst}) reported {bad}"
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert ref_sd.keys() == got_sd.keys(), (ref_sd.keys() ^ got_sd.keys())
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got_sd[k]), f"{k} differs after the round trip"
    ids = torch.randint(0, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got.eval()(ids).logits), "logits differ"
    print(f"{dst}: {len(ref_sd)} tensors bit-identical to {src}, same logits, no missing or unexpected keys")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "check-export":
        check_export(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
