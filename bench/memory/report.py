"""Table and plot for bench/memory/run.sh: peak RSS per rank per phase,
ShardTrain against PyTorch FSDP2 + DCP and against the theory bound
  state / W + largest unit + activations + process baseline
(state: fp32 parameters, gradients and AdamW's two moments, 16 bytes per
parameter; largest unit: one transformer block's fp32 parameters; activations
of batch 1 x T tokens in fp32; baseline: ShardTrain's process RSS before the
Trainer starts). Prints the markdown section; writes docs/memory_phases.png.
Usage: report.py results.jsonl --n_layer=16 --n_embd=1024 --n_head=16 [--block_size=32 --vocab=96]
                 [--label=gpt-201.7M (only that model's rows)] [--png=PATH ('' for none)]
"""
import argparse
import collections
import json
import os
import sys

PHASES = ["construction", "step", "full_save", "sharded_save", "full_load", "sharded_load"]
MIB = 1024.0 * 1024.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    for name, default in [("n_layer", 16), ("n_embd", 1024), ("n_head", 16), ("block_size", 32), ("vocab", 96)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--label", default=None, help="only rows of this model label")
    p.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                                                 "memory_phases.png"))
    a = p.parse_args()
    d, L, T, V = a.n_embd, a.n_layer, a.block_size, a.vocab
    block = 12 * d * d + 13 * d
    n = L * block + V * d + T * d + 2 * d
    acts = 2 * T * d * (34 + 5 * a.n_head * T / d) * L + 3 * T * V * 4  # fp32: twice the 16-bit estimate
    rows = [json.loads(l) for l in open(a.results) if l.strip()]
    stopped = [r["stopped"] for r in rows if "stopped" in r and (a.label is None or a.label in r["stopped"])]
    rows = [r for r in rows if "stopped" in r or a.label is None or r.get("model") == a.label]
    methods = collections.defaultdict(set)  # impl -> how peaks were measured
    for r in rows:
        if "stopped" not in r:
            methods[r["impl"]].add(r.get("rss_method", "vmhwm_clear_refs"))
    peak = collections.defaultdict(dict)  # (impl, W, phase) -> {rank: MiB}
    base = collections.defaultdict(list)
    for r in rows:
        if "stopped" in r:
            continue
        peak[(r["impl"], r["W"], r["phase"])][r["rank"]] = r["peak_mib"]
        base[(r["impl"], r["W"])].append(r["baseline_mib"])
    worlds = sorted({k[1] for k in peak})
    out = []
    out.append(f"GPT {L} layers, d {d}: {n / 1e6:.1f}M parameters; batch 1 x {T} tokens, AdamW, fp32, CPU. "
               f"Largest unit (one block) {block * 4 / MIB:.0f} MiB; activations ~{acts / MIB:.0f} MiB.\n")
    out.append("| W | phase | ShardTrain max rank (rank 0) MiB | PyTorch FSDP2+DCP max rank MiB | theory MiB "
               "| ShardTrain / theory | ShardTrain / PyTorch |")
    out.append("|---|---|---|---|---|---|---|")
    plot = []
    for W in worlds:
        st_base = base[("shardtrain", W)]
        baseline = sum(st_base) / len(st_base) if st_base else 0.0
        theory = 16 * n / W / MIB + block * 4 / MIB + acts / MIB + baseline
        for ph in PHASES:
            st = peak.get(("shardtrain", W, ph), {})
            py = peak.get(("pytorch_fsdp2_dcp", W, ph), {})
            st_max = max(st.values()) if st else None
            py_max = max(py.values()) if py else None
            f = lambda v: f"{v:.0f}" if v is not None else "n/a"
            out.append(f"| {W} | {ph} | {f(st_max)} ({f(st.get(0))}) | {f(py_max)} | {theory:.0f} | "
                       f"{(st_max / theory if st_max else float('nan')):.2f} | "
                       f"{(st_max / py_max if st_max and py_max else float('nan')):.2f} |")
            plot.append((W, ph, st_max, py_max, theory))
    out.append("")
    out.append(f"Process baselines (RSS once LibTorch is loaded, before any rank starts): ShardTrain "
               + ", ".join(f"W={W} {sum(base[('shardtrain', W)]) / max(1, len(base[('shardtrain', W)])):.0f} MiB"
                           for W in worlds)
               + "; PyTorch (after `import torch`) "
               + ", ".join(f"W={W} {sum(base[('pytorch_fsdp2_dcp', W)]) / max(1, len(base[('pytorch_fsdp2_dcp', W)])):.0f} MiB"
                           for W in worlds) + ".")
    out.append("Peak RSS measured by: " + "; ".join(f"{impl} {', '.join(sorted(m))}" for impl, m in sorted(methods.items()))
               + " (vmhwm_clear_refs: VmHWM reset through /proc/self/clear_refs; vmrss_sampler_2ms: the largest "
               "VmRSS seen by a thread reading it every 2 ms).")
    if stopped:
        out.append("\nStopped (timeout or memory guard): " + "; ".join(stopped))
    print("\n".join(out))
    if not a.png:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), sharey=False, squeeze=False)
    for ax, W in zip(axes[0], worlds):
        pts = [x for x in plot if x[0] == W]
        xs = range(len(pts))
        ax.bar([x - 0.2 for x in xs], [p[2] or 0 for p in pts], 0.4, label="ShardTrain")
        ax.bar([x + 0.2 for x in xs], [p[3] or 0 for p in pts], 0.4, label="PyTorch FSDP2+DCP")
        ax.axhline(pts[0][4], color="k", ls="--", lw=1, label="theory")
        ax.axhline(pts[0][4] * 1.15, color="r", ls=":", lw=1, label="1.15 x theory")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([p[1].replace("_", "\n") for p in pts], fontsize=8)
        ax.set_title(f"W={W}: peak RSS per rank (MiB)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.png, dpi=80)


if __name__ == "__main__":
    main()
