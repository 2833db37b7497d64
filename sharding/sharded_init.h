// ShardedInitScope: build a model without ever holding all of it (the idea of
// DeepSpeed's zero.Init, in C++).
//
// While a scope is alive on a thread, every Sharded<Impl> wrap point that
// thread constructs is sharded as soon as Impl's constructor has run: the
// parameters of its subtree that no nested wrap point took are laid out as
// ShardedModel lays out a unit (trainable first), this rank's block of the
// padded flat buffer is kept, and the full values are released; the module's
// parameters become views of a freed buffer, exactly as after a reshard. A
// rank therefore holds at most its shards plus one unit during construction.
//
//   {
//     ShardedInitScope scope(world->rank(), *world, options, policy);
//     model = std::make_shared<GptImpl>(config);   // seed every rank alike first
//   }
//   ShardedModel sharded(model, world, options, policy);  // adopts the shards
//
// ShardedModel adopts each prebuilt shard as the unit's FlatParameter when the
// unit it would build there has the same parameters in the same order (and
// the same shard group); otherwise (a weight tied across wrap points after
// construction, a parameter frozen after it, another wrap policy) it gathers
// that one unit back and builds it as usual, which is logged. Parameters
// outside every wrap point (the root unit) are built normally.
//
// Nothing is communicated during construction, so ranks may construct one at
// a time. Every rank must compute the same initial weights (same seed): with
// sync_module_states, ShardedModel broadcasts only the root unit's parameters
// and buffers, and checks that every rank built the same values for every
// prebuilt unit (a checksum per unit), failing with the wrap point's name if not.
//
// Until a ShardedModel adopts them, the module's wrapped parameters hold no
// values: do not read or initialise them in between (initialise inside the
// wrapped module's constructor instead).
#ifndef SHARDTRAIN_SHARDING_SHARDED_INIT_H_
#define SHARDTRAIN_SHARDING_SHARDED_INIT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <unordered_set>
#include <vector>

#include "comm/communicator.h"
#include "sharding/flat_parameter.h"
#include "sharding/options.h"
#include "sharding/sharded_model.h"
#include "sharding/wrap_point.h"

namespace shardtrain::sharding {

// A rank's place in the shard group ShardedModel uses for `options`.
struct ShardGroupPlace {
  int rank = 0;
  int size = 1;
};
// Same group as ShardedModel(world, options, ..., local_world_size): the world
// for FULL_SHARD / SHARD_GRAD_OP, the rank alone for NO_SHARD, consecutive
// blocks of hybrid_shard_group_size (or local_world_size) ranks for HYBRID_SHARD.
ShardGroupPlace ShardGroupOf(int world_rank, int world_size, const ShardingOptions& options, int local_world_size = 0);

class ShardedInitScope {
 public:
  // Shards wrap points over a shard group of `place.size` ranks, keeping
  // block `place.rank`. `policy` decides, as in ShardedModel, which wrap
  // points become units (pass the one the ShardedModel will use).
  explicit ShardedInitScope(ShardGroupPlace place, WrapPolicy policy = WrapPolicy::Always());
  // The shard group ShardedModel(world, options, policy, ..., local_world_size) will use.
  ShardedInitScope(const comm::Communicator& world, const ShardingOptions& options,
                   WrapPolicy policy = WrapPolicy::Always(), int local_world_size = 0);
  // Ends the scope on this thread (a scope active before it becomes active again).
  ~ShardedInitScope();
  ShardedInitScope(const ShardedInitScope&) = delete;
  ShardedInitScope& operator=(const ShardedInitScope&) = delete;

  // Wrap points sharded so far, and the bytes of the shards kept.
  int units_built() const { return units_built_; }
  int64_t shard_bytes() const { return shard_bytes_; }

  // The scope active on the calling thread, or nullptr.
  static ShardedInitScope* Active();

  // Module::to(device) for a module built under a scope, without gathering:
  // each wrap point's construction-time shard moves to `device` (its
  // parameters stay valueless views, now of a freed buffer there), every
  // other parameter and buffer moves as Module::to moves it. So a model built
  // on the CPU shard by shard reaches a GPU holding this rank's shards plus
  // the parameters outside every wrap point, never the whole model; the
  // ShardedModel then adopts the shards there. For a module built without a
  // scope it is Module::to(device). Call it before wrapping.
  static void MoveToDevice(torch::nn::Module& module, c10::Device device);

 private:
  friend void internal::OnWrapPointConstructed(WrapPoint& point, torch::nn::Module& module);
  void Take(WrapPoint& point, torch::nn::Module& module);

  ShardGroupPlace place_;
  WrapPolicy policy_;
  ShardedInitScope* previous_;
  std::unordered_set<const c10::TensorImpl*> taken_;
  int units_built_ = 0;
  int64_t shard_bytes_ = 0;
};

namespace internal {
// What a ShardedInitScope leaves on a wrap point for ShardedModel to adopt.
struct PrebuiltUnit {
  std::vector<FlatParamEntry> entries;  // names relative to the wrap point; trainable first
  at::Tensor shard;                     // float32 [padded / size], this rank's block
  ShardGroupPlace place;
  int64_t numel = 0;
  int64_t padded_numel = 0;
  // Sum of each parameter's float32 sum over the full values: equal on every
  // rank that computed the same weights.
  double checksum = 0;
};
}  // namespace internal

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_SHARDED_INIT_H_
