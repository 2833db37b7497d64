// A Llama-family decoder (Hugging Face's LlamaForCausalLM, module for module
// and name for name): token embedding, N decoder layers (RMSNorm, attention
// with rotary position embeddings and grouped-query heads, RMSNorm, SwiGLU
// MLP), a final RMSNorm and an output head, tied to the embedding or not.
// Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`,
// `lm_head.weight`), so its state dict maps one to one onto a checkpoint.
//
// Each decoder layer is a Sharded<> wrap point: FSDP strategies shard the
// model layer by layer; without a strategy it is a plain module. Attention is
// LibTorch's scaled-dot-product attention (causal); Generate() decodes with a
// per-layer key/value cache.
//
// Its tensor-parallel plan (torchtitan's Llama plan; tensor_parallel/layers.h,
// used when it is built in model_parallel's construction scope, plain layers
// otherwise): q_proj, k_proj, v_proj column-wise (each rank holds whole query
// and key/value heads: num_attention_heads and num_key_value_heads divide by
// the group), o_proj row-wise; gate_proj, up_proj column-wise, down_proj
// row-wise; embed_tokens vocabulary-parallel; lm_head column-wise with its
// logits left split over the vocabulary (or, tied, the embedding's; LossOf is
// the vocabulary-parallel cross-entropy); the RMSNorms sequence parallel.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_MODEL_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_MODEL_H_

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "examples/llama/llama_config.h"
#include "sharding/wrap_point.h"
#include "tensor_parallel/layers.h"

namespace shardtrain::examples::llama {

// The keys and values one layer has seen so far ([B, kv_heads, T, head_dim]),
// grown by each forward that is given it.
struct LayerKvCache {
  at::Tensor keys, values;
  int64_t length() const { return keys.defined() ? keys.size(2) : 0; }
};

// While one is alive on a thread, the Llama modules built on it get zero
// weights instead of random ones, drawing no random numbers: for a model whose
// weights are all loaded next (as transformers' from_pretrained skips the
// initialization). Zeros rather than uninitialized memory, so the ranks of a
// sharded construction agree on the values until the load replaces them.
class ZeroInitScope {
 public:
  ZeroInitScope();
  ~ZeroInitScope();
  ZeroInitScope(const ZeroInitScope&) = delete;
  ZeroInitScope& operator=(const ZeroInitScope&) = delete;
  static bool active();

 private:
  bool previous_;
};

// Root-mean-square layer norm, computed in float32 (Hugging Face's LlamaRMSNorm).
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& c);
  // x [B, T, hidden]; cos/sin [B, T, head_dim] for x's positions; `cache`
  // (may be null) holds the earlier positions' keys and values and is grown.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, LayerKvCache* cache);

 private:
  int64_t heads_, kv_heads_, head_dim_;  // this rank's heads (all of them without tensor parallelism)
  std::shared_ptr<tensor_parallel::ParallelLinearImpl> q_proj_, k_proj_, v_proj_, o_proj_;
};

class LlamaMlpImpl : public torch::nn::Module {
 public:
  explicit LlamaMlpImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  std::shared_ptr<tensor_parallel::ParallelLinearImpl> gate_proj_, up_proj_, down_proj_;
};

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, LayerKvCache* cache);

 private:
  std::shared_ptr<LlamaAttentionImpl> self_attn_;
  std::shared_ptr<LlamaMlpImpl> mlp_;
  std::shared_ptr<tensor_parallel::SequenceParallel<RmsNormImpl>> input_layernorm_, post_attention_layernorm_;
};

// Hugging Face's LlamaModel: the decoder without its head ("model." in names).
class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& c);
  // ids [B, T] -> final hidden states [B, T, hidden]. With `cache` (one entry
  // per layer, resized when empty), positions continue after the cached ones.
  // Under sequence parallelism: this rank's part of the sequence padded at its
  // end to a multiple of the group (no cache then).
  at::Tensor forward(const at::Tensor& ids, std::vector<LayerKvCache>* cache = nullptr);
  tensor_parallel::ParallelEmbeddingImpl& embed_tokens() const { return *embed_tokens_; }

 private:
  LlamaConfig config_;
  at::Tensor inv_freq_;  // rotary frequencies, float32 (not a parameter or buffer)
  double rope_scale_ = 1.0;
  comm::CommunicatorPtr tp_group_;  // tensor parallel (nullptr: none)
  bool sequence_parallel_ = false;
  std::shared_ptr<tensor_parallel::ParallelEmbeddingImpl> embed_tokens_;
  torch::nn::ModuleList layers_holder_{nullptr};
  std::vector<std::shared_ptr<sharding::Sharded<LlamaDecoderLayerImpl>>> layers_;
  std::shared_ptr<tensor_parallel::SequenceParallel<RmsNormImpl>> norm_;
};

// How Generate() picks each next token.
struct GenerateOptions {
  int64_t max_new_tokens = 32;
  bool greedy = false;       // argmax; otherwise sampled
  double temperature = 1.0;  // sampled: logits divided by it
  int64_t top_k = 0;         // sampled: keep the k most likely (0: all)
  double top_p = 1.0;        // sampled: keep the smallest set with this mass
  uint64_t seed = 0;         // sampled: the generator's seed
  bool stop_at_eos = true;   // stop when every sequence has produced an eos id
};

// The next token of each row of `logits` ([B, vocab], float32, on the CPU)
// as `options` say: argmax, or sampled with temperature, top-k and top-p
// from `gen`. -> [B] int64.
at::Tensor PickNextToken(at::Tensor logits, const GenerateOptions& options, at::Generator& gen);

class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  explicit LlamaForCausalLMImpl(const LlamaConfig& c);
  // ids [B, T] -> logits [B, T, vocab] (tensor parallel: this rank's
  // vocabulary columns, vocab_range()).
  at::Tensor forward(const at::Tensor& ids);
  // ids [B, T] -> logits [B, T, vocab] of the positions after those in
  // `cache` (empty at first: one entry per layer), which is grown by them.
  at::Tensor ForwardWithCache(const at::Tensor& ids, std::vector<LayerKvCache>& cache);
  // Next-token cross-entropy in float32; targets equal to -100 are ignored.
  static at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);
  // The same for this model's forward: vocabulary-parallel when tensor parallel.
  at::Tensor LossOf(const at::Tensor& logits, const at::Tensor& targets) const;
  // The vocabulary ids [begin, end) whose logits forward() returns.
  std::pair<int64_t, int64_t> vocab_range() const;
  // All the vocabulary's logits from forward's (an all-gather over the
  // tensor-parallel group, which every rank of it calls). No gradient.
  at::Tensor GatherLogits(const at::Tensor& logits) const;
  bool tensor_parallel() const { return tp_group_ != nullptr; }
  // prompt [B, T] -> prompt followed by up to max_new_tokens ids, decoded with
  // a key/value cache; no gradients. Not for a tensor-parallel model (throws).
  at::Tensor Generate(const at::Tensor& prompt, const GenerateOptions& options);
  const LlamaConfig& config() const { return config_; }

 private:
  at::Tensor Head(const at::Tensor& hidden);
  LlamaConfig config_;
  std::shared_ptr<LlamaModelImpl> model_;
  comm::CommunicatorPtr tp_group_;
  std::shared_ptr<tensor_parallel::ParallelLinearImpl> lm_head_;  // null when tied to the embedding
};
TORCH_MODULE(LlamaForCausalLM);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_MODEL_H_
