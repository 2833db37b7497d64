"""Python PyTorch side of bench/e2e: the same GPT, weights and batches as
gpt_bench, trained with FSDP2 (fully_shard on each block and the root), DDP,
or plain single-process training, on CPU with Gloo. Prints one JSON line like
gpt_bench. Usage: torch_bench.py --impl fsdp2|ddp|plain|local --world W --data_dir D ...
("local": each of the W processes trains its own share of the batch without
any communication, the local-compute baseline under the same core sharing.)
"""
import argparse
import json
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from proc_status import clear_refs, status_kb  # noqa: E402
from torch_gpt import GPT  # noqa: E402


def run(rank, args, port, result_q):
    world = args.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1 or args.impl != "plain":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    talk = dist.is_initialized() and args.impl != "local"  # "local" uses the group only to report
    init = torch.load(os.path.join(args.data_dir, "init.pt"), weights_only=False)
    data = torch.load(os.path.join(args.data_dir, "data.pt"), weights_only=False)
    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    model.load_state_dict(init)
    del init  # the model holds the weights now (gpt_bench drops its copy too)
    if args.impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    elif args.impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # The steps' own peak, apart from construction (as gpt_bench): VmHWM restarts here.
    step_peak_known = clear_refs()
    per = args.global_batch // world
    times, last = [], 0.0
    cpu0 = time.process_time()
    flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for s in range(args.warmup + args.steps):
        x = data[f"x.{s}"][rank * per:(rank + 1) * per]
        y = data[f"y.{s}"][rank * per:(rank + 1) * per]
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        l = loss.detach().double().reshape(1)
        if talk:
            dist.all_reduce(l)
            l /= world
        last = l.item()
        if s == args.warmup - 1:
            cpu0 = time.process_time()  # all threads of this process
            flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if s >= args.warmup:
            times.append(dt)
    cpu = torch.tensor([(time.process_time() - cpu0) / args.steps], dtype=torch.double)
    if dist.is_initialized():
        dist.all_reduce(cpu)
        cpu /= world
    # Minor page faults per timed step, summed over the ranks (as gpt_bench).
    flt = torch.tensor([(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0) / args.steps], dtype=torch.double)
    if dist.is_initialized():
        dist.all_reduce(flt)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                        status_kb("VmHWM") / 1024.0 if step_peak_known else -1.0], dtype=torch.double)
    if dist.is_initialized():
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        times.sort()
        med = times[len(times) // 2]
        result_q.put({"impl": f"pytorch_{args.impl}", "world": world, "median_step_s": round(med, 4),
                      "tokens_per_s": round(args.global_batch * args.block_size / med, 1),
                      "peak_rss_mib": round(rss[0].item(), 1), "step_peak_rss_mib": round(rss[1].item(), 1),
                      "bytes_sent_per_step": None,
                      "final_loss": round(last, 6), "cpu_s_per_step": round(cpu.item(), 3),
                      "minor_faults_per_step": round(flt.item())})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["fsdp2", "ddp", "plain", "local"], required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--data_dir", required=True)
    for name, default in [("n_layer", 8), ("n_embd", 512), ("n_head", 8), ("block_size", 128), ("vocab", 96),
                          ("global_batch", 8), ("steps", 8), ("warmup", 2)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(run, args=(args, port, q), nprocs=args.world, start_method="spawn")
    print(json.dumps(q.get()), flush=True)


if __name__ == "__main__":
    main()
