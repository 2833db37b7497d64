"""PyTorch DCP, FSDP2 and Lightning against ShardTrain's sharded checkpoint (dcp_interop_test.sh).

  dcp_interop_check.py python DIR
    DIR/st_sharded (ShardTrain fsdp_native at 2 ranks after 2 epochs, DCP),
    DIR/st_full.ckpt (the full checkpoint of the same state) and
    DIR/st_cont.txt (ShardTrain's own continuation of st_sharded to epoch 3).
    Checks: torch's dcp_to_torch_save gives st_full's tensors; PyTorch FSDP2
    (fully_shard, Gloo, W = 1, 2 and 4) loads it with dcp.load and
    set_state_dict: parameters and AdamW moments equal st_full's, and its
    epoch-3 losses equal ShardTrain's within 1e-5; Lightning's
    consolidate_checkpoint turns it into a file LightningModule.load_from_checkpoint
    loads with the same weights. Then writes DIR/py_sharded (FSDP2 at W=2:
    dcp.save of get_state_dict after epoch 3, top-level keys "model" and
    "optim") and DIR/py_cont.txt (FSDP2's next 8 steps from it, no
    scheduler), for ShardTrain to resume; and DIR/py_plain (dcp.save of an
    unsharded module's state_dict(), single process: top-level keys, no
    optimizer) with DIR/py_plain_cont.txt (8 steps of a fresh AdamW from it).
  dcp_interop_check.py tp DIR
    DIR/st_tp (ShardTrain model_parallel at 2x2 with sequence parallelism, the
    GPT of tests/python/torch_gpt.py after 2 AdamW steps, DCP) and
    DIR/st_tp_full.ckpt (the full checkpoint of the same state). Checks:
    dcp_to_torch_save gives st_tp_full's tensors; PyTorch DTensor tensor
    parallelism (c_attn and c_fc column-wise, the projections row-wise, wte's
    vocabulary rows) over "tp" with FSDP2 over "dp" on a 2x2 Gloo mesh loads
    it with dcp.load and set_state_dict: parameters and AdamW moments equal
    st_tp_full's. Then writes DIR/py_tp: dcp.save of that model's
    get_state_dict (keys "model", "optimizer_0": 2-D DTensor chunks), with
    st_tp's meta.pt beside it, for ShardTrain to resume.
  dcp_interop_check.py compare EXPECTED.txt ACTUAL.txt
"""
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from gloo_spawn import spawn_gloo  # noqa: E402
from lightning_interop_check import Net, compare, read  # noqa: E402

BATCH = 8


def data():
    x = torch.sin(torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) * 0.37)
    return x, torch.stack([x[:, 0] * x[:, 1], x[:, 2] - x[:, 3]], 1)


def fsdp2_model(world):
    torch.manual_seed(0)
    net = Net(width=8)
    fully_shard(net.b1)
    fully_shard(net.b2)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.05)
    return net, opt


