// Hugging Face model directories in and out: `config.json` plus the weights,
// either one `model.safetensors` or the sharded form
// (`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`).
//
// HfWeights maps the files and hands out any tensor, or any element range of
// one, as a view of the mapping, so a rank reads only the bytes it owns.
// Every malformed directory (no weights, an index that is not JSON or names a
// file outside the directory or a tensor its file lacks, a tensor in two
// files) stops with an error naming the file, the tensor and what was wrong.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_HF_CHECKPOINT_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_HF_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "examples/llama/llama_config.h"
#include "trainer/checkpoint_io/safetensors.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::examples::llama {

inline constexpr char kHfWeightsFile[] = "model.safetensors";
inline constexpr char kHfIndexFile[] = "model.safetensors.index.json";

class HfWeights {
 public:
  // Opens the weights of the model directory `dir` (the index when present,
  // else model.safetensors). Throws shardtrain::InvalidArgumentError.
  explicit HfWeights(const std::string& dir);
  ~HfWeights();
  HfWeights(HfWeights&&) noexcept;

  const std::string& dir() const { return dir_; }
  // Every tensor's name, sorted.
  std::vector<std::string> names() const;
  bool Has(const std::string& name) const { return where_.count(name) > 0; }
  // Throw naming the directory and the tensor when it is absent.
  const trainer::SafetensorsEntry& Entry(const std::string& name) const;
  const std::string& FileOf(const std::string& name) const;
  at::Tensor Tensor(const std::string& name) const;
  at::Tensor Range(const std::string& name, int64_t first, int64_t count) const;

 private:
  const trainer::SafetensorsFile& File(const std::string& name) const;
  std::string dir_;
  std::vector<trainer::SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index in files_
};

// A model directory's config and weights.
struct HfModelDir {
  explicit HfModelDir(const std::string& dir);
  LlamaConfig config;
  HfWeights weights;
};

// The checkpoint names `model`'s parameters must have, given the config (a
// tied head has no `lm_head.weight`); checks that the checkpoint has each
// with the parameter's shape and nothing else (a tied checkpoint's copy of
// `lm_head.weight` and old `rotary_emb.inv_freq` buffers are allowed) and
// throws InvalidArgumentError listing what is missing, unexpected or of
// another shape.
void CheckHfWeights(torch::nn::Module& model, const LlamaConfig& config, const HfWeights& weights);
// The same against the parameters' names and (global) shapes.
void CheckHfWeights(const std::map<std::string, std::vector<int64_t>>& shapes, const LlamaConfig& config,
                    const HfWeights& weights);
// CheckHfWeights, then copies every tensor into its parameter (converted to
// the parameter's dtype). For an unsharded model.
void LoadHfWeights(torch::nn::Module& model, const LlamaConfig& config, const HfWeights& weights);

// "5GB" (10^9), "500MiB" (2^20), "100KB", "123" (bytes) -> bytes; throws
// InvalidArgumentError naming the valid forms.
int64_t ParseHfSize(const std::string& text);

struct HfSaveOptions {
  at::ScalarType dtype = at::kFloat;         // kFloat, kBFloat16 or kHalf
  int64_t max_shard_bytes = 50'000'000'000;  // transformers 5.x's default "50GB"
};

// One tensor to save: its name and shape (dtype from the options).
struct HfTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// A model directory being written at `dir`: the tensors are split into files
// of at most max_shard_bytes in the order given (a tensor larger than that
// alone in its file), with the index when there is more than one file; they
// then arrive in any order, each once (e.g. as a sharded model's units are
// gathered), converted to the options' dtype. Commit() writes config.json
// and generation_config.json and removes weight files of an earlier save
// that this one does not use. Every file is written atomically; a writer
// destroyed uncommitted leaves the directory's earlier model intact.
class HfModelWriter {
 public:
  HfModelWriter(const std::string& dir, const LlamaConfig& config, const std::vector<HfTensorSpec>& tensors,
                const HfSaveOptions& options);
  ~HfModelWriter();
  bool Has(const std::string& name) const { return file_of_.count(name) > 0; }
  void Write(const std::string& name, const at::Tensor& t);
  // The files written, relative to the directory.
  std::vector<std::string> Commit();

 private:
  std::string dir_;
  LlamaConfig config_;
  HfSaveOptions options_;
  int64_t total_bytes_ = 0;
  std::vector<std::string> file_names_;
  std::vector<std::unique_ptr<trainer::SafetensorsWriter>> files_;
  std::map<std::string, size_t> file_of_;
};

// An unsharded model's parameters, in order, through HfModelWriter.
std::vector<std::string> SaveHfModel(const std::string& dir, const LlamaConfig& config, torch::nn::Module& model,
                                     const HfSaveOptions& options);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_HF_CHECKPOINT_H_
