#include "tensor_parallel/layers.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <cmath>

#include "base/errors.h"
#include "tensor_parallel/collectives.h"

namespace shardtrain::tensor_parallel {
namespace {

int GroupSize(const comm::CommunicatorPtr& g) { return g ? g->size() : 1; }
int GroupRank(const comm::CommunicatorPtr& g) { return g ? g->rank() : 0; }

Placement Sharded(std::vector<int64_t> shape, int64_t dim, int64_t chunks, const comm::CommunicatorPtr& group,
                  const char* what) {
  Placement p;
  p.sharded = group != nullptr;
  p.dim = dim;
  p.chunks = chunks;
  p.global_shape = std::move(shape);
  const int size = GroupSize(group);
  ST_CHECK_ARG(chunks >= 1 && p.global_shape[dim] % chunks == 0, what, ": dimension ", dim, " of [", p.global_shape[0],
               ", ...] (", p.global_shape[dim], ") must divide into ", chunks, " chunks");
  const int64_t rows = p.global_shape[dim] / chunks;
  const int64_t per_rank = (rows + size - 1) / size;
  ST_CHECK_ARG(per_rank * (size - 1) < rows, what, ": ", rows, " rows", chunks > 1 ? " per chunk" : "",
               " cannot be split over a tensor-parallel group of ", size,
               " so that every rank holds some (torch.chunk's split gives ", per_rank,
               " per rank); use a smaller tensor_parallel_size or a larger dimension");
  return p;
}

Placement Replicated(std::vector<int64_t> shape, bool partial_grad) {
  Placement p;
  p.global_shape = std::move(shape);
  p.partial_grad = partial_grad;
  return p;
}

at::Tensor Piece(const at::Tensor& global, const Placement& p, const comm::CommunicatorPtr& group) {
  return LocalPiece(global, p, GroupRank(group), GroupSize(group));
}

// `o`, once its sizes are checked (before anything is drawn or cut).
const ParallelLinearOptions& CheckedSizes(const ParallelLinearOptions& o) {
  ST_CHECK_ARG(o.in > 0 && o.out > 0, "ParallelLinear: in and out features must be positive, got ", o.in, " and ",
               o.out);
  return o;
}

// torch::nn::Linear's initialisation, drawn globally (the weight first).
at::Tensor LinearInitialWeight(const ParallelLinearOptions& o) {
  at::Tensor w = at::empty({o.out, o.in});
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  return w;
}

at::Tensor LinearInitialBias(const ParallelLinearOptions& o) {
  if (!o.bias) return at::Tensor();
  const double bound = 1.0 / std::sqrt(static_cast<double>(o.in));
  at::Tensor b = at::empty({o.out});
  torch::nn::init::uniform_(b, -bound, bound);
  return b;
}

at::Tensor EmbeddingInitialWeight(int64_t num_embeddings, int64_t embedding_dim) {
  ST_CHECK_ARG(num_embeddings > 0 && embedding_dim > 0, "ParallelEmbedding: sizes must be positive, got ",
               num_embeddings, " x ", embedding_dim);
  at::Tensor w = at::empty({num_embeddings, embedding_dim});
  torch::nn::init::normal_(w);  // torch::nn::Embedding's initialisation
  return w;
}

}  // namespace

ParallelLinearImpl::ParallelLinearImpl(const ParallelLinearOptions& options)
    : options_(CheckedSizes(options)),
      group_(TensorParallelScope::CurrentGroup()),
      sequence_parallel_(TensorParallelScope::CurrentSequenceParallel()) {
  at::Tensor w = LinearInitialWeight(options);  // drawn before the bias, as torch::nn::Linear does
  at::Tensor b = LinearInitialBias(options);
  Register(w, b);
}

ParallelLinearImpl::ParallelLinearImpl(const ParallelLinearOptions& options, const at::Tensor& global_weight,
                                       const at::Tensor& global_bias)
    : options_(CheckedSizes(options)),
      group_(TensorParallelScope::CurrentGroup()),
      sequence_parallel_(TensorParallelScope::CurrentSequenceParallel()) {
  Register(global_weight, global_bias);
}

void ParallelLinearImpl::Register(const at::Tensor& global_weight, const at::Tensor& global_bias) {
  const ParallelLinearOptions& options = options_;
  const bool colwise = options.style == LinearStyle::kColwise;
  ST_CHECK_ARG(colwise || (options.chunks == 1 && !options.gather_output),
               "ParallelLinear: chunks and gather_output are options of column-wise layers only");
  ST_CHECK_ARG(!options.gather_output || options.chunks == 1, "ParallelLinear: gather_output needs chunks == 1");
  const char* what = colwise ? "ColwiseParallel linear" : "RowwiseParallel linear";
  weight_placement_ = Sharded({options.out, options.in}, colwise ? 0 : 1, options.chunks, group_, what);
  if (options.gather_output && group_) {
    ST_CHECK_ARG(options.out % group_->size() == 0, what, " with gather_output: out features (", options.out,
                 ") must divide by the tensor-parallel size ", group_->size());
  }
  bias_placement_ =
      colwise ? Sharded({options.out}, 0, options.chunks, group_, what) : Replicated({options.out}, sequence_parallel_);
  ST_CHECK_ARG(options.bias == global_bias.defined(), what, ": options.bias is ", options.bias ? "true" : "false",
               " but a global bias was ", global_bias.defined() ? "given" : "not given");
  weight = register_parameter("weight", Piece(global_weight, weight_placement_, group_));
  if (options.bias) bias = register_parameter("bias", Piece(global_bias, bias_placement_, group_));
}

std::pair<int64_t, int64_t> ParallelLinearImpl::output_range() const {
  ST_CHECK_ARG(options_.style == LinearStyle::kColwise && options_.chunks == 1,
               "ParallelLinear: output_range() is for column-wise layers of one chunk");
  if (!weight_placement_.sharded) return {0, options_.out};
  return weight_placement_.Range(group_->rank(), group_->size());
}

void ParallelLinearImpl::SetWeights(const at::Tensor& global_weight, const at::Tensor& global_bias) {
  at::NoGradGuard no_grad;
  weight.copy_(Piece(global_weight, weight_placement_, group_));
  if (bias.defined()) bias.copy_(Piece(global_bias, bias_placement_, group_));
}

void ParallelLinearImpl::InitNormal(double mean, double std) {
  at::Tensor w = at::empty(weight_placement_.global_shape);
  torch::nn::init::normal_(w, mean, std);
  SetWeights(w, at::zeros(bias_placement_.global_shape));
}

at::Tensor ParallelLinearImpl::forward(const at::Tensor& x) {
  if (options_.style == LinearStyle::kColwise) {
    at::Tensor y = at::linear(ColumnParallelInput(x, group_, sequence_parallel_), weight, bias);
    return options_.gather_output ? GatherFromRegion(y, -1, group_) : y;
  }
  if (!group_) return at::linear(x, weight, bias);  // torch::nn::Linear's result, bit for bit
  at::Tensor y = at::linear(x, weight);
  y = sequence_parallel_ ? ReduceScatterSequence(y, 1, group_) : ReduceFromRegion(y, group_);
  return bias.defined() ? y + bias : y;
}

std::map<std::string, Placement> ParallelLinearImpl::Placements() const {
  std::map<std::string, Placement> out = {{"weight", weight_placement_}};
  if (bias.defined()) out.emplace("bias", bias_placement_);
  return out;
}

ParallelEmbeddingImpl::ParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
    : ParallelEmbeddingImpl(EmbeddingInitialWeight(num_embeddings, embedding_dim)) {}

ParallelEmbeddingImpl::ParallelEmbeddingImpl(const at::Tensor& global_weight)
    : group_(TensorParallelScope::CurrentGroup()), sequence_parallel_(TensorParallelScope::CurrentSequenceParallel()) {
  ST_CHECK_ARG(global_weight.dim() == 2, "ParallelEmbedding: the weight must be [num_embeddings, embedding_dim], got ",
               global_weight.sizes());
  const int64_t num_embeddings = global_weight.size(0);
  placement_ = Sharded(global_weight.sizes().vec(), 0, 1, group_, "ParallelEmbedding (vocabulary)");
  range_ = placement_.sharded ? placement_.Range(GroupRank(group_), GroupSize(group_))
                              : std::pair<int64_t, int64_t>{0, num_embeddings};
  weight = register_parameter("weight", Piece(global_weight, placement_, group_));
}

void ParallelEmbeddingImpl::InitNormal(double mean, double std) {
  at::Tensor w = at::empty(placement_.global_shape);
  torch::nn::init::normal_(w, mean, std);
  at::NoGradGuard no_grad;
  weight.copy_(Piece(w, placement_, group_));
}

at::Tensor ParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (!group_) return at::embedding(weight, ids);
  const at::Tensor outside = (ids < range_.first) | (ids >= range_.second);
  const at::Tensor local_ids = (ids - range_.first).masked_fill(outside, 0);
  at::Tensor partial = at::embedding(weight, local_ids).masked_fill(outside.unsqueeze(-1), 0);
  return sequence_parallel_ ? ReduceScatterSequence(partial, 1, group_) : ReduceFromRegion(partial, group_);
}

at::Tensor ParallelEmbeddingImpl::TiedLogits(const at::Tensor& x) {
  return at::linear(ColumnParallelInput(x, group_, sequence_parallel_), weight);
}

std::map<std::string, Placement> ParallelEmbeddingImpl::Placements() const { return {{"weight", placement_}}; }

at::Tensor ColumnParallelInput(const at::Tensor& x, const comm::CommunicatorPtr& group, bool sequence_parallel) {
  return sequence_parallel ? GatherSequence(x, 1, group) : CopyToRegion(x, group);
}

at::Tensor GatherVocabulary(const at::Tensor& logits, int64_t vocab_size, const comm::CommunicatorPtr& group) {
  if (!group) return logits;
  at::NoGradGuard no_grad;
  Placement p;
  p.sharded = true;
  p.dim = logits.dim() - 1;
  p.global_shape = logits.sizes().vec();
  p.global_shape.back() = vocab_size;
  return GatherGlobal(logits.contiguous(), p, group);
}

}  // namespace shardtrain::tensor_parallel
