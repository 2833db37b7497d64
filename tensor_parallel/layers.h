// Tensor-parallel layers, in PyTorch's vocabulary (torch.distributed.tensor.
// parallel): column-wise and row-wise parallel linear layers, a vocabulary-
// parallel embedding, sequence-parallel norms, and the cross-entropy of a
// vocabulary-sharded head.
//
// A model declares its plan by building these layers where torchtitan's plan
// names ColwiseParallel, RowwiseParallel and SequenceParallel. Each layer
// takes its group from the TensorParallelScope it is built in
// (tensor_parallel/placement.h); outside one, or with a group of one, it is
// the plain layer (the same parameter names, shapes and results as
// torch::nn::Linear / Embedding / the wrapped norm), so one model class serves
// every strategy. Built in a scope, each layer creates this rank's piece of
// its parameters only, drawn as the slice of the global tensor the same seed
// would give a single-device model (so a tensor-parallel model and a
// single-device model built with the same seed hold the same weights), and
// reports the pieces' placements (TensorParallelModule).
//
// Activations: column-parallel layers take a replicated input (or, under
// sequence parallelism, one sharded along the sequence) and produce this
// rank's columns; row-parallel layers take those and produce a replicated
// output (or one reduce-scattered along the sequence). Sequence parallelism
// (TensorParallelScope's flag) keeps the activations between them — norms,
// dropout, residuals — sharded along the sequence dimension (1 of [B, T, C]).
#ifndef SHARDTRAIN_TENSOR_PARALLEL_LAYERS_H_
#define SHARDTRAIN_TENSOR_PARALLEL_LAYERS_H_

#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "comm/communicator.h"
#include "tensor_parallel/placement.h"

namespace shardtrain::tensor_parallel {

enum class LinearStyle { kColwise, kRowwise };

struct ParallelLinearOptions {
  ParallelLinearOptions(int64_t in, int64_t out, LinearStyle style) : in(in), out(out), style(style) {}
  int64_t in;
  int64_t out;
  LinearStyle style;
  bool bias = true;
  // Column-wise: the output features are `chunks` blocks split separately
  // (a fused q, k, v projection: 3), so each rank holds whole heads of each.
  int64_t chunks = 1;
  // Column-wise: all-gather the output (replicated) instead of returning this
  // rank's columns. Needs out / chunks to divide by the group size.
  bool gather_output = false;
};

class ParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  // Initialised as torch::nn::Linear (kaiming-uniform weight, uniform bias).
  explicit ParallelLinearImpl(const ParallelLinearOptions& options);
  // Initialised from the global tensors given ([out, in] and [out], or an
  // undefined bias when options.bias is false): this rank keeps its piece.
  // For a model with an initialisation of its own.
  ParallelLinearImpl(const ParallelLinearOptions& options, const at::Tensor& global_weight,
                     const at::Tensor& global_bias);
  at::Tensor forward(const at::Tensor& x);
  // Redraws the weight from N(mean, std) (as the global tensor, then this
  // rank's piece) and zeroes the bias: GPT-style initialisation.
  void InitNormal(double mean, double std);
  std::map<std::string, Placement> Placements() const override;
  const ParallelLinearOptions& options() const { return options_; }
  // Column-wise (chunks == 1): the output features [begin, end) this rank
  // computes (a vocabulary-parallel head's range for VocabParallelCrossEntropy).
  std::pair<int64_t, int64_t> output_range() const;
  const comm::CommunicatorPtr& group() const { return group_; }

  at::Tensor weight;
  at::Tensor bias;

 private:
  void Register(const at::Tensor& global_weight, const at::Tensor& global_bias);
  void SetWeights(const at::Tensor& global_weight, const at::Tensor& global_bias);
  ParallelLinearOptions options_;
  comm::CommunicatorPtr group_;
  bool sequence_parallel_;
  Placement weight_placement_, bias_placement_;
};

// nn.Embedding with its rows (the vocabulary) split over the group
// (RowwiseParallel on an embedding): each rank looks up the ids in its range,
// and the partial results are summed (or, under sequence parallelism,
// reduce-scattered along the sequence).
class ParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  // Initialised as torch::nn::Embedding (N(0, 1)).
  ParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
  // Initialised from the global [num_embeddings, embedding_dim] tensor given.
  explicit ParallelEmbeddingImpl(const at::Tensor& global_weight);
  at::Tensor forward(const at::Tensor& ids);
  void InitNormal(double mean, double std);
  // Logits of a head tied to this embedding: this rank's vocabulary columns
  // [..., vocab_range()), from a replicated input (sequence-sharded under
  // sequence parallelism). Feed them to VocabParallelCrossEntropy.
  at::Tensor TiedLogits(const at::Tensor& x);
  // The ids [begin, end) this rank holds.
  std::pair<int64_t, int64_t> vocab_range() const { return range_; }
  const comm::CommunicatorPtr& group() const { return group_; }
  std::map<std::string, Placement> Placements() const override;

  at::Tensor weight;

 private:
  comm::CommunicatorPtr group_;
  bool sequence_parallel_;
  Placement placement_;
  std::pair<int64_t, int64_t> range_;
};

// A module that runs on sequence shards under sequence parallelism (a norm,
// dropout): Impl itself, whose parameters are reported replicated with
// partial gradients (each rank saw only its tokens) when built in a
// sequence-parallel scope. Without sequence parallelism, exactly Impl.
template <typename Impl>
class SequenceParallel : public Impl, public TensorParallelModule {
 public:
  template <typename... Args>
  explicit SequenceParallel(Args&&... args)
      : Impl(std::forward<Args>(args)...), partial_(TensorParallelScope::CurrentSequenceParallel()) {}
  std::map<std::string, Placement> Placements() const override {
    std::map<std::string, Placement> out;
    for (const auto& item : this->named_parameters(/*recurse=*/true)) {
      Placement p;
      p.global_shape = item.value().sizes().vec();
      p.partial_grad = partial_;
      out.emplace(item.key(), p);
    }
    return out;
  }

 private:
  bool partial_;
};

// The input of a column-parallel computation outside ParallelLinear (a tied
// head): CopyToRegion, or GatherSequence along dim 1 under sequence parallelism.
at::Tensor ColumnParallelInput(const at::Tensor& x, const comm::CommunicatorPtr& group, bool sequence_parallel);

// All `vocab_size` logits from a vocabulary-parallel head's ([..., this
// rank's columns]): an all-gather over the group, which every rank of it
// calls; `logits` itself with no group. No gradient.
at::Tensor GatherVocabulary(const at::Tensor& logits, int64_t vocab_size, const comm::CommunicatorPtr& group);

// Mean cross-entropy (ignoring targets equal to `ignore_index`, as
// torch.nn.functional.cross_entropy) of logits whose last dimension is this
// rank's vocabulary columns [vocab_begin, vocab_begin + logits.size(-1)),
// computed in float32 without gathering the vocabulary: the max, the sum of
// exponentials and the target's logit are summed over the group (PyTorch's
// loss_parallel). targets: global ids, the logits' shape without the last
// dimension. With no group it is at::cross_entropy_loss.
at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_begin,
                                     const comm::CommunicatorPtr& group, int64_t ignore_index = -100);

}  // namespace shardtrain::tensor_parallel

#endif  // SHARDTRAIN_TENSOR_PARALLEL_LAYERS_H_
