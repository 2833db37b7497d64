// A GPT-style decoder-only transformer (nanoGPT layout and parameter names):
// token + position embeddings, N pre-LayerNorm blocks (causal self-attention,
// GELU MLP), a final LayerNorm and an output head tied to the token embedding.
// Each block is a Sharded<BlockImpl> wrap point, so FSDP strategies shard the
// model block by block; without a sharding strategy it is a plain module.
#ifndef SHARDTRAIN_EXAMPLES_GPT_GPT_MODEL_H_
#define SHARDTRAIN_EXAMPLES_GPT_GPT_MODEL_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sharding/wrap_point.h"

namespace shardtrain::examples {

struct GptConfig {
  int64_t vocab_size = 96;
  int64_t block_size = 64;  // context length
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  double dropout = 0.0;
  // Parameter count of this configuration (tied head counted once).
  int64_t NumParameters() const;
  std::string ToString() const;
};

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t n_head_;
  double dropout_;
  torch::nn::Linear c_attn_{nullptr}, c_proj_{nullptr};
};

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const GptConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Linear c_fc_{nullptr}, c_proj_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  std::shared_ptr<CausalSelfAttentionImpl> attn_;
  std::shared_ptr<MlpImpl> mlp_;
};

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& c);
  // idx: [B, T] token ids -> logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& idx);
  // Cross-entropy of next-token prediction (targets [B, T]), computed in float32.
  static at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);
  // Samples `n` tokens after `prompt` ([1, T]) with temperature; no gradients.
  at::Tensor Generate(at::Tensor prompt, int64_t n, double temperature, int64_t top_k);
  const GptConfig& config() const { return config_; }

 private:
  GptConfig config_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::Dropout drop_{nullptr};
  torch::nn::ModuleList h_{nullptr};
  std::vector<std::shared_ptr<sharding::Sharded<BlockImpl>>> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
};

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_GPT_GPT_MODEL_H_
