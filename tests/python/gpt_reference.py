"""Python PyTorch oracle for ShardTrain's sharded training.

Loads oracle.pt written by gpt_oracle_dump (initial weights, batches, and the
losses ShardTrain's FULL_SHARD training produced at W=2), trains the same GPT in
plain single-process PyTorch (nn.Module, torch.optim.SGD) on the same global
batches, and checks the losses agree to a relative 1e-5.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, layers):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.ln_2 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(x).split(C, dim=2)
        h = lambda t: t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(h(q), h(k), h(v), is_causal=True)
        return self.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList([Block(d, heads, layers) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight)


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
