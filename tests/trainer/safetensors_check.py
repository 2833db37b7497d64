"""Python's safetensors (pinned in .deps/venv) is the oracle for
trainer/checkpoint_io/safetensors.h, both directions:

  safetensors_check.py write DIR   writes DIR/py.safetensors with
      safetensors.torch.save_file (a Llama-like set of names, every dtype a
      Hugging Face checkpoint uses, a 0-d and an empty tensor, metadata) and
      the same tensors with torch.save in DIR/py.pt, for the C++ side to compare.
  safetensors_check.py check ST PT   loads ST (written by ShardTrain) with
      safetensors.torch.load_file and safe_open, and PT with torch.load, and
      requires the same names, dtypes, shapes and values, and the metadata.
"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def write(directory):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "model.embed_tokens.weight": torch.randn(13, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g, dtype=torch.float64),
        "lm_head.weight": torch.randn(13, 8, generator=g),
        "position_ids": torch.arange(-4, 8, dtype=torch.int64).reshape(3, 4),
        "counts": torch.arange(6, dtype=torch.int32),
        "small": torch.arange(3, dtype=torch.int16),
        "codes": torch.arange(250, 255, dtype=torch.uint8),
        "signed": torch.arange(-3, 2, dtype=torch.int8),
        "mask": torch.rand(7, generator=g) > 0.5,
        "scale": torch.tensor(0.5),
        "nothing": torch.empty(0, 5),
    }
    save_file(tensors, f"{directory}/py.safetensors", metadata={"format": "pt"})
    torch.save(tensors, f"{directory}/py.pt")


def check(st, pt):
    got = load_file(st)
    want = torch.load(pt, weights_only=True)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(g, w), name
    with safe_open(st, framework="pt") as f:
        meta = f.metadata()
    assert meta == {"format": "pt", "producer": "shardtrain"}, meta
    print(f"{st}: {len(want)} tensors equal in Python; metadata {meta}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: safetensors_check.py write DIR | check ST PT")
