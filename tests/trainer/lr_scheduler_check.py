"""Builds lr_scheduler_table.cc's cases with Python's torch.optim.lr_scheduler
and compares every learning rate and momentum (|a - b| <= 1e-12 * max(1, |b|)).

Usage: python lr_scheduler_check.py <table from lr_scheduler_table>
"""
import math
import sys
import warnings

import torch
from torch.optim import lr_scheduler as L

warnings.simplefilter("ignore")  # scheduler.step() without optimizer.step()
STEPS = 50


def sgd():
    p = [torch.zeros(2), torch.zeros(3)]
    return torch.optim.SGD([{"params": [p[0]], "lr": 0.1}, {"params": [p[1]], "lr": 0.05}], lr=0.1, momentum=0.9)


def adam():
    p = [torch.zeros(2), torch.zeros(3)]
    return torch.optim.Adam([{"params": [p[0]], "lr": 0.1}, {"params": [p[1]], "lr": 0.05}], lr=0.1)


def values(opt):
    out = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        out.append(g["betas"][0] if "betas" in g else g["momentum"])
    return out


def metric(i):
    return 1.0 / (1 + i // 6) + 0.01 * ((i * 7) % 3)


def run(name, opt, step, rows):
    for i in range(STEPS + 1):
        rows[(name, i)] = values(opt)
        if i < STEPS:
            step(i)


def cases():
    rows = {}
    o = sgd(); s = L.StepLR(o, 7, 0.5); run("step", o, lambda i: s.step(), rows)
    o = sgd(); s2 = L.MultiStepLR(o, [30, 5, 12, 12], 0.3); run("multistep", o, lambda i: s2.step(), rows)
    o = sgd(); s3 = L.CosineAnnealingLR(o, 20, 0.001); run("cosine", o, lambda i: s3.step(), rows)
    o = sgd(); s4 = L.LinearLR(o, 0.1, 1.0, 10); run("linear", o, lambda i: s4.step(), rows)
    o = sgd(); s5 = L.LambdaLR(o, lambda e: 0.5 * (1.0 + math.cos(math.pi * min(1.0, e / 40.0))))
    run("lambda", o, lambda i: s5.step(), rows)
    o = adam()
    warm = L.LinearLR(o, 0.01, 1.0, 5)
    cos = L.CosineAnnealingLR(o, 45, 1e-4)
    s6 = L.SequentialLR(o, [warm, cos], [5]); run("warmup_cosine", o, lambda i: s6.step(), rows)
    o = sgd(); a = L.StepLR(o, 10, 0.5); b = L.CosineAnnealingLR(o, 25, 0.0)
    run("chained", o, lambda i: (a.step(), b.step()), rows)
    o = sgd(); s7 = L.OneCycleLR(o, max_lr=1.0, total_steps=STEPS); run("onecycle", o, lambda i: s7.step(), rows)
    o = adam()
    s8 = L.OneCycleLR(o, max_lr=0.5, total_steps=60, pct_start=0.25, anneal_strategy="linear", three_phase=True,
                      div_factor=10, final_div_factor=100)
    run("onecycle3", o, lambda i: s8.step(), rows)
    o = sgd(); s9 = L.ReduceLROnPlateau(o, patience=2, cooldown=1, factor=0.5, min_lr=0.002)
    run("plateau_min", o, lambda i: s9.step(metric(i)), rows)
    o = sgd()
    s10 = L.ReduceLROnPlateau(o, mode="max", threshold_mode="abs", threshold=0.05, patience=1, factor=0.3)
    run("plateau_max", o, lambda i: s10.step(-metric(i)), rows)
    return rows


def main():
    want = cases()
    got = {}
    with open(sys.argv[1]) as f:
        for line in f:
            parts = line.split()
            got[(parts[0], int(parts[1]))] = [float(x) for x in parts[2:]]
    problems = []
    worst = 0.0
    for key, ref in want.items():
        mine = got.get(key)
        if mine is None or len(mine) != len(ref):
            problems.append(f"{key}: C++ {mine}, PyTorch {ref}")
            continue
        for a, b in zip(mine, ref):
            d = abs(a - b) / max(1.0, abs(b))
            worst = max(worst, d)
            if d > 1e-12:
                problems.append(f"{key}: C++ {mine}, PyTorch {ref}")
                break
    extra = set(got) - set(want)
    if extra:
        problems.append(f"C++ cases PyTorch does not have: {sorted(extra)[:5]}")
    names = sorted({k[0] for k in want})
    print(f"{len(want)} rows of {len(names)} cases ({', '.join(names)}); largest relative difference {worst:.3g}")
    if problems:
        print("\n".join(problems[:20]))
        sys.exit(1)


if __name__ == "__main__":
    main()
