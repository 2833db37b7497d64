"""Python PyTorch oracle for ShardTrain's sharded training.

Loads oracle.pt written by gpt_oracle_dump (initial weights, batches, and the
losses ShardTrain's FULL_SHARD training produced at W=2), trains the same GPT in
plain single-process PyTorch (nn.Module, torch.optim.SGD) on the same global
batches, and checks the losses agree to a relative 1e-5.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from torch_gpt import GPT  # noqa: E402  (same directory)


def main(path):
    d = torch.load(path, weights_only=False)
    init = {k[len("init."):]: v for k, v in d.items() if k.startswith("init.")}
    steps = sum(1 for k in d if k.startswith("x."))
    vocab, d_model = init["wte.weight"].shape
    block = init["wpe.weight"].shape[0]
    layers = len({k.split(".")[1] for k in init if k.startswith("h.")})
    model = GPT(vocab, block, layers, heads=2, d=d_model)
    model.load_state_dict(init, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = d["losses"].tolist()
    worst = 0.0
    for s in range(steps):
        x, y = d[f"x.{s}"], d[f"y.{s}"]
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        rel = abs(loss.item() - ours[s]) / abs(loss.item())
        worst = max(worst, rel)
        print(f"step {s}: pytorch {loss.item():.7f} shardtrain {ours[s]:.7f} rel {rel:.2e}")
    print(f"worst relative difference {worst:.2e}")
    if not worst <= 1e-5:
        print("FAIL: ShardTrain's sharded losses differ from PyTorch's plain training", file=sys.stderr)
        return 1
    if not sum(ours[-5:]) < sum(ours[:5]):
        print("FAIL: loss did not fall", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
