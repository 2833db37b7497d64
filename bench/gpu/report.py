"""Turns the JSON lines of gpt_gpu_bench and torch_fsdp_gpu.py (one per run)
into the markdown report of bench/gpu/run.sh.

  python bench/gpu/report.py RESULTS.jsonl OUT.md [--machine "text"] [--command "text"]
"""
import argparse
import json
import sys


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "–"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("out")
    p.add_argument("--machine", default="")
    p.add_argument("--command", default="")
    a = p.parse_args()
    runs = []
    with open(a.results) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    runs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    ok = [r for r in runs if "error" not in r]
    ref = ok[0] if ok else {}
    lines = ["# ShardTrain vs PyTorch FSDP2 on one GPU (bench/gpu/run.sh)", ""]
    if a.machine:
        lines += [a.machine, ""]
    if ref:
        billions = ref["params"] / 1e9
        lines += [
            f"Model: examples/gpt GPT, {ref['n_layer']} layers, d={ref['n_embd']}, {ref['n_head']} heads, "
            f"vocab {ref['vocab']}, sequence {ref['seq']} — **{ref['params']:,} parameters ({billions:.3f} B)**, "
            f"tied output head.",
            f"Step: batch {ref['batch']} × {ref['seq']} = {ref['tokens_per_step']:,} tokens, AdamW; median of "
            f"{ref['steps']} timed steps after {ref['warmup']} warmup step{'s' if ref['warmup'] != 1 else ''} "
            "(each step synchronized; random tokens).",
            "Precision: bf16 parameters for compute and bf16 gradient reduction, float32 master shards and AdamW "
            "state. World size 1. ShardTrain: `sharding::ShardedModel` FULL_SHARD, one unit per block + root, "
            "1-rank NcclCommunicator. PyTorch: FSDP2 `fully_shard` per block + root, "
            "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`, 1-rank NCCL process group.",
            f"MFU = tokens/s × (6·N + 12·L·T·d) FLOPs per token ({ref['flops_per_token']:.4g}) over a peak of "
            f"**{ref['peak_tflops']:g} TFLOP/s** (dense bf16, H100/H200 SXM); recompute under activation "
            "checkpointing is not counted. Memory: peak of the CUDA caching allocator over the whole run.",
            "",
        ]
    lines += ["| implementation | act. ckpt | median step (s) | tokens/s | TFLOP/s | MFU | peak allocated (GiB) | "
              "peak reserved (GiB) | loss first → last |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        ck = "yes" if r.get("checkpointing") else "no"
        if "error" in r:
            lines.append(f"| {r.get('impl', '?')} | {ck if 'checkpointing' in r else '–'} | failed: "
                         f"{r['error'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {r['impl']} | {ck} | {fmt(r['median_step_s'], '.4f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
            f"{fmt(r['achieved_tflops'], '.1f')} | {fmt(100 * r['mfu'], '.1f')}% | "
            f"{fmt(r['peak_mem_allocated_gib'], '.2f')} | {fmt(r['peak_mem_reserved_gib'], '.2f')} | "
            f"{fmt(r['first_loss'], '.3f')} → {fmt(r['final_loss'], '.3f')} |")
    # ShardTrain against PyTorch at the same checkpointing setting.
    ratios = []
    for ck in (False, True):
        st = [r for r in ok if r.get("checkpointing") == ck and r["impl"].startswith("shardtrain")]
        pt = [r for r in ok if r.get("checkpointing") == ck and r["impl"].startswith("pytorch")]
        if st and pt:
            ratios.append(
                f"- {'with' if ck else 'without'} activation checkpointing: ShardTrain tokens/s = "
                f"{st[0]['tokens_per_s'] / pt[0]['tokens_per_s']:.2f}× PyTorch FSDP2's; peak allocated memory "
                f"{st[0]['peak_mem_allocated_gib']:.2f} vs {pt[0]['peak_mem_allocated_gib']:.2f} GiB")
    if ratios:
        lines += ["", *ratios]
    failed = [r for r in runs if "error" in r]
    if not runs:
        lines += ["", "No run produced a result; see the log next to this file."]
    elif failed:
        lines += ["", f"{len(failed)} run(s) failed; see gpu_benchmark.log next to this file."]
    if a.command:
        lines += ["", f"Command: `{a.command}`"]
    text = "\n".join(lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
