"""The Python side of llama_train_python_test.sh (transformers, sentencepiece
and torch are the reference).

  llama_train_check.py corpus OUT.txt SAMPLE.txt
      writes the test's training text (ASCII quotations from Debian's
      fortunes, a multilingual sample at the end) and the sample alone.
  llama_train_check.py tokens MODEL IDS.safetensors TEXT...
      checks that ShardTrain's token ids of each TEXT (llama_test tokenize:
      tensors "0", "1", ...) equal Python sentencepiece's, token for token.
  llama_train_check.py val-loss DIR TEXT BLOCK N
      the validation loss of the Hugging Face directory DIR as the training
      program computes it: the last 10% of TEXT's tokens, N windows of BLOCK
      tokens spread evenly over them, mean next-token cross-entropy (fp32).
  llama_train_check.py continue SRC DST TEXT BLOCK STEPS
      trains SRC in Python (transformers, AdamW, windows of the training
      tokens) for STEPS steps and saves it with its tokenizer to DST; prints
      the validation loss of the result.
"""
import os
import shutil
import sys

import sentencepiece as spm
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

transformers.logging.set_verbosity_error()
MULTILINGUAL = ("Grüße aus Köln — naïve café. Здравствуйте, мир! 你好，世界。こんにちは。 مرحبا بالعالم "
                "שלום עולם 🙂 Ελληνικά: γειά σου κόσμε. हिन्दी में नमस्ते।\n")


def corpus(out, sample):
    root = "/usr/share/games/fortunes"
    text = []
    for name in sorted(os.listdir(root)):
        if "." in name or not os.path.isfile(os.path.join(root, name)):
            continue
        with open(os.path.join(root, name), "rb") as f:
            text.append(f.read().decode("latin-1"))
    ascii_text = "".join(ch for ch in "".join(text) if ch == "\n" or 32 <= ord(ch) < 127)
    with open(out, "w", encoding="utf-8") as f:
        f.write(ascii_text[:400_000] + MULTILINGUAL)
    with open(sample, "w", encoding="utf-8") as f:
        f.write(MULTILINGUAL)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def tokens(model, ids_path, *texts):
    sp = spm.SentencePieceProcessor(model_file=model)
    ours = load_file(ids_path)
    for i, path in enumerate(texts):
        text = read(path)
        want, got = sp.encode(text), ours[str(i)].tolist()
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            sys.exit(f"{path}: token ids differ from Python sentencepiece's at {at}: {got[at:at + 5]} vs "
                     f"{want[at:at + 5]}")
        assert sp.decode(want) == text or not text.isascii(), "decode"
        print(f"{path}: {len(want)} tokens equal Python sentencepiece's")


def split(model, text_path):
    ids = torch.tensor(spm.SentencePieceProcessor(model_file=model).encode(read(text_path)), dtype=torch.long)
    n = ids.numel() * 9 // 10
    return ids[:n], ids[n:]


def windows(ids, block, n):
    last = ids.numel() - block - 1
    n = max(1, min(n, last + 1))
    starts = [0 if n == 1 else i * last // (n - 1) for i in range(n)]
    x = torch.stack([ids[s:s + block] for s in starts])
    y = torch.stack([ids[s + 1:s + block + 1] for s in starts])
    return x, y


def loss_of(model, x, y):
    logits = model(x).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def val_loss(d, text_path, block, n):
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    _, val = split(os.path.join(d, "tokenizer.model"), text_path)
    x, y = windows(val, block, n)
    with torch.no_grad():
        loss = loss_of(model, x, y).item()
    print(f"python val loss {loss:.6f}")
    return loss


def continue_training(src, dst, text_path, block, steps):
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).train()
    train, _ = split(os.path.join(src, "tokenizer.model"), text_path)
    x, y = windows(train, block, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    for step in range(steps):
        i = torch.randint(0, x.size(0), (16,))
        loss = loss_of(model, x[i], y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(dst)
    shutil.copy(os.path.join(src, "tokenizer.model"), os.path.join(dst, "tokenizer.model"))
    print(f"python trained {steps} steps, last train loss {loss.item():.4f}")


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "corpus":
        corpus(*args)
    elif mode == "tokens":
        tokens(*args)
    elif mode == "val-loss":
        val_loss(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "continue":
        continue_training(args[0], args[1], args[2], int(args[3]), int(args[4]))
    else:
        sys.exit(f"unknown mode {mode}")
