"""Compares GPT example runs bit for bit (tests/cluster).

    compare_runs.py NAME=RUN_DIR:REFERENCE_DIR ...

Each directory is a --default_root_dir of examples/gpt:train. A pair is the
same when every logged loss (train_loss at every step, val_loss) is the same
float (metrics.csv writes 9 significant digits, which round-trips a float32)
and every tensor of the final checkpoint's state_dict (last.ckpt, read with
torch.load) is bit-identical. Prints one line per pair:

    SAME NAME: N losses, final train_loss X, val_loss Y; T tensors bit-identical
    DIFF NAME: <first difference>

and exits 1 if any pair differs or cannot be read.
"""
import csv
import glob
import os
import sys

import torch


def losses(root):
    """{(step, key): float} of every train_loss / val_loss in the run's metrics.csv."""
    paths = glob.glob(os.path.join(root, "lightning_logs", "version_*", "metrics.csv"))
    if len(paths) != 1:
        raise RuntimeError(f"{root}: expected one lightning_logs/version_*/metrics.csv, found {paths}")
    out = {}
    with open(paths[0]) as f:
        for row in csv.DictReader(f):
            for key in ("train_loss", "val_loss"):
                if row.get(key):
                    out[(int(row["step"]), key)] = float(row[key])
    if not out:
        raise RuntimeError(f"{paths[0]}: no train_loss or val_loss logged")
    return out


def state_dict(root):
    paths = glob.glob(os.path.join(root, "lightning_logs", "version_*", "checkpoints", "last.ckpt"))
    if len(paths) != 1:
        raise RuntimeError(f"{root}: expected one last.ckpt, found {paths}")
    return torch.load(paths[0], map_location="cpu")["state_dict"]


def raw_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(name, run, ref):
    a, b = losses(run), losses(ref)
    if a.keys() != b.keys():
        return f"DIFF {name}: logged steps differ: {sorted(a.keys() ^ b.keys())[:6]}"
    for k in sorted(a):
        if a[k] != b[k]:
            return f"DIFF {name}: {k[1]} at step {k[0]}: {a[k]!r} vs {b[k]!r} (reference)"
    sa, sb = state_dict(run), state_dict(ref)
    if sa.keys() != sb.keys():
        return f"DIFF {name}: state_dict keys differ: {sorted(sa.keys() ^ sb.keys())[:6]}"
    for k in sorted(sa):
        x, y = sa[k], sb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(raw_bytes(x), raw_bytes(y)):
            diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else "shape"
            return f"DIFF {name}: parameter {k} differs (max abs difference {diff})"
    train = [a[k] for k in sorted(a) if k[1] == "train_loss"]
    val = [a[k] for k in sorted(a) if k[1] == "val_loss"]
    return (f"SAME {name}: {len(a)} losses, final train_loss {train[-1]!r}, val_loss {val[-1] if val else None!r}; "
            f"{len(sa)} tensors bit-identical")


def main(argv):
    bad = 0
    for arg in argv:
        name, _, dirs = arg.partition("=")
        run, _, ref = dirs.partition(":")
        try:
            line = compare(name, run, ref)
        except Exception as e:  # an unreadable run is a failure of that pair
            line = f"DIFF {name}: {e}"
        print(line, flush=True)
        bad += not line.startswith("SAME")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
