#include "tests/fuzz/checkpoint_readers_fuzz.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <caffe2/serialize/inline_container.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "base/errors.h"
#include "examples/llama/chat_template.h"
#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/llama_config.h"
#include "examples/llama/tokenizer.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/safetensors.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace shardtrain::fuzz {
namespace fs = std::filesystem;
namespace {

// Reads every byte of t (a clone does), so an out-of-bounds view is found.
void Touch(const at::Tensor& t) {
  if (t.defined()) (void)t.clone();
}

void TouchAll(const c10::IValue& v) {
  if (v.isTensor()) {
    Touch(v.toTensor());
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) TouchAll(e);
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      TouchAll(e.key());
      TouchAll(e.value());
    }
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) TouchAll(e);
  }
}

void TouchCheckpoint(const trainer::CheckpointData& d) {
  for (const auto& [k, t] : d.state_dict) Touch(t);
  Touch(d.rng_state);
  for (const auto& [name, keys] : d.optimizer_full.state) {
    for (const auto& [k, t] : keys) Touch(t);
  }
}

trainer::CheckpointData SmallCheckpoint() {
  trainer::CheckpointData d;
  d.state_dict = {{"fc.weight", at::arange(6, at::kFloat).reshape({2, 3})},
                  {"fc.bias", at::ones({2}, at::kFloat)},
                  {"bn.num_batches_tracked", at::tensor({int64_t{7}})}};
  d.optimizer_states = {"opt"};
  d.epoch = 1;
  d.global_step = 12;
  d.batch_in_epoch = 2;
  d.world_size = 2;
  d.strategy = "fsdp_native";
  d.rng_state = at::arange(16, at::kByte);
  d.hparams = {{"lr", "0.001"}, {"model", "mlp"}};
  d.optimizer_full.kind = "Adam";
  d.optimizer_full.state["fc.weight"] = {{"exp_avg", at::zeros({2, 3})}, {"exp_avg_sq", at::ones({2, 3})}};
  d.optimizer_full.step["fc.weight"] = 12;
  d.callbacks = {{"ModelCheckpoint", {{"best_model_path", "x.ckpt"}}}};
  return d;
}

trainer::ShardedCheckpoint SmallShardedCheckpoint() {
  trainer::ShardedCheckpoint ck;
  ck.meta = SmallCheckpoint();
  ck.meta.state_dict.clear();
  ck.meta.optimizer_states.clear();
  ck.meta.optimizer_full = {};
  ck.meta.world_size = 1;
  trainer::ShardedPiece p;
  sharding::UnitInfo u;
  u.name = "";
  u.param_names = {"fc.weight", "fc.bias"};
  u.numel = 8;
  u.padded_numel = 8;
  u.shard_numel = 8;
  p.state.units = {u};
  p.state.param_shapes = {{{2, 3}, {2}}};
  p.state.shards = {at::arange(8, at::kFloat)};
  p.state.buffers = {{"bn.running_mean", at::zeros({3})}};
  p.optimizer_kind = "Adam";
  p.optimizer.units = {{{"exp_avg", at::zeros({8})}, {"exp_avg_sq", at::ones({8})}}};
  p.optimizer.steps = {12};
  ck.pieces = {p};
  return ck;
}

// A DCP checkpoint of one rank in Lightning's layout: a 2x3 weight in two
// chunks (a row and a partial row, as flat shards cut it), a bias, a 0-d
// buffer, Adam's state with its 0-d step, the parameter groups, meta.pt.
void WriteSmallDcpCheckpoint(const fs::path& dir) {
  fs::create_directories(dir);
  trainer::dcp::Metadata md;
  trainer::dcp::RankFileWriter f(dir.string(), trainer::dcp::RankFileName(0));
  const at::Tensor w = at::arange(6, at::kFloat).reshape({2, 3});
  for (const auto& [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 6}}) {
    for (const auto& box : trainer::dcp::BoxesOfRange({2, 3}, b, e)) {
      at::Tensor part = w.narrow(0, box.offsets[0], box.sizes[0]).narrow(1, box.offsets[1], box.sizes[1]);
      trainer::AddDcpChunk(md, trainer::DcpModelPath("fc.weight"), at::kFloat, {2, 3}, {box, f.AddTensor(part)});
      trainer::AddDcpChunk(md, trainer::DcpOptimizerStatePath("fc.weight", "exp_avg"), at::kFloat, {2, 3},
                           {box, f.AddTensor(part * 0.5)});
    }
  }
  trainer::AddDcpChunk(md, trainer::DcpModelPath("fc.bias"), at::kFloat, {2}, {{{0}, {2}}, f.AddTensor(at::ones({2}))});
  trainer::AddDcpChunk(md, trainer::DcpModelPath("bn.num_batches_tracked"), at::kLong, {},
                       {{}, f.AddTensor(at::full({}, 7, at::kLong))});
  trainer::AddDcpChunk(md, trainer::DcpOptimizerStatePath("fc.weight", "step"), at::kFloat, {},
                       {{}, f.AddTensor(at::full({}, 12.0, at::kFloat))});
  trainer::OptimizerGroup g;
  g.params = {"fc.weight", "fc.bias"};
  g.options = {{"lr", 0.001}, {"amsgrad", false}};
  trainer::WriteDcpParamGroups(f, {g}, md);
  f.Finish();
  trainer::CheckpointData meta = SmallCheckpoint();
  meta.state_dict.clear();
  meta.optimizer_states.clear();
  meta.optimizer_full = {};
  meta.optimizer_groups = {g};
  trainer::SaveCheckpointMeta((dir / trainer::kDcpMetaFile).string(), meta);
  trainer::dcp::WriteMetadata(dir.string(), md);
}

