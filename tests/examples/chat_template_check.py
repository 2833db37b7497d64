"""The Python side of chat_template_python_test.sh (transformers' chat
templates, jinja2, tokenizers and torch are the reference).

  chat_template_check.py fixtures OUT
      trains a byte-level BPE tokenizer with chat special tokens, and saves it
      with each test template through transformers (OUT/<name>/: tokenizer.json,
      tokenizer_config.json and the template, kept where the test puts it:
      chat_template.jinja, tokenizer_config.json as a string, or as a list of
      named templates); writes OUT/conversations.json and OUT/<name>/expected.json
      (what transformers' apply_chat_template gives for each conversation
      without and with the generation prompt: the text and its ids, or the
      template's error).
  chat_template_check.py compare EXPECTED OURS
      checks ShardTrain's renderings (chat_template_test render) against them.
  chat_template_check.py sft-setup DIR OUT.jsonl
      saves a random tiny Llama with the "header" template's tokenizer to DIR
      and writes chat fine-tuning lines ("messages", and conversational
      "prompt"/"completion" lists) to OUT.jsonl.
  chat_template_check.py sft-loss DIR JSONL BLOCK N
      the completion-only loss transformers computes for the last N examples:
      the prompt turns rendered with the generation prompt, the completion the
      rest of the whole conversation's rendering, each tokenized without
      special tokens, cut to BLOCK + 1, padded with an attention mask.
"""
import json
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_train_check import LLAMA3_PATTERN, MULTILINGUAL  # noqa: E402

transformers.logging.set_verbosity_error()

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "<|system|>", "</s>"]

