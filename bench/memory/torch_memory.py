"""Memory benchmark, Python PyTorch side: the GPT of examples/gpt
(tests/python/torch_gpt.py) with FSDP2 (fully_shard on each block and the
root, built on the meta device and materialised shard by shard with to_empty)
and torch.distributed.checkpoint, on CPU with Gloo. Records the peak resident
set size of each rank's process for each phase, as one JSON line per rank and
phase in --out: VmHWM reset between phases through /proc/self/clear_refs, or,
where that does not reset it (gVisor, some containers) or ST_RSS_SAMPLER=1 is
set, the maximum of VmRSS sampled every 2 ms by a thread ("rss_method").

  torch_memory.py --mode train --world W --dir D --out F         construction, step, full save, sharded save
  torch_memory.py --mode load_full|load_sharded --world W ...    construction, full / sharded load
  torch_memory.py --mode self_test --dir . --out -               does the peak method see a 256 MiB transient?
  torch_memory.py --mode save_during_training --save none|sync|async --steps 6 --save_at 2 ...
      dcp.save, or dcp.async_save (its own Gloo group, as the DCP docs advise),
      after step --save_at: phases before_save and after_save (the save and the
      steps after it, to the wait for the future) and a "timing" line per rank.
"""
import argparse
import json
import mmap
import os
import socket
import sys
import threading
import time
from datetime import timedelta

# A CPU benchmark: on a machine with a GPU, FSDP2's fully_shard picks the
# CUDA device and moves the model there (seen on the lent H200 machine: the
# loss then failed with tensors on cpu and cuda:0). Hide the GPUs before torch loads.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from proc_status import clear_refs, status_kb  # noqa: E402
from torch_gpt import GPT  # noqa: E402


def clear_refs_resets_peak():
    """True when clear_refs resets VmHWM (a touched, released 64 MiB mapping raises it)."""
    m = mmap.mmap(-1, 64 << 20)
    m.write(b"\1" * (64 << 20))
    m.close()
    raised = status_kb("VmHWM")
    return clear_refs() and status_kb("VmHWM") < raised - 32 * 1024


class PeakMeter:
    """Peak RSS of this process since the last reset(): VmHWM + clear_refs, or a VmRSS sampler thread."""

    def __init__(self):
        self.sampler = os.environ.get("ST_RSS_SAMPLER") == "1" or not clear_refs_resets_peak()
        self.method = "vmrss_sampler_2ms" if self.sampler else "vmhwm_clear_refs"
        if self.sampler:
            self.fd = os.open("/proc/self/statm", os.O_RDONLY)
            self.page_kb = os.sysconf("SC_PAGESIZE") // 1024
            self.max_kb = self.rss_kb()
            threading.Thread(target=self._loop, daemon=True).start()

    def rss_kb(self):
        return int(os.pread(self.fd, 128, 0).split()[1]) * self.page_kb

    def _loop(self):
        while True:  # os.pread and time.sleep release the GIL
            v = self.rss_kb()
            if v > self.max_kb:
                self.max_kb = v
            time.sleep(0.002)

    def reset(self):
        if not self.sampler:
            if not clear_refs():
                raise RuntimeError("cannot write /proc/self/clear_refs (needed to reset VmHWM between phases)")
            return
        clear_refs()  # where it works, VmHWM is recorded next to the sampler's peak for comparison
        self.max_kb = self.rss_kb()

    def peak_kb(self):
        if not self.sampler:
            return status_kb("VmHWM")
        self.max_kb = max(self.max_kb, self.rss_kb())
        return self.max_kb


def self_test():
    """A 256 MiB tensor filled, held 50 ms and freed must show in the peak; exit 1 if not."""
    meter = PeakMeter()
    meter.reset()
    before = status_kb("VmRSS")
    t = torch.ones(64 << 20)
    time.sleep(0.05)
    del t
    after = status_kb("VmRSS")
    seen = (meter.peak_kb() - before) / 1024.0
    ok = seen >= 0.9 * 256 and after - before < 128 * 1024
    print(json.dumps({"self_test": "pytorch", "rss_method": meter.method, "expected_mib": 256,
                      "seen_mib": round(seen, 1), "ok": ok}))
    sys.exit(0 if ok else 1)


