"""Python PyTorch side of bench/gpu/run.sh: the GPT of tests/python/torch_gpt.py
(the same model as examples/gpt/gpt_model.h) trained on one GPU with FSDP2 —
fully_shard on every block and on the root, MixedPrecisionPolicy(param_dtype=
bf16, reduce_dtype=bf16), NCCL process group of one rank — and AdamW, with
the sizes, batch and steps of gpt_gpu_bench. Prints one JSON line with the
same fields as gpt_gpu_bench: median step time, tokens/s, achieved TFLOP/s,
MFU (6*N + 12*L*T*d FLOPs per token over --peak_tflops, default 989 = H100/H200
SXM dense bf16), peak CUDA memory (torch.cuda.max_memory_allocated/reserved).

  python bench/gpu/torch_fsdp_gpu.py [--batch 16] [--steps 10] [--warmup 3] [--checkpoint]

--cpu_smoke runs it on the CPU over Gloo (a check without a GPU; tiny models).
Exit status: 0 ok, 2 no CUDA device, 3 CUDA out of memory, 1 other errors;
failures also print a JSON line with "error".
"""
import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("n_layer", 24), ("n_embd", 1792), ("n_head", 16), ("block_size", 1024), ("vocab", 50304),
                          ("batch", 16), ("steps", 10), ("warmup", 3), ("device", 0), ("seed", 1234)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: shards, gradients and AdamW on the host")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200 SXM: 989)")
    p.add_argument("--label", default="pytorch_fsdp2")
    p.add_argument("--cpu_smoke", action="store_true", help="run on the CPU over Gloo (no GPU; tiny models)")
    a = p.parse_args()
    if a.batch <= 0 or a.steps <= 0 or a.warmup < 0 or a.peak_tflops <= 0:
        p.error("--batch and --steps must be positive, --warmup non-negative, --peak_tflops positive")
    return a


def num_parameters(a):
    """GptConfig::NumParameters (tied head counted once)."""
    d = a.n_embd
    per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return a.vocab * d + a.block_size * d + a.n_layer * per_block + 2 * d


