#include "examples/llama/hf_checkpoint.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "base/file_util.h"

namespace shardtrain::examples::llama {
namespace {

namespace fs = std::filesystem;
using trainer::SafetensorsEntry;
using trainer::SafetensorsFile;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK_ARG(in.good(), "cannot open ", path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A file name the index may name: plain, inside the directory.
bool PlainFileName(const std::string& name) {
  if (name.empty() || name[0] == '.') return false;
  for (char ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.') return false;
  }
  return true;
}

// weight_map of the index: tensor name -> file name.
std::map<std::string, std::string> ReadIndex(const std::string& path) {
  const std::string text = ReadText(path);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ST_CHECK_ARG(!j.is_discarded() && j.is_object(), path, ": not a JSON object");
  ST_CHECK_ARG(j.contains("weight_map") && j["weight_map"].is_object(), path,
               ": no \"weight_map\" object (tensor name -> file)");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : j["weight_map"].items()) {
    ST_CHECK_ARG(file.is_string(), path, ": weight_map[\"", name, "\"] must be a file name, got ", file.dump());
    const std::string f = file.get<std::string>();
    ST_CHECK_ARG(PlainFileName(f), path, ": weight_map[\"", name, "\"] = \"", f,
                 "\" is not a file name inside the directory (letters, digits, '-', '_', '.')");
    map[name] = f;
  }
  ST_CHECK_ARG(!map.empty(), path, ": weight_map is empty");
  return map;
}

std::string DtypeName(at::ScalarType t) {
  if (t == at::kFloat) return "float32";
  if (t == at::kBFloat16) return "bfloat16";
  if (t == at::kHalf) return "float16";
  ST_THROW(InvalidArgumentError, "Hugging Face save: dtype ", c10::toString(t), " (valid: fp32, bf16, fp16)");
}

// The files' layouts: tensors in order, a new file when the next would pass the limit.
std::vector<std::vector<size_t>> SplitIntoFiles(const std::vector<HfTensorSpec>& tensors, int64_t elem_bytes,
                                                int64_t max_bytes, int64_t& total) {
  std::vector<std::vector<size_t>> files(1);
  int64_t in_file = 0;
  total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t bytes = elem_bytes;
    for (int64_t d : tensors[i].shape) bytes *= d;
    if (!files.back().empty() && in_file + bytes > max_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(i);
    in_file += bytes;
    total += bytes;
  }
  return files;
}

std::string ShardName(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

std::string GenerationConfigJson(const LlamaConfig& c) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) j["eos_token_id"] = c.eos_token_ids;
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  j["transformers_version"] = kTransformersVersion;
  return j.dump(2) + "\n";
}

// Weight files of an earlier save in `dir` that `keep` does not name.
void RemoveStaleWeights(const std::string& dir, const std::set<std::string>& keep) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    const bool weights =
        name == kHfWeightsFile || name == kHfIndexFile ||
        (name.rfind("model-", 0) == 0 && name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0);
    if (weights && keep.count(name) == 0) fs::remove(e.path());
  }
}

}  // namespace

HfWeights::HfWeights(const std::string& dir) : dir_(dir) {
  const fs::path index = fs::path(dir) / kHfIndexFile, single = fs::path(dir) / kHfWeightsFile;
  if (fs::exists(index)) {
    std::map<std::string, size_t> file_index;
    for (const auto& [name, file] : ReadIndex(index.string())) {
      auto [it, added] = file_index.emplace(file, files_.size());
      if (added) {
        const fs::path p = fs::path(dir) / file;
        std::error_code ec;  // a name the file system refuses (too long...) is missing too
        ST_CHECK_ARG(fs::is_regular_file(p, ec), index.string(), " names ", file, " (for \"", name,
                     "\"), which is not in ", dir);
        files_.emplace_back(p.string());
      }
      ST_CHECK_ARG(files_[it->second].Has(name), index.string(), " puts \"", name, "\" in ", file,
                   ", which has no such tensor");
      where_[name] = it->second;
    }
  } else {
    ST_CHECK_ARG(fs::is_regular_file(single), dir, " holds no Hugging Face weights (neither ", kHfIndexFile, " nor ",
                 kHfWeightsFile, ")");
    files_.emplace_back(single.string());
    for (const SafetensorsEntry& e : files_[0].entries()) where_[e.name] = 0;
  }
}

HfWeights::~HfWeights() = default;
HfWeights::HfWeights(HfWeights&&) noexcept = default;

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

const SafetensorsFile& HfWeights::File(const std::string& name) const {
  auto it = where_.find(name);
  ST_CHECK_ARG(it != where_.end(), dir_, ": the checkpoint has no tensor \"", name, "\"");
  return files_[it->second];
}

const SafetensorsEntry& HfWeights::Entry(const std::string& name) const { return File(name).Entry(name); }
const std::string& HfWeights::FileOf(const std::string& name) const { return File(name).path(); }
at::Tensor HfWeights::Tensor(const std::string& name) const { return File(name).Tensor(name); }
at::Tensor HfWeights::Range(const std::string& name, int64_t first, int64_t count) const {
  return File(name).Range(name, first, count);
}

HfModelDir::HfModelDir(const std::string& dir)
    : config(ReadLlamaConfig((fs::path(dir) / "config.json").string())), weights(dir) {}

void CheckHfWeights(torch::nn::Module& model, const LlamaConfig& config, const HfWeights& weights) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) shapes[p.key()] = p.value().sizes().vec();
  CheckHfWeights(shapes, config, weights);
}

