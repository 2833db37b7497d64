// Placement: how one parameter of a tensor-parallel model lies on the
// tensor-parallel group (what PyTorch's DTensor records), and the scope that
// tells tensor-parallel layers, while a model is built, which group they split
// over.
//
// A parameter is either replicated (every rank of the group holds all of it)
// or sharded along one dimension in torch.chunk's split: rank r holds rows
// [r*c, min((r+1)*c, n)) of the dimension's n rows, c = ceil(n / size) (the
// last ranks may hold fewer, or none). A fused parameter (GPT's c_attn: q, k
// and v stacked) is sharded in `chunks` equal blocks, each split that way
// (DTensor's strided shard): rank r's piece is its rows of every block, in
// block order. The global tensor, its shape and its FQN are what state dicts,
// checkpoints, clipping and the model summary use.
#ifndef SHARDTRAIN_TENSOR_PARALLEL_PLACEMENT_H_
#define SHARDTRAIN_TENSOR_PARALLEL_PLACEMENT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::tensor_parallel {

struct Placement {
  bool sharded = false;  // false: replicated on the group
  int64_t dim = 0;       // the sharded dimension
  int64_t chunks = 1;    // blocks split separately along dim (fused parameters)
  std::vector<int64_t> global_shape;
  // The gradient this rank computes is a partial sum over the group (a
  // sequence-parallel norm's weight, a bias added after a reduce-scatter): the
  // strategy sums it over the group before the optimizer step.
  bool partial_grad = false;

  // Rows [begin, end) of one block along dim that `rank` of `group_size` holds.
  std::pair<int64_t, int64_t> Range(int rank, int group_size) const;
  // The shape of `rank`'s piece.
  std::vector<int64_t> LocalShape(int rank, int group_size) const;
  // "Shard(0) of [96, 32]", "Shard(0, chunks=3) of [384, 128]", "Replicate [128]".
  std::string ToString() const;
};

// `rank`'s piece of `global` (a copy, contiguous), for loading a full state.
at::Tensor LocalPiece(const at::Tensor& global, const Placement& placement, int rank, int group_size);

// The global tensor from every rank's piece (an all-gather over `group`,
// which must be the group the placement is on; nullptr: the piece is global).
// Every rank of the group calls it, in the same order.
at::Tensor GatherGlobal(const at::Tensor& local, const Placement& placement, const comm::CommunicatorPtr& group);

// A module whose parameters are tensor parallel reports their placements by
// its own parameter names ("weight", "bias"). Parameters of a model that no
// such module reports are replicated.
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  virtual std::map<std::string, Placement> Placements() const = 0;
};

// The placement of every parameter of `root` by its FQN, replicated ones
// included (with their shapes).
std::map<std::string, Placement> CollectPlacements(const torch::nn::Module& root);

// Held while a model is built: tensor-parallel layers constructed in it split
// over `group` (nullptr or size 1: they are plain layers, the same parameters
// and names as torch::nn's), and sequence-parallel regions are on when
// `sequence_parallel`. Scopes nest on one thread; the innermost wins.
class TensorParallelScope {
 public:
  TensorParallelScope(comm::CommunicatorPtr group, bool sequence_parallel);
  ~TensorParallelScope();
  TensorParallelScope(const TensorParallelScope&) = delete;
  TensorParallelScope& operator=(const TensorParallelScope&) = delete;

  // The innermost scope's group on this thread (nullptr outside any scope).
  static comm::CommunicatorPtr CurrentGroup();
  static bool CurrentSequenceParallel();

 private:
  comm::CommunicatorPtr group_;
  bool sequence_parallel_;
  TensorParallelScope* previous_;
};

}  // namespace shardtrain::tensor_parallel

#endif  // SHARDTRAIN_TENSOR_PARALLEL_PLACEMENT_H_
