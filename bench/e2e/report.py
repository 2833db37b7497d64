"""Turns bench/e2e results (JSON lines) into docs/benchmarks.md and a PNG plot."""
import datetime
import json
import platform
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results_path, params_path, md_path, png_path, command, model_flags):
    rows = [json.loads(l) for l in open(results_path) if l.strip()]
    params = json.load(open(params_path))["params"]
    w2 = [r for r in rows if r["world"] == 2 or r["impl"] == "pytorch_plain"]
    lines = [
        "# End-to-end benchmark: ShardTrain vs PyTorch",
        "",
        f"Produced by `{command}` on {datetime.date.today()} ({platform.machine()}, "
        f"{__import__('os').cpu_count()} cores, CPU only, Gloo over loopback). GPT with {params / 1e6:.1f}M "
        f"parameters, flags `{model_flags}`; the same initial weights and batches for every row; AdamW, fp32. "
        "Step time is the median over the timed steps; peak RSS is the maximum over ranks; bytes sent are "
        "ShardTrain's own accounting per rank per step (PyTorch does not report them). Timings on a shared "
        "2-core machine are noisy: compare ratios within one run.",
        "",
        "## W = 2 (and plain single-process training of the same global batch)",
        "",
        "| implementation | W | median step (s) | tokens/s | peak RSS/rank (MiB) | bytes sent/step | loss after N steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in w2:
        b = "—" if r["bytes_sent_per_step"] is None else f"{r['bytes_sent_per_step'] / 2**20:.1f} MiB"
        lines.append(f"| {r['impl']} | {r['world']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_rss_mib']:.0f} | {b} | {r['final_loss']:.5f} |")
    mem = {}
    for r in rows:
        if r["impl"] in ("shardtrain_fsdp_native_FULL_SHARD", "pytorch_fsdp2"):
            mem.setdefault(r["impl"], {})[r["world"]] = r["peak_rss_mib"]
    lines += ["", "## Peak RSS per rank versus W (FULL_SHARD / FSDP2)", "",
              "| implementation | W=1 | W=2 | W=4 |", "|---|---|---|---|"]
    for impl, by_w in mem.items():
        lines.append(f"| {impl} | " + " | ".join(f"{by_w.get(w, float('nan')):.0f}" for w in (1, 2, 4)) + " |")
    lines += ["", "## Persistent training state per rank (parameters + gradients + AdamW moments, fp32)", "",
              "Goal (issue 4): within 10% of 1/W of the unsharded total plus the largest unit's gathered parameters.",
              "", "| implementation | W | persistent (MiB) | 1/W total + largest unit (MiB) | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        if r.get("fsdp_bound_mib"):
            lines.append(f"| {r['impl']} | {r['world']} | {r['persistent_mib']:.1f} | {r['fsdp_bound_mib']:.1f} | "
                         f"{r['persistent_mib'] / r['fsdp_bound_mib']:.2f} |")
    lines += ["", f"![step time and memory]({png_path.split('/')[-1]})", ""]
    open(md_path, "w").write("\n".join(lines))

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["impl"] for r in w2]
    a.barh(names, [r["median_step_s"] for r in w2], color="tab:blue")
    a.set_xlabel("median step time (s), W=2")
    a.invert_yaxis()
    for impl, by_w in mem.items():
        ws = sorted(by_w)
        b.plot(ws, [by_w[w] for w in ws], marker="o", label=impl)
    b.set_xlabel("world size W")
    b.set_ylabel("peak RSS per rank (MiB)")
    b.set_xticks([1, 2, 4])
    b.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:7])
