// Internal to //sharding: the runtime state of one unit of a ShardedModel and
// the small helpers the sharding core's source files share. Not for use
// outside sharding/ (the trainer and strategies go through
// sharding/sharded_model.h and strategies/strategy.h).
//
// The ShardedModel's implementation is split by what it does:
//   sharded_model.cc            construction, shard groups, accessors, clipping
//   build_units.cc              which parameters form which unit (wrap points, ties, frozen, prebuilt shards)
//   unit_runtime.cc             gathering and freeing a unit's full parameters, forward hooks, prefetch
//   backward.cc                 gradient collection and reduce-scatter during backward
//   state_dict.cc               full and sharded state dicts, optimizer-state shards
//   activation_checkpointing.cc recomputing a unit's forward in backward
//   wrap_policy.cc              which wrap points become units
#ifndef SHARDTRAIN_SHARDING_INTERNAL_SHARDED_UNIT_H_
#define SHARDTRAIN_SHARDING_INTERNAL_SHARDED_UNIT_H_

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "sharding/flat_parameter.h"

namespace torch::autograd {
struct Node;
}

namespace shardtrain::sharding {

class ShardedModel;

// One unit's runtime state.
class ShardedUnit {
 public:
  enum class State { kSharded, kGathering, kGathered };

  ShardedModel* model = nullptr;
  int index = 0;
  std::string name;
  bool is_root = false;
  bool checkpoint = false;
  std::unique_ptr<FlatParameter> flat;
  // What the optimizer steps: the shard itself, or, when the unit holds
  // frozen parameters (laid out after the trainable ones), a leaf viewing
  // only the shard's trainable prefix, so no optimizer (weight decay,
  // momentum) ever touches a frozen element.
  at::Tensor opt_param;
  at::Tensor full;       // gathered parameters in param dtype
  bool aliased = false;  // shard group of one and float32: `full` is the shard itself
  State state = State::kSharded;
  comm::WorkPtr gather_work;
  at::Tensor gather_input;
  std::vector<at::Tensor> param_views;  // views of `full`, one per entry
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  int trainable = 0;

  // Per backward.
  // The gradients stay where autograd made them (each parameter's .grad) and
  // are reduce-scattered from there, as pieces, when the shard group reads
  // pieces in place (Communicator::ReadsPiecesInPlace) and they need no cast;
  // otherwise each is copied into flat_grad.
  bool grads_in_place = false;
  at::Tensor flat_grad;
  std::vector<at::Tensor> grad_views;
  std::vector<bool> grad_written;  // grad_views[k] holds this accumulation's gradient
  bool grads_armed = false;
  bool pre_backward_done = false;
  int grads_pending = 0;
  bool ready = false;
  bool launched = false;
  comm::WorkPtr reduce_work;
  comm::WorkPtr replicate_work;  // HYBRID_SHARD / NO_SHARD: reduce_out's all-reduce across replicas
  at::Tensor reduce_in;
  std::vector<at::Tensor> reduce_pieces;  // grads_in_place: what the reduce-scatter in flight reads
  at::Tensor reduce_out;
  at::Tensor reduce_host;  // offload on a GPU: reduce_out's copy in page-locked memory (GradOffload)
};

namespace internal {

// Adds the wall time of its scope to *total.
class Stopwatch {
 public:
  explicit Stopwatch(double* total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() { *total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double* total_;
  std::chrono::steady_clock::time_point start_;
};

// A separate tensor (not an autograd view) over [offset, offset + len) of
// `base`'s elements, sharing its storage: optimizer leaves over parts of a
// shard, and their gradients over parts of the shard's gradient.
at::Tensor AliasRange(const at::Tensor& base, int64_t offset, int64_t len, bool requires_grad = false);

inline bool IsFloating(const at::Tensor& t) { return at::isFloatingType(t.scalar_type()); }

}  // namespace internal
}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_INTERNAL_SHARDED_UNIT_H_