# Templates written for this test in the styles chat checkpoints use.
HEADER = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{%- if strftime_now is defined and strftime_now is callable %}
    {%- set dated = true %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- system_message }}
{%- if dated %}{{ "\\n(dated)" }}{% endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML = """{%- set ns = namespace(last_user=-1, users=0) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% set ns.users = ns.users + 1 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {%- if message.role == 'assistant' and loop.index0 > ns.last_user and message.reasoning_content is defined %}
        {{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + message.content.lstrip('\\n') + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

INST = """{% if messages[0]['role'] == 'system' %}
{% set loop_messages = messages[1:] %}
{% set system_message = messages[0]['content'] %}
{% else %}
{% set loop_messages = messages %}
{% set system_message = false %}
{% endif %}
{% for message in loop_messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if loop.index0 == 0 and system_message != false %}
{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
{% else %}
{% set content = message['content'] %}
{% endif %}
{% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
{% elif message['role'] == 'assistant' %}
{{ ' '  + content.strip() + ' ' + eos_token }}
{% endif %}
{% endfor %}
"""

TAGS = """{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
    {% endif %}
    {# the generation prompt after the last turn #}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}"""

# Not a chat format: the Jinja the templates above do not reach.
FEATURES = """{#- a comment -#}
{%- set roles = messages | map(attribute='role') | list -%}
roles={{ roles | join(',') }} n={{ messages | length }} users={{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{% for m in messages if m.role != 'system' %}
  {{ loop.index }}/{{ loop.length }}{% if loop.first %} first{% endif %}{% if loop.last %} last{% endif %} {{ m.role | upper }}: {{ m.content | trim | replace('\\n', ' ') }} [{{ m.content | length }}] rev={{ loop.revindex0 }}
{% else %}
  nothing
{% endfor %}
  {%+ if messages | length > 2 %}long{% else %}short{% endif %}

{% for k, v in {'a': 1, 'b': [1, 2.5, none, true, 'x']}.items() %}{{ k }}={{ v }};{% endfor %}

{{ messages[0] | tojson }} {{ messages[-1].content | tojson }} {{ {'k': [1, 'é', {}], 'z': []} | tojson(indent=2) }}
{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 / 4 }} {{ 'ab' * 3 }} {{ 1e-5 }} {{ 0.1 + 0.2 }} {{ 10 / 2 }} {{ 2.5e20 }}
{{ 'x' ~ 1 ~ none }} {{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ '  pad  '.strip() }}|{{ '  pad  '.lstrip() }}|{{ 'Hello World'.lower().startswith('hello') }}
{% for i in range(10) %}{% if i is odd %}{% continue %}{% endif %}{% if i > 6 %}{% break %}{% endif %}{{ i }}{% endfor %}

{% set ns = namespace(total=0) %}{% for m in messages %}{% set ns.total = ns.total + m.content | length %}{% set leaked = 1 %}{% endfor %}total={{ ns.total }} leaked={{ leaked is defined }}
{{ messages[1:3] | map(attribute='role') | join('+') }} {{ (messages | last).role }} {{ messages[::-1][0].role }} {{ 'abcdef'[1:-1] }} {{ 'abcdef'[::-2] }} {{ messages[0].content[:4] }}
{{ 'yes' if 'user' in roles else 'no' }} {{ 'tool' not in roles }} {{ messages[0].missing is defined }} {{ messages[0].missing | default('dflt') }} {{ none is none }} {{ 3 is divisibleby 3 }} {{ 'Ab' is lower }}
{% raw %}{{ not rendered }}{% endraw %}
{{ "\\u00e9\\t|" }} {{ [1, 'two', none, "it's"] }} {{ {'a': 'b'} }} {{ true and 'x' or 'y' }} {{ not true }} {{ messages | rejectattr('role', 'in', ['user']) | map(attribute='role') | unique | list }}
{{ messages[0].get('role') }} {{ messages[0].get('nope', 'fallback') }} {{ messages[0].keys() | list | length }} {{ 'a-b-c'.replace('-', '+') }} {{ 'title case' | title }} {{ '12' | int + 1 }}
{%- if add_generation_prompt %}
GEN{{ '\\n' }}
{%- endif %}
"""

# Tool calls and content lists, as Qwen2.5's and Llama 3.1's templates take them.
TOOLS = """{%- if tools %}{{ raise_exception('this test passes no tools') }}{% endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') %}
    {%- endif %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}{% if content %}{{ '\\n' + content }}{% endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}
"""

TEMPLATES = {  # name: (template, where it is kept, whether it takes tool calls and content lists)
    "header": (HEADER, "jinja", True),
    "chatml": (CHATML, "config", False),
    "inst": (INST, "config", False),
    "tags": (TAGS, "named", False),
    "features": (FEATURES, "jinja", True),
    "tools": (TOOLS, "jinja", True),
}

CONVERSATIONS = [
    [{"role": "system", "content": " You answer in one line. "}, {"role": "user", "content": "What is FSDP?"},
     {"role": "assistant", "content": "Sharded data parallel training."},
     {"role": "user", "content": "And HSDP?\n"}, {"role": "assistant", "content": "  Sharded within a host.  "}],
    [{"role": "user", "content": "Grüße, 世界 🌍 — naïve?"}, {"role": "assistant", "content": "Ja.\n\nNext line."}],
    [{"role": "system", "content": "Think first."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "\n4", "reasoning_content": "\nTwo and two.\n"}],
    [{"role": "user", "content": "first"}, {"role": "user", "content": "second, out of turn"}],
    [{"role": "user", "content": "Only a question."}],
]

TOOL_CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "text", "text": "Weather in Zürich?"}, {"type": "image"},
                                  {"type": "text", "text": "Two days."}]},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {
             "city": "Zürich", "days": 2, "units": ["°C", None], "hourly": False, "threshold": 0.5}}},
         {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
     {"role": "tool", "content": "sunny, 21°"}, {"role": "tool", "content": "14:05"},
     {"role": "assistant", "content": [{"type": "text", "text": "Sunny — 21 °C at 14:05."}]}],
]


def train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + [MULTILINGUAL] + [
        "system user assistant helpful answer question line sharded parallel training think"] * 50
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    return tok


def save(tok, d, template, where):
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="</s>"
                                   if where == "named" else "<|eot_id|>", chat_template=template)
    fast.save_pretrained(d)
    config_path = os.path.join(d, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    jinja_path = os.path.join(d, "chat_template.jinja")
    if where != "jinja" and os.path.exists(jinja_path):
        os.remove(jinja_path)
    if where == "config":
        config["chat_template"] = template
    elif where == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}]
    elif not os.path.exists(jinja_path):
        raise SystemExit(f"transformers {transformers.__version__} did not write chat_template.jinja")
    if where != "jinja":
        config.pop("chat_template_file", None)
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    return PreTrainedTokenizerFast.from_pretrained(d)