void CheckHfWeights(const std::map<std::string, std::vector<int64_t>>& shapes, const LlamaConfig& config,
                    const HfWeights& weights) {
  std::vector<std::string> missing, shape;
  std::set<std::string> expected;
  for (const auto& [name, want] : shapes) {
    expected.insert(name);
    if (!weights.Has(name)) {
      missing.push_back(name);
      continue;
    }
    const SafetensorsEntry& e = weights.Entry(name);
    if (e.shape != want) {
      shape.push_back(name + " (" + c10::str(c10::IntArrayRef(e.shape)) + " in " + weights.FileOf(name) +
                      ", the model's " + c10::str(c10::IntArrayRef(want)) + ")");
    }
  }
  std::vector<std::string> unexpected;
  for (const std::string& name : weights.names()) {
    const bool allowed = (config.tie_word_embeddings && name == "lm_head.weight") ||
                         (name.size() > 19 && name.compare(name.size() - 19, 19, "rotary_emb.inv_freq") == 0);
    if (expected.count(name) == 0 && !allowed) unexpected.push_back(name);
  }
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + v[i];
    return v.size() > 8 ? s + " and " + std::to_string(v.size() - 8) + " more" : s;
  };
  ST_CHECK_ARG(missing.empty() && unexpected.empty() && shape.empty(), weights.dir(), " does not match the model ",
               config.ToString(), ":", missing.empty() ? "" : " missing: ", list(missing),
               unexpected.empty() ? "" : "; unexpected: ", list(unexpected),
               shape.empty() ? "" : "; other shape: ", list(shape));
}

void LoadHfWeights(torch::nn::Module& model, const LlamaConfig& config, const HfWeights& weights) {
  CheckHfWeights(model, config, weights);
  at::NoGradGuard no_grad;
  for (auto& p : model.named_parameters(/*recurse=*/true)) p.value().copy_(weights.Tensor(p.key()));
}

int64_t ParseHfSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  static const std::map<std::string, int64_t> kUnits = {
      {"", 1},          {"B", 1},         {"KB", 1000},      {"MB", 1000'000}, {"GB", 1000'000'000},
      {"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1LL << 30}};
  auto it = kUnits.find(unit);
  ST_CHECK_ARG(digits > 0 && digits <= 12 && it != kUnits.end(), "size \"", text,
               "\" is not a size (valid: a number of bytes, optionally followed by B, KB, MB, GB, KiB, MiB or GiB)");
  const int64_t n = std::stoll(text.substr(0, digits)) * it->second;
  ST_CHECK_ARG(n > 0, "size \"", text, "\" must be positive");
  return n;
}

HfModelWriter::HfModelWriter(const std::string& dir, const LlamaConfig& config,
                             const std::vector<HfTensorSpec>& tensors, const HfSaveOptions& options)
    : dir_(dir), config_(config), options_(options) {
  ST_CHECK_ARG(options.max_shard_bytes > 0, "Hugging Face save: max shard size must be positive");
  DtypeName(options.dtype);  // checks it
  fs::create_directories(dir);
  const auto files = SplitIntoFiles(tensors, c10::elementSize(options.dtype), options.max_shard_bytes, total_bytes_);
  for (size_t k = 0; k < files.size(); ++k) {
    file_names_.push_back(files.size() == 1 ? kHfWeightsFile : ShardName(k, files.size()));
    std::vector<SafetensorsEntry> layout;
    for (size_t i : files[k]) {
      SafetensorsEntry e;
      e.name = tensors[i].name;
      e.dtype = options.dtype;
      e.shape = tensors[i].shape;
      layout.push_back(e);
      ST_CHECK_ARG(file_of_.emplace(e.name, k).second, "Hugging Face save: tensor '", e.name, "' given twice");
    }
    files_.push_back(
        std::make_unique<trainer::SafetensorsWriter>((fs::path(dir) / file_names_.back()).string(), std::move(layout),
                                                     std::map<std::string, std::string>{{"format", "pt"}}));
  }
}

HfModelWriter::~HfModelWriter() = default;

void HfModelWriter::Write(const std::string& name, const at::Tensor& t) {
  auto it = file_of_.find(name);
  ST_CHECK_ARG(it != file_of_.end(), "Hugging Face save into ", dir_, ": no tensor '", name, "' was planned");
  files_[it->second]->Write(name, t);
}

std::vector<std::string> HfModelWriter::Commit() {
  for (auto& f : files_) f->Commit();
  std::vector<std::string> written = file_names_;
  if (files_.size() > 1) {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (const auto& [name, k] : file_of_) weight_map[name] = file_names_[k];
    nlohmann::ordered_json index{{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
    WriteFileAtomically((fs::path(dir_) / kHfIndexFile).string(), index.dump(2) + "\n");
    written.push_back(kHfIndexFile);
  }
  WriteFileAtomically((fs::path(dir_) / "config.json").string(), LlamaConfigJson(config_, DtypeName(options_.dtype)));
  WriteFileAtomically((fs::path(dir_) / "generation_config.json").string(), GenerationConfigJson(config_));
  RemoveStaleWeights(dir_, std::set<std::string>(written.begin(), written.end()));
  written.push_back("config.json");
  written.push_back("generation_config.json");
  return written;
}

std::vector<std::string> SaveHfModel(const std::string& dir, const LlamaConfig& config, torch::nn::Module& model,
                                     const HfSaveOptions& options) {
  std::vector<HfTensorSpec> specs;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) specs.push_back({p.key(), p.value().sizes().vec()});
  HfModelWriter writer(dir, config, specs, options);
  for (const auto& p : model.named_parameters(/*recurse=*/true)) writer.Write(p.key(), p.value());
  return writer.Commit();
}

}  // namespace shardtrain::examples::llama
