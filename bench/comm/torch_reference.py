#!/usr/bin/env python3
"""The same benchmark as //bench/comm:comm_bench through torch.distributed on Gloo.

all_gather_into_tensor, reduce_scatter_tensor and all_reduce at world size W
(default 2), one process per rank, from the pinned torch in the project venv:

    /work/main/.deps/venv/bin/python bench/comm/torch_reference.py --out py.csv

Started without --rank, this process is rank 0 and starts ranks 1..W-1 as
subprocesses of the same script. Methodology matches comm_bench.cc exactly: per
op x dtype x size (bytes of the FULL buffer) one checked call with exact values,
--warmup untimed calls, then timed calls each preceded by a barrier; rank 0
reports the median. Bytes sent are not observable through torch.distributed;
the CSV carries the theoretical (W-1)/W (2(W-1)/W for all-reduce) of the full
buffer in both byte columns.
"""
import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--world_size", type=int, default=2)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=0)
    p.add_argument("--sizes_mib", default="1,4,16,64,256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ops", default="all_gather,reduce_scatter,all_reduce")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--small_iters", type=int, default=25)
    p.add_argument("--small_mib", type=int, default=16)
    p.add_argument("--large_iters", type=int, default=5)
    p.add_argument("--large_mib", type=int, default=256)
    p.add_argument("--intra_op_threads", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--timeout_s", type=int, default=300)
    p.add_argument("--latency_iters", type=int, default=0,
                   help="if > 0: also time this many back-to-back all-reduces of one float32 element")
    return p.parse_args(argv)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(op, shard, full):
    if op == "all_gather":
        dist.all_gather_into_tensor(full, shard)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM)
    else:
        dist.all_reduce(full, op=dist.ReduceOp.SUM)


def checked_call(op, shard, full, rank, w):
    n = shard.numel()
    tri = w * (w + 1) / 2
    if op == "all_gather":
        shard.fill_(rank + 1)
        full.fill_(-1)
        run_once(op, shard, full)
        ok = all(bool(full[b * n:(b + 1) * n].eq(b + 1).all()) for b in range(w))
    elif op == "reduce_scatter":
        blocks = full.view(w, n)
        for b in range(w):
            blocks[b].fill_((rank + 1) * (b + 1))
        shard.fill_(-1)
        run_once(op, shard, full)
        ok = bool(shard.eq((rank + 1) * tri).all())
    else:
        full.fill_(rank + 1)
        run_once(op, shard, full)
        ok = bool(full.eq(tri).all())
    if not ok:
        print(f"rank {rank}: WRONG RESULT for {op} {full.dtype}", file=sys.stderr)
    return ok


def run_rank(a):
    if a.intra_op_threads > 0:
        torch.set_num_threads(a.intra_op_threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master_addr}:{a.master_port}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=a.timeout_s),
    )
    w, rank = dist.get_world_size(), dist.get_rank()
    leader = rank == 0
    cases = [(op, dt, int(m) << 20) for op in a.ops.split(",") for dt in a.dtypes.split(",")
             for m in a.sizes_mib.split(",")]
    writer = None
    if leader and a.out:
        fh = open(a.out, "w", newline="")
        writer = csv.writer(fh)
        writer.writerow(["impl", "op", "dtype", "size_bytes", "world_size", "iters", "median_ms", "min_ms",
                         "algbw_gbps", "busbw_gbps", "bytes_sent_per_call", "expected_bytes_per_call"])
    if leader:
        print(f"# torch.distributed gloo (torch {torch.__version__}): W={w}, "
              f"intra-op threads {torch.get_num_threads()}")
        print(f"{'op':15} {'dtype':9} {'size':>9} {'iters':>5} {'median_ms':>10} {'min_ms':>10} "
              f"{'algbw_GB/s':>10} {'busbw_GB/s':>10}")
    all_ok = True
    if a.latency_iters > 0:  # per-call latency, as comm_bench's TimeLatency
        t = torch.zeros(1)
        for _ in range(20):
            dist.all_reduce(t)
        dist.barrier()
        ms = []
        for _ in range(a.latency_iters):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            ms.append((time.perf_counter() - t0) * 1e3)
        if leader:
            med, mn = statistics.median(ms), min(ms)
            print(f"{'tiny_all_reduce':15} {'float32':9} {'4B':>9} {a.latency_iters:5d} {med:10.3f} {mn:10.3f}"
                  "   (per-call latency)", flush=True)
            if writer:
                sent = int(2 * (w - 1) / w * 4)
                writer.writerow(["pytorch", "tiny_all_reduce", "float32", 4, w, a.latency_iters, med, mn, 0, 0, sent,
                                 sent])
                fh.flush()
    for op, dt, full_bytes in cases:
        dtype = DTYPES[dt]
        elem = torch.empty(0, dtype=dtype).element_size()
        full_numel = full_bytes // elem
        full = torch.empty(full_numel, dtype=dtype)
        shard = torch.empty(full_numel // w, dtype=dtype)
        all_ok = checked_call(op, shard, full, rank, w) and all_ok
        for _ in range(a.warmup):
            run_once(op, shard, full)
        if op == "all_reduce":
            full.fill_(1)
        mib = full_bytes >> 20
        iters = a.large_iters if mib >= a.large_mib else a.small_iters if mib < a.small_mib else a.iters
        ms = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            run_once(op, shard, full)
            ms.append((time.perf_counter() - t0) * 1e3)
        bus = 2 * (w - 1) / w if op == "all_reduce" else (w - 1) / w
        med, mn = statistics.median(ms), min(ms)
        algbw = full_bytes / (med * 1e-3) / 1e9
        expected = int(bus * full_bytes)
        if leader:
            print(f"{op:15} {dt:9} {full_bytes >> 20:6d}MiB {iters:5d} {med:10.2f} {mn:10.2f} "
                  f"{algbw:10.3f} {algbw * bus:10.3f}", flush=True)
            if writer:
                writer.writerow(["pytorch", op, dt, full_bytes, w, iters, med, mn, algbw, algbw * bus, expected,
                                 expected])
                fh.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all_ok else 3


def main():
    a = parse_args()
    if a.rank >= 0:
        return run_rank(a)
    if a.master_port == 0:
        a.master_port = free_port()
    children = []
    for r in range(1, a.world_size):
        cmd = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + [
            f"--rank={r}", f"--master_port={a.master_port}", "--out="]
        children.append(subprocess.Popen(cmd))
    a.rank = 0
    try:
        rc = run_rank(a)
    except Exception as e:  # noqa: BLE001 - report and stop the other ranks
        print(f"rank 0 failed: {e}", file=sys.stderr)
        rc = 1
    if rc != 0:
        for c in children:
            c.terminate()
    for r, c in enumerate(children, start=1):
        if c.wait() != 0:
            print(f"rank {r} failed (exit {c.returncode})", file=sys.stderr)
            rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
