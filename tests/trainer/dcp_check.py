"""PyTorch's DCP reads what trainer/checkpoint_io/dcp.h writes, and writes what it reads.

  dcp_check.py check DIR EXPECTED   DIR was written by dcp_test write: torch's
      pickle.load builds its Metadata, format_utils.dcp_to_torch_save and
      dcp.load give the tensors and values of EXPECTED
  dcp_check.py write DIR EXPECTED   two Gloo ranks dcp.save DTensors sharded on
      dim 0 (uneven) and dim 1, a replicated scalar and values; EXPECTED gets
      the full tensors and values (for dcp_test read)
"""
import os
import pickle
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import Metadata


def nested(flat_tensors, flat_objects):
    """The nested state dict of flattened keys (the layout dcp_test writes)."""
    out = {"model": {}, "optimizer_0": {"state": {"w": {}}, "param_groups": [{}]}}
    for k, v in list(flat_tensors.items()) + list(flat_objects.items()):
        parts = k.split(".")
        if parts[0] == "model":
            out["model"][parts[1]] = v
        elif parts[1] == "state":
            out["optimizer_0"]["state"][parts[2]][parts[3]] = v
        else:
            out["optimizer_0"]["param_groups"][int(parts[2])][parts[3]] = v
    return out


def same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def check(dirname, expected):
    exp = torch.load(expected, weights_only=True)
    want = nested(exp["tensors"], exp["objects"])
    with open(os.path.join(dirname, ".metadata"), "rb") as f:
        md = pickle.load(f)
    assert isinstance(md, Metadata) and md.version == "1.0.0", md
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(dirname, out)
        same(want, torch.load(out, weights_only=False), "dcp_to_torch_save")
    # dcp.load into a template (the default load planner, no process group)
    template = nested({k: torch.zeros_like(v) for k, v in exp["tensors"].items()}, {})
    dcp.load(template, checkpoint_id=dirname)
    same(nested(exp["tensors"], {}), template, "dcp.load")
    print("PASS: torch's DCP read the directory ShardTrain wrote")


def write_rank(rank, world, dirname, expected):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    full = {
        "model.w": torch.arange(35, dtype=torch.float32).reshape(5, 7),
        "model.v": torch.arange(24, dtype=torch.float32).div(8).to(torch.bfloat16).reshape(6, 4),
        "model.s": torch.tensor(2.5),
        "optimizer_0.state.w.exp_avg": torch.arange(35, dtype=torch.float32).mul(-0.5).reshape(5, 7),
        "optimizer_0.state.w.step": torch.tensor(16.0),
    }
    placement = {"model.w": Shard(0), "model.v": Shard(1), "optimizer_0.state.w.exp_avg": Shard(0)}
    dt = {k: distribute_tensor(v, mesh, [placement.get(k, Replicate())]) for k, v in full.items()}
    objects = {"optimizer_0.param_groups.0.lr": 0.01, "optimizer_0.param_groups.0.params": ["w"],
               "optimizer_0.param_groups.0.betas": (0.9, 0.999)}
    dcp.save(nested(dt, objects), checkpoint_id=dirname)
    if rank == 0:
        torch.save({"tensors": full, "objects": objects}, expected)


def write(dirname, expected):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gloo_spawn import spawn_gloo
    spawn_gloo(write_rank, 2, dirname, expected)
    print("wrote", dirname)


if __name__ == "__main__":
    {"check": check, "write": write}[sys.argv[1]](sys.argv[2], sys.argv[3])
