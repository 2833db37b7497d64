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
  llama_hf_check.py fsdp2 DIR OUT [DIR OUT ...]
      PyTorch FSDP2 (fully_shard on each decoder layer and the root, Gloo,
      W=2) trains the transformers model from DIR for FIT_STEPS AdamW steps on
      random global batches of FIT_BATCH rows (each rank its half) and writes
      OUT: "batches" [steps, rows, FIT_SEQ + 1], "losses" (the mean of the
      ranks' losses per step, float64) and the final weights under "w/<name>",
      for llama_test fit to train on and compare with.
  llama_hf_check.py tp DIR OUT
      the same on a 2x2 mesh (W=4): PyTorch DTensor tensor parallelism
      (torchtitan's Llama plan: q/k/v, gate and up ColwiseParallel, o and down
      RowwiseParallel, the embedding RowwiseParallel, lm_head ColwiseParallel
      with replicated logits) over "tp" and FSDP2 over "dp"; each
      data-parallel rank trains on its half of the rows, both tensor-parallel
      ranks on the same ones; for llama_test fit-tp.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()
MARGIN = 1e-3  # top-2 logit margin every greedy step must exceed
FIT_STEPS, FIT_BATCH, FIT_SEQ, FIT_LR, FIT_WD = 10, 4, 12, 1e-3, 0.01  # llama_test fit uses the same

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


def fsdp2_rank(rank, world, pairs):
    for src, out in pairs:
        fsdp2_fit(rank, world, src, out)


def fsdp2_fit(rank, world, src, out):
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    train_and_save(model, rank, world, rank, world, 11, out, f"{src}: FSDP2 W={world}")


def train_and_save(model, rank, world, dp_rank, dp_size, seed, out, what):
    """FIT_STEPS AdamW steps on random global batches (data-parallel rank dp_rank of dp_size takes its rows),
    then rank 0 writes OUT: the batches, the mean of the ranks' losses per step, the full weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=FIT_LR, weight_decay=FIT_WD)
    batches = torch.randint(0, model.config.vocab_size, (FIT_STEPS, FIT_BATCH, FIT_SEQ + 1),
                            generator=torch.Generator().manual_seed(seed))
    per = FIT_BATCH // dp_size
    losses = []
    for step in range(FIT_STEPS):
        rows = batches[step, dp_rank * per:(dp_rank + 1) * per]
        logits = model(rows[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        tensors = {"w/" + k: v.contiguous() for k, v in state.items()}
        save_file({"batches": batches, "losses": torch.tensor(losses, dtype=torch.float64), **tensors}, out)
        print(f"{what}, {FIT_STEPS} AdamW steps, losses {losses[0]:.6f} -> {losses[-1]:.6f}")


def tp_fit(rank, world, src, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).train()
    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    parallelize_module(model, mesh["tp"], {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                           "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    train_and_save(model, rank, world, mesh["dp"].get_local_rank(), 2, 12, out,
                   f"{src}: DTensor TP x FSDP2 2x{world // 2}")


def spawn(fn, world, *args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer"))
    from gloo_spawn import spawn_gloo
    spawn_gloo(fn, world, *args)


def fsdp2(args):
    spawn(fsdp2_rank, 2, list(zip(args[::2], args[1::2])))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "check-export":
        check_export(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "fsdp2":
        fsdp2(sys.argv[2:])
    elif sys.argv[1] == "tp":
        spawn(tp_fit, 4, sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