def init_weights(model, n_layer):
    """The initialization of examples/gpt/gpt_model.cc: N(0, 0.02) for
    embeddings and linear weights, N(0, 0.02/sqrt(2L)) for the residual
    projections (c_proj), zero biases, LayerNorm ones/zeros."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2.0 * n_layer))
            elif name.startswith(("wte.", "wpe.")) or (name.endswith(".weight") and p.dim() == 2):
                p.normal_(0.0, 0.02)
            elif ".ln_" in name or name.startswith("ln_f."):
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            elif name.endswith(".bias"):
                p.zero_()


def fail(label, status, message):
    print(f"torch_fsdp_gpu: {message}", file=sys.stderr, flush=True)
    print(json.dumps({"impl": label, "error": message.splitlines()[0] if message else "error"}), flush=True)
    return status


def run(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch_gpt import GPT

    if a.cpu_smoke:
        device = torch.device("cpu")
        gpu_name = "cpu (--cpu_smoke)"
    else:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return fail(a.label, 2, "no CUDA device (torch.cuda.is_available() is False); this benchmark needs one "
                        "NVIDIA GPU")
        if not 0 <= a.device < torch.cuda.device_count():
            return fail(a.label, 2, f"--device={a.device} but only {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", a.device)
        torch.cuda.set_device(device)
        gpu_name = torch.cuda.get_device_name(device)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if a.cpu_smoke:
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        n_params = num_parameters(a)
        print(f"torch_fsdp_gpu: GPT(vocab={a.vocab}, block={a.block_size}, layers={a.n_layer}, heads={a.n_head}, "
              f"embd={a.n_embd}, params={n_params}) on {gpu_name}; batch {a.batch} x {a.block_size} tokens, "
              f"{a.warmup}+{a.steps} steps{', activation checkpointing' if a.checkpoint else ''}",
              file=sys.stderr, flush=True)
        t_init = time.perf_counter()
        torch.manual_seed(a.seed)
        with torch.device(device):
            model = GPT(a.vocab, a.block_size, a.n_layer, a.n_head, a.n_embd)
        init_weights(model, a.n_layer)
        counted = sum(p.numel() for p in model.parameters())
        assert counted == n_params, f"parameter count {counted} != {n_params}"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        # (no page-locked memory without a GPU: the rehearsal's --cpu_smoke)
        offload = CPUOffloadPolicy(pin_memory=not a.cpu_smoke) if a.offload else OffloadPolicy()
        for block in model.h:
            if a.checkpoint:
                from torch.distributed._composable import checkpoint
                checkpoint(block)
            fully_shard(block, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mp_policy=mp, offload_policy=offload)
        if device.type == "cuda":
            torch.cuda.synchronize()
        init_s = time.perf_counter() - t_init
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)

        total = a.warmup + a.steps
        data = torch.randint(a.vocab, (total, a.batch, a.block_size + 1), device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":  # the steps' peak, not construction's (the whole model at W=1)
            torch.cuda.reset_peak_memory_stats(device)
        times, first, last = [], 0.0, 0.0
        for s in range(total):
            x = data[s, :, :-1].contiguous()
            y = data[s, :, 1:].contiguous()
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            del logits
            loss.backward()
            opt.step()
            sync()
            dt = time.perf_counter() - t0
            last = loss.item()
            if s == 0:
                first = last
            if not math.isfinite(last):
                raise RuntimeError(f"loss is not finite at step {s}")
            if s >= a.warmup:
                times.append(dt)
            print(f"torch_fsdp_gpu: step {s + 1}/{total}  {dt:.3f} s  loss {last:.4f}", file=sys.stderr, flush=True)

        median = statistics.median(times)
        tokens_per_s = a.batch * a.block_size / median
        flops_per_token = 6.0 * n_params + 12.0 * a.n_layer * a.block_size * a.n_embd
        tflops = tokens_per_s * flops_per_token / 1e12
        gib = 1024.0 ** 3
        peak_alloc = torch.cuda.max_memory_allocated(device) / gib if device.type == "cuda" else 0.0
        peak_reserved = torch.cuda.max_memory_reserved(device) / gib if device.type == "cuda" else 0.0
        print(json.dumps({
            "impl": a.label, "gpu": gpu_name, "world": 1, "strategy": "FSDP2 fully_shard (reshard_after_forward)",
            "params": n_params, "n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head, "seq": a.block_size,
            "vocab": a.vocab, "batch": a.batch, "tokens_per_step": a.batch * a.block_size, "steps": a.steps,
            "warmup": a.warmup, "checkpointing": a.checkpoint, "offload": a.offload, "param_dtype": "bf16",
            "reduce_dtype": "bf16",
            "init_s": round(init_s, 2), "median_step_s": round(median, 4), "min_step_s": round(min(times), 4),
            "tokens_per_s": round(tokens_per_s, 1), "flops_per_token": float(f"{flops_per_token:.6g}"),
            "achieved_tflops": round(tflops, 1), "peak_tflops": a.peak_tflops, "mfu": round(tflops / a.peak_tflops, 4),
            "peak_mem_allocated_gib": round(peak_alloc, 2), "peak_mem_reserved_gib": round(peak_reserved, 2),
            "first_loss": round(first, 4), "final_loss": round(last, 4), "torch": torch.__version__,
        }), flush=True)
        return 0
    finally:
        dist.destroy_process_group()


def main():
    a = parse_args()
    try:
        import torch
    except ImportError as e:
        return fail(a.label, 1, f"cannot import torch: {e}")
    try:
        return run(a)
    except torch.cuda.OutOfMemoryError as e:
        return fail(a.label, 3, f"CUDA out of memory; pass a smaller --batch (or --checkpoint)\n{e}")
    except Exception as e:  # noqa: BLE001 - report every failure as a JSON line too
        return fail(a.label, 1, f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
