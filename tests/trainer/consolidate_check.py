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
    """Only plain Python containers, numbers, strings, None and tensors inside."""
    if isinstance(value, dict):
        assert type(value) is dict, type(value)
        return all(isinstance(k, (str, int)) and plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        assert type(value) in (list, tuple), type(value)
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (torch.Tensor, int, float, str, bool))


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
    # A plain module loads it, and torch.optim.Adam its optimizer state.
    net = torch.nn.ModuleDict({
        "b1": torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 16)}),
        "b2": torch.nn.ModuleDict({"fc": torch.nn.Linear(16, 16)}),
        "head": torch.nn.Linear(16, 3),
    })
    net.load_state_dict(sd)
    oa, ob = a["optimizer_states"][0], b["optimizer_states"][0]
    names = [n for g in oa["param_groups"] for n in g["param_names"]]
    assert names == [n for n, _ in net.named_parameters()], names
    assert oa["param_groups"] == ob["param_groups"], (oa["param_groups"], ob["param_groups"])
    opt = torch.optim.Adam(net.parameters())
    opt.load_state_dict(oa)
    assert set(oa["state"]) == set(range(len(names))), sorted(oa["state"])
    for i, keys in oa["state"].items():
        assert set(keys) == {"step", "exp_avg", "exp_avg_sq"}, keys.keys()
        assert keys["step"].dtype == torch.float32 and keys["step"].dim() == 0 and keys["step"] > 0, keys["step"]
        for k, t in keys.items():
            assert t.shape == (sd[names[i]].shape if k != "step" else ()), (names[i], k)
            assert torch.equal(t, ob["state"][i][k]), (names[i], k)
    for k in ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "loops"):
        assert a[k] == b[k], (k, a[k], b[k])
    assert a["hyper_parameters"] == {"model": "mlp", "lr": 0.02}, a["hyper_parameters"]
    for k in ("world_size", "batch_in_epoch", "strategy"):
        assert a["shardtrain"][k] == b["shardtrain"][k], (k, a["shardtrain"][k], b["shardtrain"][k])
    assert torch.equal(a["shardtrain"]["rng_state"], b["shardtrain"]["rng_state"])
    # The 16-mixed run's loss scaler, in torch.amp.GradScaler's state_dict layout, where Lightning keeps it.
    gs = a["MixedPrecision"]
    assert gs == b["MixedPrecision"], (gs, b["MixedPrecision"])
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
        assert files == ["meta.pt"], files
        assert sorted(os.listdir(sharded)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], os.listdir(sharded)
        meta = load(os.path.join(sharded, "meta.pt"))
        assert meta["MixedPrecision"] == gs, (meta["MixedPrecision"], gs)
        assert "state_dict" not in meta and "optimizer_states" not in meta, sorted(meta)
    print(f"python (weights_only=True): {consolidated} == {full}: {len(sd)} tensors, step {a['global_step']}, "
          f"epoch {a['epoch']}, grad scale {gs['scale']}; sharded files {files}")


if __name__ == "__main__":
    main(*sys.argv[1:])