std::vector<uint8_t> ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteFile(const fs::path& p, const uint8_t* data, size_t size) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// A per-process scratch directory holding a valid sharded checkpoint ("valid")
// and the directory each input is written into ("input").
std::vector<uint8_t> ValidHfIndex(const fs::path& dir);

struct Scratch {
  fs::path root, valid, input, input_dcp, input_hf;
  std::vector<uint8_t> valid_metadata, valid_rank0, valid_pickle, valid_dcp_metadata, valid_dcp_rank0;
  std::vector<std::pair<std::string, std::string>> records;  // the full checkpoint's data/* records
  Scratch() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    root = fs::path(tmp ? tmp : fs::temp_directory_path().string()) /
           ("shardtrain_fuzz_" + std::to_string(::getpid()));
    fs::remove_all(root);
    fs::create_directories(root);
    valid = root / "valid";
    trainer::SaveShardedCheckpoint(valid.string(), SmallShardedCheckpoint());
    valid_metadata = ReadFile(valid / trainer::kShardedMetadataFile);
    valid_rank0 = ReadFile(valid / trainer::ShardedPieceFileName(0));
    const fs::path full = root / "full.ckpt";
    trainer::SaveCheckpoint(full.string(), SmallCheckpoint());
    caffe2::serialize::PyTorchStreamReader reader(full.string());
    for (const auto& name : reader.getAllRecords()) {
      auto [ptr, size] = reader.getRecord(name);
      const char* b = static_cast<const char*>(ptr.get());
      if (name == "data.pkl") {
        valid_pickle.assign(b, b + size);
      } else if (name.rfind("data/", 0) == 0) {
        records.emplace_back(name, std::string(b, size));
      }
    }
    input = root / "input";
    fs::create_directories(input);
    WriteFile(input / trainer::kShardedCompleteMarker, nullptr, 0);
    input_dcp = root / "input_dcp";
    WriteSmallDcpCheckpoint(input_dcp);
    input_hf = root / "input_hf";
    ValidHfIndex(input_hf);  // the weight files the fuzzed index names
    valid_dcp_metadata = ReadFile(input_dcp / trainer::dcp::kMetadataFile);
    valid_dcp_rank0 = ReadFile(input_dcp / trainer::dcp::RankFileName(0));
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

Scratch& GetScratch() {
  static Scratch s;
  return s;
}

// Reader 11: a tokenizer.json, then a fixed text (special tokens, multilingual) encoded and decoded.
void EncodeWithTokenizer(const fs::path& json, const uint8_t* bytes, size_t n) {
  WriteFile(json, bytes, n);
  const auto tok = examples::llama::LoadByteLevelBpe(json.string());
  const std::vector<int64_t> ids = tok->Encode("<s>Hello  world 123 \xc3\xa9t\xc3\xa9\n\t\xe4\xbd\xa0\xe5\xa5\xbd<s>");
  (void)tok->Decode(ids);
}

// Reader 12: a chat template parsed and applied to a fixed conversation.
void ApplyChatTemplate(const uint8_t* bytes, size_t n) {
  const examples::llama::ChatTemplate chat(std::string(reinterpret_cast<const char*>(bytes), n), "fuzz.jinja",
                                           {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  const auto messages = nlohmann::ordered_json::parse(
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "H\u00e9llo {{ 1 }}"},
          {"role": "assistant", "content": "Hi.", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
          {"role": "user", "content": [{"type": "text", "text": "and?"}]}])");
  (void)chat.Apply(messages, true);
}

}  // namespace

// The full checkpoint's tensor records with `pickle` as its data.pkl, zipped.
void WriteArchiveWithPickle(const Scratch& s, const fs::path& path, const uint8_t* pickle, size_t n) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  caffe2::serialize::PyTorchStreamWriter w([&](const void* buf, size_t k) -> size_t {
    out.write(static_cast<const char*>(buf), static_cast<std::streamsize>(k));
    return k;
  });
  for (const auto& [name, bytes] : s.records) w.writeRecord(name, bytes.data(), bytes.size());
  static const uint8_t kNone = 0;
  w.writeRecord("data.pkl", n ? pickle : &kNone, n);
  w.writeEndOfFile();
}

