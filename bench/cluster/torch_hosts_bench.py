"""Python PyTorch side of bench/cluster: the GPT of bench/e2e (same weights and
batches, from gpt_bench --dump_dir) trained with FSDP2 (fully_shard on each
block and the root), HSDP (fully_shard over a 2-D DeviceMesh: replicate across
hosts, shard inside a host), TP + FSDP2 (DTensor tensor parallelism over the
ranks of a host: c_attn and c_fc ColwiseParallel, the c_projs RowwiseParallel;
fully_shard across hosts), DDP, and "local" (every rank trains its own share
of the batch with no communication: the compute baseline), on CPU with Gloo.

Started by torchrun on every namespace host (one process per rank). One launch
serves every emulated network: before each phase rank 0 writes
SYNC/ready.<phase> and waits for SYNC/go.<phase> (bench/cluster/run.sh sets the
link rate in between), so torch is imported once. Prints one JSON line per
phase and implementation (rank 0).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from torch_gpt import GPT  # noqa: E402


def eth0_tx_bytes():
    """Bytes this network namespace sent on eth0 (what crossed the host link)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return float(rest.split()[8])
    return 0.0


def wait_for(path, timeout_s=900):
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"torch_hosts_bench: {path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def tensor_parallel(model, tp_mesh):
    """Splits each block over `tp_mesh` (the ranks of a host): the fused q/k/v projection's rows are
    reordered so that ColwiseParallel's contiguous split gives each rank whole heads of q, k and v (as
    ShardTrain's chunks=3), and the attention runs on the rank's heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp = tp_mesh.size()
    for block in model.h:
        with torch.no_grad():
            for t in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                q, k, v = t.chunk(3, dim=0)
                t.copy_(torch.cat([torch.cat([a.chunk(tp, 0)[r] for a in (q, k, v)]) for r in range(tp)]))
        parallelize_module(block, tp_mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})

        def attention(x, block=block):
            B, T, C = x.shape
            q, k, v = block.attn.c_attn(x).split(C // tp, dim=2)
            h = lambda t: t.view(B, T, block.heads // tp, C // block.heads).transpose(1, 2)
            y = F.scaled_dot_product_attention(h(q), h(k), h(v), is_causal=True)
            return block.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C // tp))
        block.attention = attention


def train(impl, args, init, data, rank, world, local_world, mesh2d):
    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    model.load_state_dict(init)
    # The data-parallel ranks split the batch; the tensor-parallel ranks of a host read the same rows.
    dp_rank, dp_size = (mesh2d["replicate"].get_local_rank(), world // local_world) if impl == "tp_fsdp2" \
        else (rank, world)
    if impl == "tp_fsdp2":
        from torch.distributed.fsdp import fully_shard
        tensor_parallel(model, mesh2d["shard"])
        for block in model.h:
            fully_shard(block, mesh=mesh2d["replicate"])
        fully_shard(model, mesh=mesh2d["replicate"])
    elif impl in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard
        mesh = mesh2d if impl == "hsdp" else None
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    per = args.global_batch // dp_size
    times, last, wire0 = [], 0.0, 0.0
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()
            wire0 = eth0_tx_bytes()
        x = data[f"x.{s}"][dp_rank * per:(dp_rank + 1) * per]
        y = data[f"y.{s}"][dp_rank * per:(dp_rank + 1) * per]
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if s >= args.warmup:
            times.append(dt)
        last = loss.detach().double().item()
    dist.barrier()
    nodes = world // local_world
    wire = eth0_tx_bytes() - wire0 if rank % local_world == 0 else 0.0
    t = torch.tensor([wire / (nodes * args.steps), last / world], dtype=torch.double)
    dist.all_reduce(t)
    times.sort()
    return {"impl": f"pytorch_{impl}", "world": world, "nodes": nodes, "median_step_s": round(times[len(times) // 2], 4),
            "steps_s": [round(x, 4) for x in times], "final_loss": round(t[1].item(), 6),
            "wire_bytes_per_host_step": round(t[0].item())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--sync_dir", required=True)
    p.add_argument("--phases", required=True, help="comma-separated phase names (link rates), in order")
    p.add_argument("--impls", default="local,fsdp2,hsdp,tp_fsdp2,ddp")
    p.add_argument("--local_once", action="store_true", help="run 'local' in the first phase only")
    for name, default in [("n_layer", 4), ("n_embd", 256), ("n_head", 4), ("block_size", 128), ("vocab", 96),
                          ("global_batch", 8), ("steps", 4), ("warmup", 1)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    from torch.distributed.device_mesh import init_device_mesh
    mesh2d = init_device_mesh("cpu", (world // local_world, local_world), mesh_dim_names=("replicate", "shard"))
    init = torch.load(os.path.join(args.data_dir, "init.pt"), weights_only=False)
    data = torch.load(os.path.join(args.data_dir, "data.pt"), weights_only=False)
    for k, phase in enumerate(args.phases.split(",")):
        if rank == 0:
            open(os.path.join(args.sync_dir, f"ready.{phase}"), "w").close()
            wait_for(os.path.join(args.sync_dir, f"go.{phase}"))
        dist.barrier()
        for impl in args.impls.split(","):
            if impl == "local" and args.local_once and k > 0:
                continue
            if impl == "local":
                r = train_local(args, init, data, rank, world, local_world)
            else:
                r = train(impl, args, init, data, rank, world, local_world, mesh2d)
            if rank == 0:
                r["link"] = phase
                print(json.dumps(r), flush=True)
        if rank == 0:
            open(os.path.join(args.sync_dir, f"done.{phase}"), "w").close()
    dist.destroy_process_group()


def train_local(args, init, data, rank, world, local_world):
    """Every rank trains its share of the batch alone (no collective in the step)."""
    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    per = args.global_batch // world
    times = []
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()
        x = data[f"x.{s}"][rank * per:(rank + 1) * per]
        y = data[f"y.{s}"][rank * per:(rank + 1) * per]
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
        opt.step()
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    times.sort()
    return {"impl": "pytorch_local", "world": world, "nodes": world // local_world,
            "median_step_s": round(times[len(times) // 2], 4), "steps_s": [round(x, 4) for x in times],
            "final_loss": None, "wire_bytes_per_host_step": 0}


if __name__ == "__main__":
    main()
