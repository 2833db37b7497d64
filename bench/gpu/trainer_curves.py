"""The Trainer on CUDA against its CPU loss curves (issue 29's GPU-run item).

Runs the examples/gpt training program (the bundle's CUDA build) for a few
steps at each precision and reads the per-step train_loss from its CSV log:

  # here, when the bundle is made: the CPU references (the same binary; the
  # stub libcuda lets it start without a driver)
  python bench/gpu/trainer_curves.py record --train BIN --data FILE --device cpu --out REF.json
  # on the GPU machine: the same runs on CUDA, compared step by step
  python bench/gpu/trainer_curves.py compare --train BIN --data FILE --ref REF.json --out DIR
  # (--device cpu: the rehearsal's check of this script, CPU against CPU)

compare prints one JSON line per precision ({"impl": "trainer_cuda_vs_cpu_<precision>", ...,
"max_rel_diff": ..., "tolerance": ...}) and exits 1 when a curve is off by
more than its precision's tolerance (float32: different kernels and
summation orders; bf16 and fp16: their rounding), 2 when a run fails.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
# Largest |cuda - cpu| / |cpu| of any step's loss that passes, per precision.
TOLERANCE = {"32-true": 2e-3, "bf16-mixed": 3e-2, "16-mixed": 1e-2}
STEPS = 30


def run_curve(train, data, device, precision, root):
    cmd = [train, f"--data={data}", f"--accelerator={device}", "--devices=1", f"--max_steps={STEPS}",
           f"--precision={precision}", "--log_every_n_steps=1", "--eval_every=100000", "--sample_tokens=0",
           "--num_workers=0", "--seed=1337", f"--default_root_dir={root}"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if done.returncode != 0:
        # The caller keeps the message's tail: the exit status goes last.
        how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        raise RuntimeError(f"{' '.join(cmd)}:\n{done.stdout[-2000:]}\n{os.path.basename(train)} {precision}: {how} "
                           "after the output above")
    metrics = os.path.join(root, "lightning_logs", "version_0", "metrics.csv")
    with open(metrics) as f:
        losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
    if len(losses) != STEPS:
        raise RuntimeError(f"{metrics}: {len(losses)} train_loss rows, expected {STEPS}")
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("record", "compare"))
    p.add_argument("--train", required=True, help="the examples/gpt training program")
    p.add_argument("--data", required=True, help="the text it trains on (carried in the bundle)")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"),
                   help="record: where the reference runs (cpu); compare: where the runs to check run (cuda; cpu "
                   "for the rehearsal, which must then match exactly)")
    p.add_argument("--ref", help="compare: the CPU curves that record wrote")
    p.add_argument("--out", required=True, help="record: the JSON file to write; compare: a scratch folder")
    a = p.parse_args()
    if a.mode == "record":
        with tempfile.TemporaryDirectory() as tmp:
            curves = {prec: run_curve(a.train, a.data, a.device, prec, os.path.join(tmp, prec)) for prec in PRECISIONS}
        with open(a.out, "w") as f:
            json.dump({"device": a.device, "steps": STEPS, "curves": curves}, f)
        print(f"trainer_curves: {a.device} curves of {', '.join(PRECISIONS)} ({STEPS} steps) in {a.out}")
        return 0
    if not a.ref:
        p.error("compare needs --ref (the CPU curves)")
    with open(a.ref) as f:
        ref = json.load(f)["curves"]
    status = 0
    for prec in PRECISIONS:
        line = {"impl": f"trainer_{a.device}_vs_cpu_{prec}", "precision": prec, "device": a.device, "steps": STEPS,
                "tolerance": TOLERANCE[prec]}
        try:
            got = run_curve(a.train, a.data, a.device, prec, os.path.join(a.out, prec))
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            line["error"] = str(e)[-500:]
            print(json.dumps(line), flush=True)
            status = max(status, 2)
            continue
        rel = [abs(g - r) / abs(r) for g, r in zip(got, ref[prec])]
        worst = max(range(len(rel)), key=rel.__getitem__)
        line.update(max_rel_diff=round(max(rel), 6), worst_step=worst + 1, cpu_final=round(ref[prec][-1], 4),
                    cuda_final=round(got[-1], 4), passed=max(rel) <= TOLERANCE[prec])
        if not line["passed"]:
            line["error"] = (f"step {worst + 1}: loss {got[worst]:.5f} on CUDA vs {ref[prec][worst]:.5f} on the CPU "
                             f"(relative {rel[worst]:.2e} > {TOLERANCE[prec]:g})")
            status = max(status, 1)
        print(json.dumps(line), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