bool FuzzCheckpointReaders(const uint8_t* data, size_t size) {
  if (size == 0) return false;
  Scratch& s = GetScratch();
  const int reader = data[0] % kNumReaders;
  const uint8_t* bytes = data + 1;
  const size_t n = size - 1;
  const fs::path file = s.input / "file.pt";
  const fs::path meta = s.input / trainer::kShardedMetadataFile;
  const fs::path rank0 = s.input / trainer::ShardedPieceFileName(0);
  try {
    switch (reader) {
      case 0:
        WriteFile(file, bytes, n);
        TouchAll(trainer::MapArchive(file.string()));
        break;
      case 1:
        WriteFile(file, bytes, n);
        TouchCheckpoint(trainer::LoadCheckpoint(file.string()));
        break;
      case 2:
      case 3: {
        WriteFile(meta, reader == 2 ? bytes : s.valid_metadata.data(), reader == 2 ? n : s.valid_metadata.size());
        WriteFile(rank0, reader == 3 ? bytes : s.valid_rank0.data(), reader == 3 ? n : s.valid_rank0.size());
        trainer::ShardedCheckpoint ck = trainer::LoadShardedCheckpoint(s.input.string());
        TouchCheckpoint(trainer::ConsolidateShardedCheckpoint(ck));
        break;
      }
      case 4:
        WriteArchiveWithPickle(s, file, bytes, n);
        TouchAll(trainer::MapArchive(file.string()));
        break;
      case 5:
        WriteArchiveWithPickle(s, file, bytes, n);
        TouchCheckpoint(trainer::LoadCheckpoint(file.string()));
        break;
      case 6:
      case 7: {
        const bool meta_fuzzed = reader == 6;
        const auto& other = meta_fuzzed ? s.valid_dcp_rank0 : s.valid_dcp_metadata;
        WriteFile(s.input_dcp / trainer::dcp::kMetadataFile, meta_fuzzed ? bytes : other.data(), meta_fuzzed ? n : other.size());
        WriteFile(s.input_dcp / trainer::dcp::RankFileName(0), meta_fuzzed ? other.data() : bytes,
                  meta_fuzzed ? other.size() : n);
        TouchCheckpoint(trainer::ConsolidateDcpCheckpoint(trainer::OpenDcpCheckpoint(s.input_dcp.string())));
        break;
      }
      case 8: {
        const fs::path st = s.input / "model.safetensors";
        WriteFile(st, bytes, n);
        trainer::SafetensorsFile f(st.string());
        for (const auto& e : f.entries()) Touch(f.Tensor(e.name));
        break;
      }
      case 9: {
        const auto c = examples::llama::ParseLlamaConfig(std::string(reinterpret_cast<const char*>(bytes), n), "fuzz");
        (void)c.NumParameters();
        (void)examples::llama::ParseLlamaConfig(examples::llama::LlamaConfigJson(c, "float32"), "fuzz export");
        break;
      }
      case 10: {
        WriteFile(s.input_hf / examples::llama::kHfIndexFile, bytes, n);
        const examples::llama::HfWeights w(s.input_hf.string());
        for (const auto& name : w.names()) Touch(w.Tensor(name));
        break;
      }
      case 11:
        EncodeWithTokenizer(s.input / "tokenizer.json", bytes, n);
        break;
      case 12:
        ApplyChatTemplate(bytes, n);
        break;
    }
  } catch (const Error&) {
    return false;
  }
  return true;
}

namespace {
// A small Hugging Face style file: several dtypes, a 0-d and an empty tensor, metadata.
std::vector<uint8_t> ValidSafetensors(const fs::path& path) {
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"model.embed_tokens.weight", at::arange(12, at::kFloat).reshape({4, 3})},
      {"model.norm.weight", at::ones({3}, at::kBFloat16)},
      {"lm_head.weight", at::arange(6, at::kFloat).reshape({2, 3}).to(at::kHalf)},
      {"step", at::tensor(int64_t{3})},
      {"empty", at::empty({0, 2}, at::kFloat)}};
  std::vector<trainer::SafetensorsEntry> layout;
  for (const auto& [name, t] : tensors) layout.push_back({name, t.scalar_type(), t.sizes().vec()});
  trainer::WriteSafetensors(path.string(), layout, [&](size_t i) { return tensors[i].second; }, {{"format", "pt"}});
  return ReadFile(path);
}
}  // namespace

