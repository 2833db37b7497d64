"""Python Lightning and PyTorch against ShardTrain's full checkpoint (lightning_interop_test.sh).

  lightning_interop_check.py python DIR
    DIR/st.ckpt (ShardTrain, fsdp_native at 2 ranks after 2 epochs) and
    DIR/st_cont.txt (ShardTrain's own continuation to epoch 3). Checks:
    torch.load with weights_only=True; LightningModule.load_from_checkpoint
    builds Net with the typed hyper-parameters and the same weights; plain
    torch.optim.AdamW.load_state_dict takes optimizer_states[0]; a Lightning
    Trainer resumes it (ckpt_path) with the same AdamW moments, step, lr and
    scheduler state, and its epoch-3 losses equal ShardTrain's within 1e-5.
    Then writes DIR/py.ckpt (Lightning's checkpoint after one epoch of ddp on
    the CPU from those weights, its optimizer state by index) and
    DIR/py_cont.txt (Lightning's own continuation of it to epoch 2), for
    ShardTrain to resume.
  lightning_interop_check.py compare EXPECTED.txt ACTUAL.txt
    the losses agree within 1e-5 (relative).
"""
import math
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
import lightning as L  # noqa: E402

TOL = 1e-5


def data():
    # The same numbers as lightning_fixture.cc's Data() (the same torch kernels).
    x = torch.sin(torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) * 0.37)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2] - x[:, 3]], 1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


class Block(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.fc = torch.nn.Linear(i, o)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(L.LightningModule):
    # No defaults that match the checkpoint's: load_from_checkpoint must pass them.
    def __init__(self, width=3, lr=1.0, act="relu", bias=False):
        super().__init__()
        self.save_hyperparameters()
        self.b1 = Block(4, width)
        self.b2 = Block(width, width)
        self.head = torch.nn.Linear(width, 2)
        self.losses = []

    def forward(self, x):
        return self.head(self.b2(self.b1(x)))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(L.Callback):
    """At the start of the resumed fit: the optimizer and scheduler hold the file's state."""

    def __init__(self, ck):
        self.ck = ck
        self.checked = False

    def on_train_start(self, trainer, module):
        osd = self.ck["optimizer_states"][0]
        opt = trainer.optimizers[0]
        names = [n for n, _ in module.named_parameters()]
        assert osd["param_groups"][0]["param_names"] == names, osd["param_groups"][0]["param_names"]
        for i, p in enumerate(module.parameters()):
            st = opt.state[p]
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(st[k], osd["state"][i][k]), (names[i], k)
        assert opt.param_groups[0]["lr"] == osd["param_groups"][0]["lr"], (opt.param_groups[0]["lr"], osd)
        sched = trainer.lr_scheduler_configs[0].scheduler
        saved = self.ck["lr_schedulers"][0]
        assert sched.last_epoch == saved["last_epoch"] and sched.get_last_lr() == saved["_last_lr"], (
            sched.state_dict(), saved)
        assert trainer.global_step == self.ck["global_step"], (trainer.global_step, self.ck["global_step"])
        assert trainer.current_epoch == self.ck["epoch"], (trainer.current_epoch, self.ck["epoch"])
        self.checked = True


def trainer(max_epochs, callbacks=(), strategy="auto"):
    # The data in order on both sides: under ddp Lightning would put in a
    # shuffling DistributedSampler (and ShardTrain's sampler differs anyway).
    return L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, strategy=strategy, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, callbacks=list(callbacks))


def compare(expected, actual, what):
    assert len(expected) == len(actual) and expected, (what, len(expected), len(actual))
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(expected, actual))
    assert worst <= TOL, f"{what}: losses differ by {worst:.3g} relative (> {TOL}): {expected} vs {actual}"
    return worst


def read(path):
    with open(path) as f:
        return [float(line) for line in f if line.strip()]


def python(d):
    st = os.path.join(d, "st.ckpt")
    ck = torch.load(st)  # weights_only=True, the default
    assert ck["pytorch-lightning_version"] == L.__version__, (ck["pytorch-lightning_version"], L.__version__)
    assert ck["global_step"] == 16 and ck["epoch"] == 2, (ck["global_step"], ck["epoch"])

    # load_from_checkpoint: the typed hyper-parameters reach __init__.
    m = Net.load_from_checkpoint(st)
    hp = dict(m.hparams)
    assert hp == {"width": 8, "lr": 0.01, "act": "tanh", "bias": True}, hp
    assert type(hp["width"]) is int and type(hp["lr"]) is float and type(hp["bias"]) is bool, hp
    for k, v in m.state_dict().items():
        assert torch.equal(v, ck["state_dict"][k]), k

    # Plain PyTorch: the optimizer state loads into AdamW over the same parameters.
    net = Net(**hp)
    net.load_state_dict(ck["state_dict"])
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.05)
    opt.load_state_dict(ck["optimizer_states"][0])
    for i, p in enumerate(net.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], ck["optimizer_states"][0]["state"][i]["exp_avg_sq"]), i
        assert opt.state[p]["step"].item() == 16.0, opt.state[p]["step"]
    assert opt.param_groups[0]["lr"] == 0.01 * 0.5 ** 3, opt.param_groups[0]["lr"]  # StepLR(5, 0.5) after 16 steps

    # Lightning resumes it; its epoch 3 equals ShardTrain's.
    m = Net(**hp)
    probe = Probe(ck)
    t = trainer(3, [probe])
    t.fit(m, data(), ckpt_path=st)
    assert probe.checked, "the probe did not run"
    worst = compare(read(os.path.join(d, "st_cont.txt")), m.losses, "Lightning's continuation vs ShardTrain's")
    print(f"Lightning resumed ShardTrain's checkpoint: {len(m.losses)} steps, losses within {worst:.2g}")
    # Lightning's own checkpoint (ddp on the CPU; its optimizer never saw
    # ShardTrain's, so its state is by index, unnamed): one epoch from the
    # weights above with a fresh optimizer, then Lightning's continuation of
    # it to epoch 2, for ShardTrain to match.
    fresh = Net.load_from_checkpoint(st)
    t = trainer(1, strategy="ddp")
    t.fit(fresh, data())
    py = os.path.join(d, "py.ckpt")
    t.save_checkpoint(py)
    saved = torch.load(py)
    assert "param_names" not in saved["optimizer_states"][0]["param_groups"][0], "expected a file without names"
    m2 = Net(**hp)
    trainer(2, strategy="ddp").fit(m2, data(), ckpt_path=py)
    with open(os.path.join(d, "py_cont.txt"), "w") as f:
        f.write("".join(f"{x!r}\n" for x in m2.losses))
    print(f"wrote {py} and Lightning's continuation ({len(m2.losses)} steps)")


if __name__ == "__main__":
    if sys.argv[1] == "python":
        python(sys.argv[2])
    elif sys.argv[1] == "compare":
        w = compare(read(sys.argv[2]), read(sys.argv[3]), "ShardTrain's continuation vs Lightning's")
        print(f"ShardTrain resumed Lightning's checkpoint: losses within {w:.2g}")
    else:
        sys.exit(__doc__)
