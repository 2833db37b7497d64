"""Table of bench/memory/async_save.sh: per implementation and world size, the
training time a sharded save cost (synchronous and in the background) and the
extra peak memory, from the "timing", "before_save" and "after_save" lines.

  async_report.py RESULTS.jsonl [--docs docs/benchmarks.md]

Time a save cost a run = (the steps after it + the time the save call held the
training thread + the wait at the end of training), slowest rank, minus the
same in the run without a save. Extra memory = the after_save phase's peak
minus the before_save phase's (the same steps' peak), largest rank, minus the
same difference without a save. "bare write" (ShardTrain's rows) is the
control: no save, the same bytes written with O_DIRECT by a bare thread from
the save on — what the disk alone costs the steps. The rank's state = parameters + AdamW's two
moments, fp32, / W. With several rounds (async_save.sh's ROUNDS), each round's
sync and async runs are compared with that round's run without a save and the
table gives the medians over the rounds.
"""
import argparse
import json
import sys

SECTION = "## Saves that overlap training"
IMPL = {"shardtrain": "ShardTrain (copy-on-write per unit)", "pytorch_fsdp2_dcp": "PyTorch FSDP2 + DCP async_save"}
PARAMS = {"gpt-201.7M": 201.7e6}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def per_run(items, w):
    """Consecutive groups of w (one run's ranks, runs in file order)."""
    return [items[i:i + w] for i in range(0, len(items), w)]


def runs(rows):
    """(impl, W, save) -> per-run lists "t" (cost, s) and "extra" (MiB), and the median step."""
    timing, phases = {}, {}
    for r in rows:
        if r["phase"] == "timing":
            timing.setdefault((r["impl"], r["W"], r["save"]), []).append(r)
    # phases come before their run's timing line on each rank: pair them in file order
    current = {}
    for r in rows:
        k = (r["impl"], r["W"], r["rank"])
        if r["phase"] in ("before_save", "after_save"):
            current.setdefault(k, []).append(r)
        elif r["phase"] == "timing":
            ph = {p["phase"]: p for p in current.pop(k, [])}
            phases.setdefault((r["impl"], r["W"], r["save"]), []).append(ph)
    out = {}
    for key, ts in timing.items():
        at, w = ts[0]["save_at"], key[1]
        cost = [max(sum(t["step_s"][at:]) + t["save_call_s"] + t.get("final_wait_s", 0.0) for t in run)
                for run in per_run(ts, w)]
        extra = [max(p["after_save"]["peak_mib"] - p["before_save"]["peak_mib"] for p in run)
                 for run in per_run(phases[key], w)]
        out[key] = {"t": cost, "extra": extra, "call": max(t["save_call_s"] for t in ts),
                    "step": median([s for t in ts for s in t["step_s"][1:]]),
                    "label": ts[0]["model"], "copied": sum(t.get("units_copied", 0) for t in ts),
                    "units": sum(t.get("units", 0) for t in ts)}
    return out


def table(rows):
    r = runs(rows)
    lines = ["| implementation | W | step (s) | sync save: time lost (s) | async: time lost (s) | async / sync |"
             " bare write: time lost (s) | bare / sync |"
             " sync: extra MiB | async: extra MiB | async extra / rank state |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for impl in IMPL:
        for w in sorted({k[1] for k in r if k[0] == impl}):
            none, sync, asy = (r.get((impl, w, s)) for s in ("none", "sync", "async"))
            if not (none and sync and asy):
                continue
            def lost(run, key):
                return median([a - b for a, b in zip(run[key], none[key])])
            lost_s, lost_a = lost(sync, "t"), lost(asy, "t")
            bare = r.get((impl, w, "bare_write"))
            lost_b = f"{lost(bare, 't'):.2f} | {lost(bare, 't') / lost_s:.0%}" if bare else "- | -"
            ex_s, ex_a = lost(sync, "extra"), lost(asy, "extra")
            state = 12 * PARAMS.get(none["label"], 0) / w / 2**20
            lines.append(f"| {IMPL[impl]} | {w} | {none['step']:.2f} | {lost_s:.2f} | {lost_a:.2f} | "
                         f"{lost_a / lost_s:.0%} | {lost_b} | {ex_s:.0f} | {ex_a:.0f} | "
                         + (f"{ex_a / state:.0%} of {state:.0f} MiB |" if state else "- |"))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--docs")
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.results) if line.strip()]
    t = table(rows)
    print(t)
    if a.docs:
        doc = open(a.docs).read()
        start = doc.index(SECTION)
        body_start = doc.index("<!-- async-save-table -->", start)
        body_end = doc.index("<!-- /async-save-table -->", body_start)
        doc = doc[:body_start] + "<!-- async-save-table -->\n" + t + "\n" + doc[body_end:]
        open(a.docs, "w").write(doc)


if __name__ == "__main__":
    sys.exit(main())