namespace {
// A small Hugging Face directory in two weight files and its index; the
// index's bytes (the fuzzed part of reader 10).
std::vector<uint8_t> ValidHfIndex(const fs::path& dir) {
  examples::llama::LlamaConfig c;
  c.vocab_size = 8;
  c.hidden_size = 4;
  c.intermediate_size = 6;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 2;
  const std::vector<examples::llama::HfTensorSpec> specs = {
      {"model.embed_tokens.weight", {8, 4}}, {"model.layers.0.mlp.up_proj.weight", {6, 4}}, {"model.norm.weight", {4}}};
  examples::llama::HfSaveOptions o;
  o.max_shard_bytes = 100;  // two files
  examples::llama::HfModelWriter w(dir.string(), c, specs, o);
  for (const auto& spec : specs)
    w.Write(spec.name, at::arange(c10::multiply_integers(spec.shape), at::kFloat).view(spec.shape));
  w.Commit();
  return ReadFile(dir / examples::llama::kHfIndexFile);
}

// A small byte-level BPE tokenizer.json: GPT-2's split, a Split step,
// NFC, merges in both spellings, an added token with rstrip.
std::vector<uint8_t> ValidTokenizerJson() {
  const std::string text = R"({"version": "1.0", "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}| ?\\p{L}+|\\s+|."}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "decoder": {"type": "ByteLevel"},
    "added_tokens": [{"id": 9, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": true,
                      "normalized": false, "special": true}],
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "ignore_merges": true,
              "vocab": {"H": 0, "e": 1, "l": 2, "o": 3, "He": 4, "ll": 5, "Hell": 6, "\u0120": 7, "w": 8},
              "merges": ["H e", ["l", "l"], "He ll"]}})";
  return std::vector<uint8_t>(text.begin(), text.end());
}

// A chat template that reaches most of the Jinja subset: whitespace control,
// namespace, loop variables, filters, tests, methods, slicing, raise_exception.
std::vector<uint8_t> ValidChatTemplate() {
  const std::string text = R"({%- set ns = namespace(sys='') -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.sys = messages[0].content | trim %}{% endif -%}
{{ bos_token }}{% for m in messages if m.role != 'system' -%}
  {%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif -%}
  {%- set c = m.content if m.content is string else m.content | map(attribute='text') | join(' ') -%}
  <|{{ m.role | upper }}|>{% if loop.first and ns.sys %}[{{ ns.sys[:20] }}] {% endif %}{{ c | replace('{', '(') }}
  {%- if m.tool_calls is defined %}{% for t in m.tool_calls %} {{ t.function | tojson }}{% endfor %}{% endif %}
  {%- if not loop.last %}{{ eos_token }}
{% endif -%}
{%- endfor %}{% if add_generation_prompt %}<|ASSISTANT|>{{ messages | length | string }}{% endif %})";
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::vector<uint8_t> ValidLlamaConfig() {
  const std::string text = examples::llama::LlamaConfigJson(examples::llama::LlamaConfig(), "bfloat16");
  return std::vector<uint8_t>(text.begin(), text.end());
}
}  // namespace

std::vector<Seed> ValidSeeds() {
  Scratch& s = GetScratch();
  const fs::path full = s.root / "full.ckpt";
  trainer::SaveCheckpoint(full.string(), SmallCheckpoint());
  const std::vector<uint8_t> full_bytes = ReadFile(full);
  auto with = [](uint8_t selector, const std::vector<uint8_t>& b) {
    std::vector<uint8_t> out(b.size() + 1);
    out[0] = selector;
    std::copy(b.begin(), b.end(), out.begin() + 1);
    return out;
  };
  return {{"archive", with(0, full_bytes)},
          {"full_checkpoint", with(1, full_bytes)},
          {"sharded_metadata", with(2, s.valid_metadata)},
          {"sharded_rank_file", with(3, s.valid_rank0)},
          {"archive_pickle", with(4, s.valid_pickle)},
          {"full_checkpoint_pickle", with(5, s.valid_pickle)},
          {"dcp_metadata", with(6, s.valid_dcp_metadata)},
          {"dcp_rank_file", with(7, s.valid_dcp_rank0)},
          {"safetensors", with(8, ValidSafetensors(s.root / "valid.safetensors"))},
          {"llama_config", with(9, ValidLlamaConfig())},
          {"hf_index", with(10, ValidHfIndex(s.root / "valid_hf"))},
          {"bpe_tokenizer", with(11, ValidTokenizerJson())},
          {"chat_template", with(12, ValidChatTemplate())}};
}

}  // namespace shardtrain::fuzz
