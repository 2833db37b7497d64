// A small causal LM written with tensor_parallel's layers (the plan
// torchtitan gives a transformer: q/k/v and the MLP's first layer column-wise,
// the output projections row-wise, norms and the position embedding sequence
// parallel, a vocabulary-parallel embedding tied to the head). Built outside a
// TensorParallelScope it is a plain single-device model with the same names.
#ifndef SHARDTRAIN_TESTS_TENSOR_PARALLEL_TINY_TP_LM_H_
#define SHARDTRAIN_TESTS_TENSOR_PARALLEL_TINY_TP_LM_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <atomic>
#include <memory>
#include <vector>

#include "sharding/wrap_point.h"
#include "tensor_parallel/layers.h"

namespace shardtrain::tensor_parallel::testing {

struct TinyConfig {
  int64_t vocab = 37;  // uneven over 2 and 4 ranks
  int64_t block = 8;
  int64_t embd = 16;
  int64_t heads = 4;
  int64_t layers = 2;
  bool bias = true;
};

class TinyBlockImpl : public torch::nn::Module {
 public:
  explicit TinyBlockImpl(const TinyConfig& c);
  at::Tensor forward(const at::Tensor& x);
  // Calls of forward on every thread since the last reset (activation
  // checkpointing runs it again in backward).
  static std::atomic<int64_t> forward_calls;

 private:
  int64_t local_heads_;
  std::shared_ptr<SequenceParallel<torch::nn::LayerNormImpl>> ln_1_, ln_2_;
  std::shared_ptr<ParallelLinearImpl> qkv_, proj_, fc_, fc_proj_;
};

class TinyLmImpl : public torch::nn::Module {
 public:
  explicit TinyLmImpl(const TinyConfig& c);
  // This rank's vocabulary columns of the logits (all of them without TP).
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);

 private:
  comm::CommunicatorPtr group_;
  bool sequence_parallel_;
  std::shared_ptr<ParallelEmbeddingImpl> wte_;
  std::shared_ptr<SequenceParallel<torch::nn::EmbeddingImpl>> wpe_;
  std::vector<std::shared_ptr<sharding::Sharded<TinyBlockImpl>>> blocks_;  // FSDP units
  std::shared_ptr<SequenceParallel<torch::nn::LayerNormImpl>> ln_f_;
};

}  // namespace shardtrain::tensor_parallel::testing

#endif  // SHARDTRAIN_TESTS_TENSOR_PARALLEL_TINY_TP_LM_H_
