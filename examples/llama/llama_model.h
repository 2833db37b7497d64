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
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_MODEL_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_MODEL_H_

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "examples/llama/llama_config.h"
#include "sharding/wrap_point.h"

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

// y = x W^T + b, with Hugging Face's parameter names (weight [out, in],
// bias [out]); weights drawn from N(0, std) (zero under a ZeroInitScope),
// biases zero.
class LlamaLinearImpl : public torch::nn::Module {
 public:
  LlamaLinearImpl(int64_t in, int64_t out, bool bias, double std);
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  at::Tensor weight, bias;
};
TORCH_MODULE(LlamaLinear);

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
  int64_t heads_, kv_heads_, head_dim_;
  LlamaLinear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
};

class LlamaMlpImpl : public torch::nn::Module {
 public:
  explicit LlamaMlpImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  LlamaLinear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
};

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, LayerKvCache* cache);

 private:
  std::shared_ptr<LlamaAttentionImpl> self_attn_;
  std::shared_ptr<LlamaMlpImpl> mlp_;
  RmsNorm input_layernorm_{nullptr}, post_attention_layernorm_{nullptr};
};

// Hugging Face's LlamaModel: the decoder without its head ("model." in names).
class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& c);
  // ids [B, T] -> final hidden states [B, T, hidden]. With `cache` (one entry
  // per layer, resized when empty), positions continue after the cached ones.
  at::Tensor forward(const at::Tensor& ids, std::vector<LayerKvCache>* cache = nullptr);
  const torch::nn::Embedding& embed_tokens() const { return embed_tokens_; }

 private:
  LlamaConfig config_;
  at::Tensor inv_freq_;  // rotary frequencies, float32 (not a parameter or buffer)
  double rope_scale_ = 1.0;
  torch::nn::Embedding embed_tokens_{nullptr};
  torch::nn::ModuleList layers_holder_{nullptr};
  std::vector<std::shared_ptr<sharding::Sharded<LlamaDecoderLayerImpl>>> layers_;
  RmsNorm norm_{nullptr};
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
  // ids [B, T] -> logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& ids);
  // ids [B, T] -> logits [B, T, vocab] of the positions after those in
  // `cache` (empty at first: one entry per layer), which is grown by them.
  at::Tensor ForwardWithCache(const at::Tensor& ids, std::vector<LayerKvCache>& cache);
  // Next-token cross-entropy in float32; targets equal to -100 are ignored.
  static at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);
  // prompt [B, T] -> prompt followed by up to max_new_tokens ids, decoded with
  // a key/value cache; no gradients.
  at::Tensor Generate(const at::Tensor& prompt, const GenerateOptions& options);
  const LlamaConfig& config() const { return config_; }

 private:
  at::Tensor Head(const at::Tensor& hidden);
  LlamaConfig config_;
  std::shared_ptr<LlamaModelImpl> model_;
  LlamaLinear lm_head_{nullptr};  // null when tied to the embedding
};
TORCH_MODULE(LlamaForCausalLM);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_MODEL_H_