def train(net, opt, sched, steps, rank, world):
    """`steps` steps over the data in order (global batches of 8, split over the ranks); the global losses."""
    x, y = data()
    per = BATCH // world
    losses = []
    for s in range(steps):
        i = (s * BATCH) % 64
        xb, yb = x[i + rank * per:i + (rank + 1) * per], y[i + rank * per:i + (rank + 1) * per]
        loss = torch.nn.functional.mse_loss(net(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
    return losses


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def load_and_check(net, opt, sharded, full_ckpt, step, same_order):
    """dcp.load + set_state_dict of the directory `sharded` into net and opt: every parameter, its AdamW moments
    and step equal the full checkpoint's (same_order: and the parameters come in its order). Returns that
    checkpoint and its parameter names."""
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optimizer_0": osd}
    dcp.load(state, checkpoint_id=sharded)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer_0"])
    ref = torch.load(full_ckpt)
    names = ref["optimizer_states"][0]["param_groups"][0]["param_names"]
    params = dict(net.named_parameters())
    assert (list(params) if same_order else sorted(params)) == (names if same_order else sorted(names)), \
        (list(params), names)
    for i, n in enumerate(names):
        p = params[n]
        assert torch.equal(full(p.detach()), ref["state_dict"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full(opt.state[p][k]), ref["optimizer_states"][0]["state"][i][k]), (n, k)
        assert full(opt.state[p]["step"]).item() == step, (n, opt.state[p]["step"])
    return ref, names


def fsdp2_rank(rank, world, d, write):
    net, opt = fsdp2_model(world)
    load_and_check(net, opt, os.path.join(d, "st_sharded"), os.path.join(d, "st_full.ckpt"), 16.0, True)
    assert opt.param_groups[0]["lr"] == 0.01 * 0.5 ** 3, opt.param_groups[0]["lr"]
    meta = torch.load(os.path.join(d, "st_sharded", "meta.pt"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    sched.load_state_dict(meta["lr_schedulers"][0])
    losses = train(net, opt, sched, 8, rank, world)
    worst = compare(read(os.path.join(d, "st_cont.txt")), losses, f"FSDP2 at W={world} vs ShardTrain")
    if rank == 0:
        print(f"FSDP2 W={world} loaded ShardTrain's DCP checkpoint; epoch 3 within {worst:.2g}")
    if write:
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(d, "py_sharded"))
        cont = train(net, opt, None, 8, rank, world)
        if rank == 0:
            with open(os.path.join(d, "py_cont.txt"), "w") as f:
                f.write("".join(f"{v!r}\n" for v in cont))


def torch_save_equals_full(sharded, ref):
    """dcp_to_torch_save of the directory `sharded`: the same model tensors and AdamW state as the full checkpoint
    `ref` (loaded). Returns what it gave."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(sharded, out)
        sd = torch.load(out)
    assert sd["model"].keys() == ref["state_dict"].keys(), sd["model"].keys() ^ ref["state_dict"].keys()
    for k, v in ref["state_dict"].items():
        assert torch.equal(sd["model"][k], v), k
    names = ref["optimizer_states"][0]["param_groups"][0]["param_names"]
    for i, n in enumerate(names):
        for k, v in ref["optimizer_states"][0]["state"][i].items():
            assert torch.equal(sd["optimizer_0"]["state"][n][k], v), (n, k)
    return sd


def python(d):
    sharded = os.path.join(d, "st_sharded")
    assert sorted(os.listdir(sharded)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], os.listdir(sharded)
    ref = torch.load(os.path.join(d, "st_full.ckpt"))
    sd = torch_save_equals_full(sharded, ref)
    names = ref["optimizer_states"][0]["param_groups"][0]["param_names"]
    assert sd["optimizer_0"]["param_groups"][0]["params"] == names, sd["optimizer_0"]["param_groups"]
    print(f"dcp_to_torch_save: {len(ref['state_dict'])} tensors and the AdamW state equal the full checkpoint's")
    for world in (1, 2, 4):
        spawn_gloo(fsdp2_rank, world, d, world == 2)
    # Lightning's converter, then load_from_checkpoint.
    conv = os.path.join(d, "consolidated.ckpt")
    subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", sharded,
                    "--output_file", conv], check=True, capture_output=True)
    m = Net.load_from_checkpoint(conv)
    assert dict(m.hparams) == {"width": 8, "lr": 0.01, "act": "tanh", "bias": True}, dict(m.hparams)
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref["state_dict"][k]), k
    print("Lightning consolidate_checkpoint + load_from_checkpoint: same weights and hyper-parameters")
    # An unsharded module's state_dict() saved by DCP in one process, and a fresh AdamW's next 8 steps from it.
    net = Net(width=8)
    net.load_state_dict(ref["state_dict"])
    dcp.save(net.state_dict(), checkpoint_id=os.path.join(d, "py_plain"))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.05)
    x, y = data()
    cont = []
    for s in range(8):
        loss = torch.nn.functional.mse_loss(net(x[s * BATCH:(s + 1) * BATCH]), y[s * BATCH:(s + 1) * BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
        cont.append(loss.item())
    with open(os.path.join(d, "py_plain_cont.txt"), "w") as f:
        f.write("".join(f"{v!r}\n" for v in cont))


def tp_model():
    """torch_gpt's GPT with DTensor tensor parallelism over "tp" and FSDP2 over "dp" (2x2), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch_gpt import GPT
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = GPT(64, 16, 2, 4, 32)  # tests/trainer/gpt_module.h SmallGptConfig
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel()}
    for b in net.h:
        parallelize_module(b, mesh["tp"], plan)
    parallelize_module(net, mesh["tp"], {"wte": RowwiseParallel(input_layouts=Replicate())})
    for b in net.h:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net, torch.optim.AdamW(net.parameters(), lr=0.01, eps=1e-5)


def tp_rank(rank, world, d):
    net, opt = tp_model()
    _, names = load_and_check(net, opt, os.path.join(d, "st_tp"), os.path.join(d, "st_tp_full.ckpt"), 2.0, False)
    placements = {str(p.placements) for p in net.parameters()}
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer_0": osd}, checkpoint_id=os.path.join(d, "py_tp"))
    if rank == 0:
        shutil.copy(os.path.join(d, "st_tp", "meta.pt"), os.path.join(d, "py_tp", "meta.pt"))
        print(f"TP + FSDP2 2x2 loaded ShardTrain's model_parallel DCP checkpoint: {len(names)} parameters and their "
              f"AdamW moments equal the full checkpoint's (placements {sorted(placements)}); wrote py_tp")


def tp(d):
    sharded = os.path.join(d, "st_tp")
    files = sorted(os.listdir(sharded))
    assert ".metadata" in files and "meta.pt" in files, files
    ref = torch.load(os.path.join(d, "st_tp_full.ckpt"))
    torch_save_equals_full(sharded, ref)
    print(f"dcp_to_torch_save of the model_parallel checkpoint ({files}): {len(ref['state_dict'])} tensors and the "
          "AdamW state equal the full checkpoint's")
    spawn_gloo(tp_rank, 4, d)


if __name__ == "__main__":
    if sys.argv[1] == "python":
        python(sys.argv[2])
    elif sys.argv[1] == "tp":
        tp(sys.argv[2])
    elif sys.argv[1] == "compare":
        w = compare(read(sys.argv[2]), read(sys.argv[3]), "ShardTrain's continuation vs FSDP2's")
        print(f"within {w:.2g} relative")
