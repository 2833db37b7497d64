"""Loads a consolidated and a full ShardTrain checkpoint with Python's torch.load
(default weights_only=True: no pickled code, only tensors and plain containers)
and checks that they hold the same state: the model state dict is a plain
{name: tensor} dict, the optimizer state by parameter name and the GradScaler
state match. With a sharded checkpoint directory as a third argument, every
file in it must load the same way."""
import os
import sys

import torch


def load(path):
    ck = torch.load(path)  # weights_only=True, the default since torch 2.6
    assert isinstance(ck, dict), type(ck)
    return ck


def plain(value):
    """Only plain Python containers, numbers, strings and tensors inside."""
    if isinstance(value, dict):
        assert type(value) is dict, type(value)
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        assert type(value) is list, type(value)
        return all(plain(v) for v in value)
    return isinstance(value, (torch.Tensor, int, float, str, bool))


def main(consolidated, full, sharded=None):
    a, b = load(consolidated), load(full)
    assert plain(a) and plain(b)
    sd = a["state_dict"]
    assert type(sd) is dict and sd, "state_dict is not a non-empty plain dict"
    assert all(isinstance(k, str) and type(v) is torch.Tensor for k, v in sd.items())
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
    assert oa["step"] == ob["step"] and oa["step"], oa["step"]
    assert set(oa["state"]) == set(sd), sorted(oa["state"])
    for name, keys in oa["state"].items():
        assert set(keys) == {"exp_avg", "exp_avg_sq"}, keys.keys()
        for k, t in keys.items():
            assert t.shape == sd[name].shape and torch.equal(t, ob["state"][name][k]), (name, k)
    for k in ("epoch", "global_step", "batch_in_epoch", "world_size", "strategy", "hparams"):
        assert a[k] == b[k], (k, a[k], b[k])
    assert torch.equal(a["rng_state"], b["rng_state"])
    # The 16-mixed run's loss scaler, in torch.amp.GradScaler's state_dict layout.
    gs = a["grad_scaler"]
    assert gs == b["grad_scaler"], (gs, b["grad_scaler"])
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(gs)
    assert scaler.get_scale() == gs["scale"] > 0, (scaler.get_scale(), gs)
    files = []
    if sharded:
        for name in sorted(os.listdir(sharded)):
            if name.endswith(".pt"):
                d = load(os.path.join(sharded, name))
                assert plain(d), name
                files.append(name)
        assert "metadata.pt" in files and "rank_0.pt" in files and "rank_1.pt" in files, files
        meta = load(os.path.join(sharded, "metadata.pt"))
        assert meta["grad_scaler"] == gs, (meta["grad_scaler"], gs)
    print(f"python (weights_only=True): {consolidated} == {full}: {len(sd)} tensors, step {a['global_step']}, "
          f"epoch {a['epoch']}, grad scale {gs['scale']}; sharded files {files}")


if __name__ == "__main__":
    main(*sys.argv[1:])
