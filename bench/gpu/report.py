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
    curves = [r for r in runs if "precision" in r]  # trainer_curves.py's lines
    runs = [r for r in runs if "precision" not in r]
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
            "checkpointing is not counted. Memory: peak of the CUDA caching allocator over the steps (reset after "
            "construction). Offload: float32 shards, gradients and AdamW state on the host (ShardTrain "
            "offload_params, FSDP2 CPUOffloadPolicy). plain_libtorch: the same model without sharding, float32 "
            "parameters under bf16 autocast.",
            "",
        ]
    lines += ["| implementation | act. ckpt | offload | median step (s) | tokens/s | TFLOP/s | MFU | peak allocated (GiB) | "
              "peak reserved (GiB) | loss first → last |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        ck = "yes" if r.get("checkpointing") else "no"
        off = "yes" if r.get("offload") else "no"
        if "error" in r:
            lines.append(f"| {r.get('impl', '?')} | {ck if 'checkpointing' in r else '–'} | "
                         f"{off if 'offload' in r else '–'} | failed: {r['error'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {r['impl']} | {ck} | {off} | {fmt(r['median_step_s'], '.4f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
            f"{fmt(r['achieved_tflops'], '.1f')} | {fmt(100 * r['mfu'], '.1f')}% | "
            f"{fmt(r['peak_mem_allocated_gib'], '.2f')} | {fmt(r['peak_mem_reserved_gib'], '.2f')} | "
            f"{fmt(r['first_loss'], '.3f')} → {fmt(r['final_loss'], '.3f')} |")
    # ShardTrain against PyTorch at the same checkpointing setting.
    ratios = []
    for ck, off in ((False, False), (True, False), (False, True)):
        same = [r for r in ok if bool(r.get("checkpointing")) == ck and bool(r.get("offload")) == off]
        st = [r for r in same if r["impl"].startswith("shardtrain")]
        pt = [r for r in same if r["impl"].startswith("pytorch")]
        if st and pt:
            setting = "with CPU offload" if off else f"{'with' if ck else 'without'} activation checkpointing"
            ratios.append(
                f"- {setting}: ShardTrain tokens/s = "
                f"{st[0]['tokens_per_s'] / pt[0]['tokens_per_s']:.2f}× PyTorch FSDP2's; peak allocated memory "
                f"{st[0]['peak_mem_allocated_gib']:.2f} vs {pt[0]['peak_mem_allocated_gib']:.2f} GiB")
    plain = [r for r in ok if r["impl"] == "plain_libtorch"]
    st0 = [r for r in ok if r["impl"].startswith("shardtrain") and not r.get("checkpointing") and not r.get("offload")]
    if plain and st0:
        ratios.append(f"- ShardTrain's step = {st0[0]['median_step_s'] / plain[0]['median_step_s']:.3f}× plain "
                      f"LibTorch's (goal: within 1.03); peak allocated {st0[0]['peak_mem_allocated_gib']:.2f} vs "
                      f"{plain[0]['peak_mem_allocated_gib']:.2f} GiB")
    if ratios:
        lines += ["", *ratios]
    if curves:
        lines += ["", "The Trainer on CUDA against the same run on the CPU (examples/gpt, W=1, per-step train_loss):", "",
                  "| precision | steps | max relative difference | tolerance | final loss CPU → CUDA | result |",
                  "|---|---:|---:|---:|---|---|"]
        for c in curves:
            if "max_rel_diff" not in c:
                lines.append(f"| {c['precision']} | {c['steps']} | – | {c['tolerance']:g} | – | "
                             f"failed: {c.get('error', '?')[:120]} |")
                continue
            lines.append(f"| {c['precision']} | {c['steps']} | {c['max_rel_diff']:.2e} (step {c['worst_step']}) | "
                         f"{c['tolerance']:g} | {c['cpu_final']:.4f} → {c['cuda_final']:.4f} | "
                         f"{'passed' if c['passed'] else 'failed'} |")
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