def train_step(model, opt, g, args):
    """One optimizer step on a random batch of 1 x block_size tokens from `g`."""
    tok = torch.randint(args.vocab, (1, args.block_size + 1), generator=g)
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def run(rank, args, port):
    start = time.monotonic()
    baseline = status_kb("VmRSS")
    world = args.world
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=20))
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict, set_state_dict)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    meter = PeakMeter()

    def record(phase):
        line = json.dumps({"impl": "pytorch_fsdp2_dcp", "model": args.label, "W": world, "rank": rank,
                           "phase": phase, "peak_mib": meter.peak_kb() / 1024.0,
                           "baseline_mib": baseline / 1024.0, "rss_method": meter.method,
                           "vmhwm_mib": status_kb("VmHWM") / 1024.0,
                           "t_s": round(time.monotonic() - start, 2)}) + "\n"
        fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line.encode())
        os.close(fd)
        dist.barrier()
        meter.reset()

    meter.reset()
    torch.manual_seed(1)
    with torch.device("meta"):
        model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if name.endswith("bias"):
                local.zero_()
            elif "ln" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    record("construction")

    full_path = os.path.join(args.dir, "full.pt")
    sharded_dir = os.path.join(args.dir, "dcp")
    if args.mode == "train":
        g = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            train_step(model, opt, g, args)
        record("step")
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, full_path)
        del msd, osd
        record("full_save")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=sharded_dir)
        del msd, osd
        record("sharded_save")
    elif args.mode == "save_during_training":
        save_during_training(args, rank, world, model, opt, record, dcp, get_state_dict, sharded_dir)
    elif args.mode == "load_full":
        # Every rank maps the file (no copy) and takes its shards from it
        # (broadcast_from_rank0=True hung here with Gloo on CPU).
        full = torch.load(full_path, mmap=True, weights_only=True)
        set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                       options=StateDictOptions(full_state_dict=True))
        del full
        record("full_load")
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=sharded_dir)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        del sd, msd, osd
        record("sharded_load")
    dist.destroy_process_group()


def save_during_training(args, rank, world, model, opt, record, dcp, get_state_dict, sharded_dir):
    """--steps steps; after --save_at a DCP save (none, sync, async); per-step times as in memory_bench."""
    group = dist.new_group(backend="gloo") if args.save == "async" else None
    g = torch.Generator().manual_seed(rank)
    step_s, save_call_s, future = [], 0.0, None
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        train_step(model, opt, g, args)
        step_s.append(time.monotonic() - t0)
        if step == args.save_at:
            record("before_save")
            t0 = time.monotonic()
            if args.save != "none":
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                if args.save == "sync":
                    dcp.save(state, checkpoint_id=sharded_dir)
                else:
                    future = dcp.async_save(state, checkpoint_id=sharded_dir, process_group=group)
                del msd, osd, state
            save_call_s = time.monotonic() - t0
    t0 = time.monotonic()
    if future is not None:
        future.result()
    wait_s = time.monotonic() - t0
    record("after_save")
    line = json.dumps({"impl": "pytorch_fsdp2_dcp", "model": args.label, "W": world, "rank": rank, "phase": "timing",
                       "save": args.save, "save_at": args.save_at, "save_call_s": save_call_s, "step_s": step_s,
                       "final_wait_s": wait_s}) + "\n"
    fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())
    os.close(fd)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["train", "load_full", "load_sharded", "save_during_training", "self_test"],
                   required=True)
    p.add_argument("--save", choices=["none", "sync", "async"], default="async")
    p.add_argument("--save_at", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / world)")
    for name, default in [("n_layer", 16), ("n_embd", 1024), ("n_head", 16), ("block_size", 32), ("vocab", 96),
                          ("steps", 1)]:
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    if args.mode == "self_test":
        self_test()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run, args=(args, port), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
