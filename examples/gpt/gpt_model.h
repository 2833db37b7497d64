// A GPT-style decoder-only transformer (nanoGPT layout and parameter names):
// token + position embeddings, N pre-LayerNorm blocks (causal self-attention,
// GELU MLP), a final LayerNorm and an output head tied to the token embedding.
// Each block is a Sharded<BlockImpl> wrap point, so FSDP strategies shard the
// model block by block; without a sharding strategy it is a plain module.
//
// Its tensor-parallel plan (tensor_parallel/layers.h; used when it is built
// in model_parallel's construction scope, plain layers otherwise): c_attn
// column-wise in 3 chunks (each rank holds whole heads of q, k and v), the
// attention's c_proj row-wise, c_fc column-wise and the MLP's c_proj
// row-wise; wte vocabulary-parallel with the tied head's logits left split
// over the vocabulary (LossOf is the vocabulary-parallel cross-entropy); the
// norms and wpe sequence parallel.
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
#include "tensor_parallel/layers.h"

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
  int64_t n_head_;  // this rank's heads
  double dropout_;
  std::shared_ptr<tensor_parallel::ParallelLinearImpl> c_attn_, c_proj_;
};

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const GptConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  std::shared_ptr<tensor_parallel::ParallelLinearImpl> c_fc_, c_proj_;
  torch::nn::Dropout dropout_{nullptr};
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& c);
  at::Tensor forward(const at::Tensor& x);

 private:
  std::shared_ptr<tensor_parallel::SequenceParallel<torch::nn::LayerNormImpl>> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttentionImpl> attn_;
  std::shared_ptr<MlpImpl> mlp_;
};

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& c);
  // idx: [B, T] token ids -> logits [B, T, vocab] (tensor parallel: this
  // rank's vocabulary columns, wte's vocab_range()).
  at::Tensor forward(const at::Tensor& idx);
  // Cross-entropy of next-token prediction (targets [B, T]), computed in float32.
  static at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);
  // The same for this model's forward: vocabulary-parallel when tensor parallel.
  at::Tensor LossOf(const at::Tensor& logits, const at::Tensor& targets) const;
  // All the vocabulary's logits from forward's (an all-gather over the
  // tensor-parallel group, every rank of it calls; the logits themselves
  // without tensor parallelism). No gradient.
  at::Tensor GatherLogits(const at::Tensor& logits) const;
  // Samples `n` tokens after `prompt` ([1, T]) with temperature; no gradients.
  // Not for a tensor-parallel model (throws): generate from a full checkpoint.
  at::Tensor Generate(at::Tensor prompt, int64_t n, double temperature, int64_t top_k);
  const GptConfig& config() const { return config_; }

 private:
  GptConfig config_;
  comm::CommunicatorPtr tp_group_;  // tensor parallel (nullptr: none)
  bool sequence_parallel_ = false;
  std::shared_ptr<tensor_parallel::ParallelEmbeddingImpl> wte_;
  std::shared_ptr<tensor_parallel::SequenceParallel<torch::nn::EmbeddingImpl>> wpe_;
  torch::nn::Dropout drop_{nullptr};
  torch::nn::ModuleList h_{nullptr};
  std::vector<std::shared_ptr<sharding::Sharded<BlockImpl>>> blocks_;
  std::shared_ptr<tensor_parallel::SequenceParallel<torch::nn::LayerNormImpl>> ln_f_;
};

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_GPT_GPT_MODEL_H_
