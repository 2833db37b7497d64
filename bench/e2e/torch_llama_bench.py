"""Python side of the Llama benchmark (bench/e2e/llama_run.sh).

  torch_llama_bench.py make --dir D --batches F [--size 100m|500m|tiny] [--steps N --global_batch B --seq T]
      a random LlamaForCausalLM of that size saved by transformers as a Hugging
      Face directory (fp32), and N batches of random ids [N, B, T + 1].
  torch_llama_bench.py run --dir D --batches F --world W [--steps 5 --warmup 1]
      PyTorch FSDP2 (fully_shard on each decoder layer and the root, Gloo) on
      the transformers model from_pretrained(D) in each of W processes, AdamW on
      the same batches as llama_bench (each rank its rows); one JSON line like
      llama_bench's. --steps 0: load only.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from proc_status import clear_refs, status_kb  # noqa: E402

SIZES = {  # ~params: (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 176, 2, 4, 2, 512),
    "100m": (768, 2048, 12, 12, 4, 16384),
    "500m": (1536, 4096, 16, 12, 4, 32000),
}


def make(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    h, i, n, heads, kv, vocab = SIZES[args.size]
    config = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.dir)
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    save_file({"batches": torch.randint(0, vocab, (args.steps, args.global_batch, args.seq + 1), generator=g)},
              args.batches)
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "size": args.size}))


def rank_main(rank, args, store, out):
    world = args.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    import transformers
    from torch.distributed.fsdp import fully_shard
    transformers.logging.set_verbosity_error()
    clear_refs()
    dist.barrier()
    t0 = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dist.barrier()
    load_s = time.perf_counter() - t0
    peaks = torch.tensor([status_kb("VmHWM") / 1024.0, 0.0], dtype=torch.float64)
    times, loss_value = [], 0.0
    tokens = 0
    if args.steps > 0:
        from safetensors.torch import load_file
        batches = load_file(args.batches)["batches"]
        per = batches.size(1) // world
        tokens = batches.size(1) * (batches.size(2) - 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        clear_refs()
        for s in range(args.warmup + args.steps):
            rows = batches[s, rank * per:(rank + 1) * per]
            t = time.perf_counter()
            opt.zero_grad()
            logits = model(rows[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            if s >= args.warmup:
                times.append(time.perf_counter() - t)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            loss_value = mean.item() / world
        peaks[1] = status_kb("VmHWM") / 1024.0
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if rank == 0:
        median = sorted(times)[len(times) // 2] if times else 0.0
        params = sum(p.numel() for p in model.parameters())  # DTensors: their global sizes
        row = {"impl": "pytorch_fsdp2", "world": world, "params": params,
               "load_s": round(load_s, 2), "load_peak_rss_mib": round(peaks[0].item(), 1),
               "median_step_s": round(median, 4), "tokens_per_s": round(tokens / median, 1) if median else 0.0,
               "step_peak_rss_mib": round(peaks[1].item(), 1), "final_loss": round(loss_value, 6)}
        with open(out, "w") as f:
            f.write(json.dumps(row) + "\n")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # not the Gloo group's teardown (see tests/trainer/gloo_spawn.py)


def run(args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "store"), out), nprocs=args.world)
        with open(out) as f:
            print(f.read().strip())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["make", "run"])
    p.add_argument("--dir", required=True)
    p.add_argument("--batches", default="")
    p.add_argument("--size", default="100m", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    make(a) if a.mode == "make" else run(a)
