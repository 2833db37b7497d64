"""Table and plot of bench/e2e/llama_run.sh: medians over rounds per implementation.

  llama_report.py RESULTS.jsonl [--docs docs/benchmarks.md --png docs/benchmarks_llama.png --command CMD]

Prints the table; with --docs, replaces what lies between the llama-table
markers of the section "Llama: ShardTrain vs PyTorch FSDP2" (added before
"## On a GPU" when the file has no such section yet).
"""
import argparse
import json
import statistics
import sys

SECTION = "## Llama: ShardTrain vs PyTorch FSDP2"
NAMES = {"fsdp_native": "ShardTrain fsdp_native FULL_SHARD", "pytorch_fsdp2": "PyTorch FSDP2 (transformers model)"}


def medians(rows):
    """(kind, impl, world) -> median of every numeric field over the rounds, with the round count."""
    groups = {}
    for r in rows:
        kind = "load" if r["median_step_s"] == 0 else "train"
        groups.setdefault((kind, r["impl"], r["world"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        m = {k: statistics.median(r[k] for r in rs) for k, v in rs[0].items() if isinstance(v, (int, float))}
        m["rounds"] = len(rs)
        m["losses"] = sorted({r["final_loss"] for r in rs})
        out[key] = m
    return out


def table(m):
    lines = []
    train = {k: v for k, v in m.items() if k[0] == "train"}
    if train:
        any_row = next(iter(train.values()))
        lines += [f"Training, {any_row['params'] / 1e6:.1f}M parameters, fp32, AdamW, medians over "
                  f"{any_row['rounds']} rounds:", "",
                  "| implementation | W | step (s) | tokens/s | peak RSS per rank, steps (MiB) | load (s) | "
                  "peak RSS per rank through the load (MiB) | final loss |", "|---|---|---|---|---|---|---|---|"]
        for (_, impl, w), r in sorted(train.items()):
            lines.append(f"| {NAMES.get(impl, impl)} | {w} | {r['median_step_s']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{r['step_peak_rss_mib']:.0f} | {r['load_s']:.2f} | {r['load_peak_rss_mib']:.0f} | "
                         f"{', '.join(f'{x:.6f}' for x in r['losses'])} |")
        ours, theirs = train.get(("train", "fsdp_native", 2)), train.get(("train", "pytorch_fsdp2", 2))
        if ours and theirs:
            ratio = ours["median_step_s"] / theirs["median_step_s"]
            rss = ours["step_peak_rss_mib"] / theirs["step_peak_rss_mib"]
            lines += ["", f"Goals (issue 28): step at most 0.8x FSDP2's: **{ratio:.2f}x** "
                      f"({'met' if ratio <= 0.8 else 'not met'}); peak RSS per rank below FSDP2's: **{rss:.2f}x** "
                      f"({'met' if rss < 1 else 'not met'})."]
    load = {k: v for k, v in m.items() if k[0] == "load"}
    if load:
        any_row = next(iter(load.values()))
        lines += ["", f"Loading a Hugging Face directory only, {any_row['params'] / 1e6:.1f}M parameters (fp32 "
                  "safetensors), medians over the rounds:", "",
                  "| implementation | W | load (s) | peak RSS per rank through the load (MiB) | model size / W (MiB) |",
                  "|---|---|---|---|---|"]
        for (_, impl, w), r in sorted(load.items()):
            lines.append(f"| {NAMES.get(impl, impl)} | {w} | {r['load_s']:.2f} | {r['load_peak_rss_mib']:.0f} | "
                         f"{r['params'] * 4 / w / 2**20:.0f} |")
    return "\n".join(lines)


def plot(m, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train = sorted((k, v) for k, v in m.items() if k[0] == "train")
    if not train:
        return
    labels = [NAMES.get(k[1], k[1]).split(" (")[0] for k, _ in train]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(labels, [v["median_step_s"] for _, v in train], color=["tab:blue", "tab:orange"][:len(train)])
    a.set_ylabel("median step (s)")
    a.set_title("Llama step, W=2")
    b.bar(labels, [v["step_peak_rss_mib"] for _, v in train], color=["tab:blue", "tab:orange"][:len(train)])
    b.set_ylabel("peak RSS per rank (MiB)")
    b.set_title("memory per rank while training")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--docs")
    p.add_argument("--png")
    p.add_argument("--command", default="bench/e2e/llama_run.sh")
    a = p.parse_args()
    m = medians([json.loads(line) for line in open(a.results) if line.strip()])
    t = table(m)
    print(t)
    if a.png:
        plot(m, a.png)
    if a.docs:
        doc = open(a.docs).read()
        if SECTION not in doc:
            at = doc.index("\n## On a GPU\n") + 1 if "\n## On a GPU\n" in doc else len(doc)
            doc = doc[:at] + SECTION + "\n\n<!-- llama-table -->\n<!-- /llama-table -->\n\n" + doc[at:]
        start = doc.index("<!-- llama-table -->", doc.index(SECTION))
        end = doc.index("<!-- /llama-table -->", start)
        body = f"Reproduce: `{a.command}`.\n\n{t}\n"
        if a.png:
            body += f"\n![Llama step and memory]({a.png.split('/')[-1]})\n"
        doc = doc[:start] + "<!-- llama-table -->\n" + body + doc[end:]
        open(a.docs, "w").write(doc)


if __name__ == "__main__":
    sys.exit(main())
