"""Loads a consolidated and a full ShardTrain checkpoint with Python's torch.load
and checks that they hold the same state: the model state dict is a plain
{name: tensor} dict, and the optimizer state by parameter name matches."""
import sys

import torch


def load(path):
    # The pickler's container type tags need weights_only=False (see trainer/checkpoint.h).
    ck = torch.load(path, weights_only=False)
    assert isinstance(ck, dict), type(ck)
    return ck


def main(consolidated, full):
    a, b = load(consolidated), load(full)
    sd = a["state_dict"]
    assert isinstance(sd, dict) and sd, "state_dict is not a non-empty dict"
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items())
    assert set(sd) == set(b["state_dict"]), (sorted(sd), sorted(b["state_dict"]))
    for k, v in sd.items():
        assert torch.equal(v, b["state_dict"][k]), k
    assert tuple(sd["b1.fc.weight"].shape) == (16, 8), sd["b1.fc.weight"].shape
    # A plain module loads it.
    net = torch.nn.ModuleDict({
        "b1": torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 16)}),
        "b2": torch.nn.ModuleDict({"fc": torch.nn.Linear(16, 16)}),
        "head": torch.nn.Linear(16, 3),
    })
    net.load_state_dict(sd)
    oa, ob = a["optimizer_full"], b["optimizer_full"]
    assert oa["kind"] == ob["kind"] == "Adam", (oa["kind"], ob["kind"])
    assert oa["step"] == ob["step"] and set(oa["step"].values()) == {6}, oa["step"]
    assert set(oa["state"]) == set(sd), sorted(oa["state"])
    for name, keys in oa["state"].items():
        assert set(keys) == {"exp_avg", "exp_avg_sq"}, keys.keys()
        for k, t in keys.items():
            assert t.shape == sd[name].shape and torch.equal(t, ob["state"][name][k]), (name, k)
    for k in ("epoch", "global_step", "batch_in_epoch", "world_size", "strategy", "hparams"):
        assert a[k] == b[k], (k, a[k], b[k])
    assert torch.equal(a["rng_state"], b["rng_state"])
    print(f"python: {consolidated} == {full}: {len(sd)} tensors, step {a['global_step']}, epoch {a['epoch']}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
