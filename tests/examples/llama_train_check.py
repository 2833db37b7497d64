"""The Python side of llama_train_python_test.sh (transformers, sentencepiece
and torch are the reference).

  llama_train_check.py corpus OUT.txt SAMPLE.txt [SPECIAL.txt]
      writes the test's training text (ASCII quotations from Debian's
      fortunes, a multilingual sample at the end), the sample alone, and a
      text with special tokens, decomposed accents and odd whitespace.
  llama_train_check.py bpe OUT TEXT
      trains three byte-level BPE tokenizers on TEXT with Python `tokenizers`
      and saves each as OUT/<name>/tokenizer.json (+ tokenizer_config.json):
      llama3 (Llama 3's pre-tokenizer expression, ignore_merges, special
      tokens, one with rstrip), qwen2 (NFC normalizer, Qwen2's expression,
      merges saved as pairs) and gpt2 (ByteLevel's own expression with a
      prefix space, merges as strings).
  llama_train_check.py tokens MODEL IDS.safetensors TEXT...
      checks that ShardTrain's token ids of each TEXT (llama_test tokenize:
      tensors "0", "1", ...) equal Python's, token for token (sentencepiece for
      a .model, tokenizers' encode(add_special_tokens=False) for a .json), and
      that its decoding ("decoded0", ...) equals Python's.
  llama_train_check.py val-loss DIR TEXT BLOCK N
      the validation loss of the Hugging Face directory DIR as the training
      program computes it: the last 10% of TEXT's tokens, N windows of BLOCK
      tokens spread evenly over them, mean next-token cross-entropy (fp32).
  llama_train_check.py sft-data OUT.jsonl TEXT N
      writes N prompt/completion pairs (JSON Lines) cut from TEXT's lines.
  llama_train_check.py sft-loss DIR JSONL BLOCK N
      the completion-only loss transformers computes for the last N examples
      of JSONL as one batch: [bos] prompt completion [eos] cut to BLOCK + 1
      tokens, right-padded with an attention mask, labels -100 on the prompt
      and the padding.
  llama_train_check.py continue SRC DST TEXT BLOCK STEPS
      trains SRC in Python (transformers, AdamW, windows of the training
      tokens) for STEPS steps and saves it with its tokenizer to DST; prints
      the validation loss of the result.
"""
import json
import os
import shutil
import sys
import unicodedata

import sentencepiece as spm
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

transformers.logging.set_verbosity_error()
MULTILINGUAL = ("Grüße aus Köln — naïve café. Здравствуйте, мир! 你好，世界。こんにちは。 مرحبا بالعالم "
                "שלום עולם 🙂 Ελληνικά: γειά σου κόσμε. हिन्दी में नमस्ते।\n")


SPECIAL = ("<|begin_of_text|>Hello world<|end_of_text|>  next<|eot_id|>   spaced\t\ttabs\r\n\n"
           "numbers 1234567 and 3.14159; CAPS DON'T I'LL we've\n" + unicodedata.normalize("NFD", "café naïve Köln") +
           " <|end_of_text|><|end_of_text|>x \u00a0nbsp\u3000ideographic\n")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus(out, sample, special=None):
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
    if special:
        with open(special, "w", encoding="utf-8", newline="") as f:
            f.write(SPECIAL)


def bpe(out, text_path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    lines = read(text_path).splitlines()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    kinds = {
        "llama3": (models.BPE(ignore_merges=True), None,
                   pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"), byte_level])),
        "qwen2": (models.BPE(), normalizers.NFC(),
                  pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), "isolated"), byte_level])),
        "gpt2": (models.BPE(), None, pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)),
    }
    for name, (model, normalizer, pre) in kinds.items():
        tok = Tokenizer(model)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(lines, trainer)
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "tokenizer.json")
        tok.save(path)
        with open(path) as f:
            saved = json.load(f)
        merges = saved["model"]["merges"]
        if name == "gpt2" and merges and not isinstance(merges[0], str):  # the older "a b" spelling
            saved["model"]["merges"] = [" ".join(m) for m in merges]
        if name == "llama3":  # a word no merge sequence reaches: only ignore_merges finds it
            saved["model"]["vocab"]["\u0120spaced"] = len(saved["model"]["vocab"])
        with open(path, "w") as f:
            json.dump(saved, f)
        if name == "llama3":
            tok = Tokenizer.from_file(path)
            tok.add_special_tokens([AddedToken("<|eot_id|>", rstrip=True, special=True)])
            tok.save(path)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
        print(f"{name}: {tok.get_vocab_size()} tokens, merges as {type(saved['model']['merges'][0]).__name__}")


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def python_tokenizer(model):
    """(encode, decode) of Python's reference for a tokenizer file."""
    if model.endswith(".json"):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(model)
        return (lambda text: tok.encode(text, add_special_tokens=False).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=False))
    sp = spm.SentencePieceProcessor(model_file=model)
    return sp.encode, sp.decode


def tokens(model, ids_path, *texts):
    encode, decode = python_tokenizer(model)
    ours = load_file(ids_path)
    for i, path in enumerate(texts):
        text = read(path)
        want, got = encode(text), ours[str(i)].tolist()
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            sys.exit(f"{path}: token ids differ from Python's ({model}) at {at} of {len(want)}: {got[at:at + 5]} vs "
                     f"{want[at:at + 5]}")
        decoded = bytes(ours[f"decoded{i}"].tolist()).decode("utf-8", errors="replace")
        if decoded != decode(want):
            sys.exit(f"{path}: ShardTrain decodes the ids to {decoded[:80]!r}..., Python to {decode(want)[:80]!r}...")
        print(f"{path}: {len(want)} tokens and their decoding equal Python's ({os.path.basename(model)})")


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


def sft_data(out, text_path, n):
    lines = [l.strip() for l in read(text_path).splitlines() if 24 <= len(l.strip()) <= 60 and " " in l.strip()]
    with open(out, "w", encoding="utf-8") as f:
        for line in lines[:n]:
            cut = line.index(" ", len(line) // 2) if " " in line[len(line) // 2:] else line.index(" ")
            f.write(json.dumps({"prompt": line[:cut], "completion": line[cut:], "id": len(line)}) + "\n")


def sft_loss(d, jsonl, block, n):
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    bos, eos = model.config.bos_token_id, model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    with open(jsonl, encoding="utf-8") as f:
        examples = [json.loads(line) for line in f if line.strip()][-n:]
    rows = []
    for e in examples:
        prompt, completion = [bos] + sp.encode(e["prompt"]), sp.encode(e["completion"]) + [eos]
        ids, labels = (prompt + completion)[:block + 1], ([-100] * len(prompt) + completion)[:block + 1]
        if any(l != -100 for l in labels[1:]):
            rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [eos] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([l + [-100] * (width - len(l)) for _, l in rows])
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    print(f"python sft loss {loss:.6f} ({len(rows)} examples, {int((labels[:, 1:] != -100).sum())} completion tokens)")


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
    elif mode == "bpe":
        bpe(*args)
    elif mode == "tokens":
        tokens(*args)
    elif mode == "val-loss":
        val_loss(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "sft-data":
        sft_data(args[0], args[1], int(args[2]))
    elif mode == "sft-loss":
        sft_loss(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "continue":
        continue_training(args[0], args[1], args[2], int(args[3]), int(args[4]))
    else:
        sys.exit(f"unknown mode {mode}")