def fixtures(out):
    tok = train_tokenizer()
    for name, (template, where, tools) in TEMPLATES.items():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        loaded = save(tok, d, template, where)
        conversations = CONVERSATIONS + (TOOL_CONVERSATIONS if tools else [])
        with open(os.path.join(d, "conversations.json"), "w") as f:
            json.dump(conversations, f, ensure_ascii=False)
        expected = []
        for conversation in conversations:
            for gen in (False, True):
                try:
                    text = loaded.apply_chat_template(conversation, tokenize=False, add_generation_prompt=gen)
                except Exception as e:  # the template's own error
                    expected.append({"error": str(e)})
                    continue
                ids = loaded.encode(text, add_special_tokens=False)
                via = loaded.apply_chat_template(conversation, tokenize=True, add_generation_prompt=gen)
                via = via["input_ids"] if isinstance(via, dict) or hasattr(via, "keys") else via
                if list(via) != ids:
                    raise SystemExit(f"{name}: apply_chat_template(tokenize=True) differs from encoding its text")
                expected.append({"text": text, "ids": ids})
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(expected, f, ensure_ascii=False, indent=1)
        print(f"{name}: kept as {where}, {sum('error' in e for e in expected)} of {len(expected)} renderings refused")


def compare(expected_path, ours_path):
    with open(expected_path, encoding="utf-8") as f:
        expected = json.load(f)
    with open(ours_path, encoding="utf-8") as f:
        ours = json.load(f)
    assert len(expected) == len(ours), (len(expected), len(ours))
    bad = 0
    for k, (e, o) in enumerate(zip(expected, ours)):
        where = f"{expected_path} #{k} (conversation {k // 2}, add_generation_prompt={k % 2 == 1})"
        if "error" in e:
            if "error" not in o or e["error"] not in o["error"]:
                print(f"{where}: transformers raised {e['error']!r}, ShardTrain gave {o}")
                bad += 1
        elif o.get("text") != e["text"]:
            print(f"{where}: text differs\n  transformers {e['text']!r}\n  ShardTrain   {o.get('text', o)!r}")
            bad += 1
        elif o["ids"] != e["ids"]:
            print(f"{where}: ids differ\n  transformers {e['ids']}\n  ShardTrain   {o['ids']}")
            bad += 1
    print(f"{expected_path}: {len(expected) - bad} of {len(expected)} renderings equal")
    sys.exit(1 if bad else 0)


def sft_setup(d, jsonl):
    tok = save(train_tokenizer(), d, HEADER, "jinja")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(d)
    topics = ["sharding", "the step", "a checkpoint", "the launcher", "memory", "Gloo", "a tokenizer", "the loss"]
    with open(jsonl, "w", encoding="utf-8") as f:
        for k in range(40):
            topic = topics[k % len(topics)]
            user = {"role": "user", "content": f"Tell me about {topic}, please ({k})."}
            answer = {"role": "assistant", "content": f"{topic.capitalize()} is part of training number {k}."}
            if k % 3 == 0:
                line = {"messages": [{"role": "system", "content": "Be short."}, user, answer]}
            elif k % 3 == 1:
                line = {"messages": [user, {"role": "assistant", "content": "Which part?"},
                                     {"role": "user", "content": "All of it."}, answer]}
            else:
                line = {"prompt": [user], "completion": [answer]}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def sft_loss(d, jsonl, block, n):
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(d)
    with open(jsonl, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()][-n:]
    rows = []
    for line in lines:
        prompt_msgs = line["messages"][:-1] if "messages" in line else line["prompt"]
        full_msgs = line["messages"] if "messages" in line else line["prompt"] + line["completion"]
        prompt = tok.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(full_msgs, tokenize=False)
        assert full.startswith(prompt)
        p = tok.encode(prompt, add_special_tokens=False)
        c = tok.encode(full[len(prompt):], add_special_tokens=False)
        ids, labels = (p + c)[:block + 1], ([-100] * len(p) + c)[:block + 1]
        if any(l != -100 for l in labels[1:]):
            rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    pad = tok.eos_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([l + [-100] * (width - len(l)) for _, l in rows])
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    print(f"python sft loss {loss:.6f} ({len(rows)} examples, {int((labels[:, 1:] != -100).sum())} completion tokens)")


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "fixtures":
        fixtures(*args)
    elif mode == "compare":
        compare(*args)
    elif mode == "sft-setup":
        sft_setup(*args)
    elif mode == "sft-loss":
        sft_loss(args[0], args[1], int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")
