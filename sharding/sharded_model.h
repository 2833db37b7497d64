// ShardedModel: Fully Sharded Data Parallel training of a LibTorch module.
//
// Construction walks the module tree. Every Sharded<...> wrap point that the
// wrap policy accepts becomes a unit; parameters not in a unit join the root
// unit (which always exists, so a model without wrap points trains too). Each
// unit's parameters become a FlatParameter sharded over the shard group.
//
// A training step is
//   auto out = model.Forward([&] { return net->forward(x); });
//   loss(out).backward();           // gradients are reduce-scattered during backward
//   optimizer.step();               // over model.parameters(): the shards
// and equals unsharded data-parallel training on the same global batch.
//
// Strategies: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD all run on
// the same mechanism, expressed as a shard group (gathers, reduce-scatters) and
// an optional replicate group (all-reduces gradients across shard groups).
#ifndef SHARDTRAIN_SHARDING_SHARDED_MODEL_H_
#define SHARDTRAIN_SHARDING_SHARDED_MODEL_H_

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "sharding/options.h"
#include "sharding/shard_layout.h"
#include "sharding/sharded_state.h"
#include "sharding/wrap_point.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::sharding {

class FlatParameter;
namespace internal {
class GatherOrder;  // sharding/internal/device_streams.h
class GradOffload;
}  // namespace internal

// Decides which wrap points become units. `numel` counts the wrap point's
// parameters that no nested unit took.
struct WrapPolicy {
  std::function<bool(const WrapPoint& point, int64_t numel)> should_wrap;

  static WrapPolicy Always();                       // every wrap point is a unit
  static WrapPolicy Never();                        // only the root unit
  static WrapPolicy SizeBased(int64_t min_num_params);  // fairscale/PyTorch size_based_auto_wrap_policy
  // transformer_auto_wrap_policy: wrap points whose module type name is one of `type_names`.
  static WrapPolicy ByType(std::vector<std::string> type_names);
};

class ShardedModel {
 public:
  // `module` must not be sharded already. `world` is the process group;
  // `local_world_size` (ranks per node) sizes HYBRID_SHARD's shard group when
  // options.hybrid_shard_group_size is 0. `checkpoint` selects wrap points whose
  // activations are recomputed in backward.
  ShardedModel(std::shared_ptr<torch::nn::Module> module, comm::CommunicatorPtr world, ShardingOptions options,
               WrapPolicy policy = WrapPolicy::Always(),
               std::function<bool(const WrapPoint&)> checkpoint = nullptr, int local_world_size = 0);
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  torch::nn::Module& module() { return *module_; }
  const torch::nn::Module& module() const { return *module_; }
  const ShardingOptions& options() const { return options_; }
  // dtype the model computes in (mixed_precision.param_dtype or float32).
  c10::ScalarType compute_dtype() const { return param_dtype_; }

  // Runs the model's forward (`fn`) as the root unit.
  template <typename F>
  auto Forward(F&& fn) {
    BeginForward();
    auto out = fn();
    std::vector<at::Tensor> tensors;
    internal::CollectTensors(out, tensors);
    EndForward(tensors);
    return out;
  }

  // What the optimizer steps: one float32 leaf per unit (this rank's shard,
  // or of a unit that also holds frozen parameters only the shard's trainable
  // part, possibly empty), or with use_orig_params each trainable original
  // parameter's part of this rank's shard. Frozen elements are never in it.
  std::vector<at::Tensor> parameters() const;
  // Same, named: "<unit>.flat_param" or, with use_orig_params, original names
  // (parameters with no elements on this rank are left out).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  // Gradient accumulation without communication: inside the scope, backward
  // keeps full gradients locally; the first backward after it reduces them.
  class NoSyncScope {
   public:
    explicit NoSyncScope(ShardedModel* m);
    ~NoSyncScope();

   private:
    ShardedModel* m_;
    bool prev_;
  };
  NoSyncScope no_sync() { return NoSyncScope(this); }

  // Clips gradients so their global norm is at most max_norm; returns the
  // norm before clipping (equal to the unsharded model's). norm_type 2 or inf.
  double ClipGradNorm(double max_norm, double norm_type = 2.0);
  // The same, the norm returned as a 0-dim float64 tensor that is not read on
  // the host: on a GPU nothing waits for the device (sharding/grad_clip.h).
  at::Tensor ClipGradNormOnDevice(double max_norm, double norm_type = 2.0);

  // While alive, every parameter holds its full value (float32 when no
  // mixed precision). With writeback, changes to parameters are copied back
  // into the shards at the end (not allowed with a low param_dtype).
  class FullParamsScope {
   public:
    FullParamsScope(ShardedModel* m, bool writeback);
    ~FullParamsScope() noexcept(false);

   private:
    ShardedModel* m_;
    bool writeback_;
  };
  FullParamsScope SummonFullParams(bool writeback = false) { return FullParamsScope(this, writeback); }

  // Full state dict (parameters and buffers by their unwrapped names, float32
  // parameters). Collective: every rank must call. With rank0_only other
  // ranks get an empty map.
  std::map<std::string, at::Tensor> FullStateDict(bool rank0_only = true, bool to_cpu = true);
  // Loads a full state dict (every rank passes the same one). Names, shapes
  // and dtypes are checked first; on mismatch nothing changes and the error
  // lists every problem.
  void LoadFullStateDict(const std::map<std::string, at::Tensor>& state);

  ShardedStateDict GetShardedStateDict() const;
  // Loads from the pieces of all ranks of the run that saved them, at any
  // world size (each rank passes all pieces). Each rank copies into its
  // shards only the ranges it owns, from the source shards that overlap them
  // (sharding/shard_layout.h): no full parameter is built, and pieces mapped
  // from files are read only where they overlap. Parameters are matched by
  // unit and order, else by name; names, sizes and buffer shapes are checked
  // first and on mismatch nothing changes and the error lists every problem.
  void LoadShardedStateDict(const std::vector<ShardedStateDict>& pieces);
  // Loads from storage laid out per parameter (PyTorch DCP): `fill(u, shard)`
  // writes this rank's shard of unit u (units()[u]: float32, shard_numel
  // elements, zeroed first, so the padding stays zero), one unit at a time;
  // then every buffer of the module from `buffers` (by name, same shape;
  // InvalidArgumentError naming the first missing one before anything changes).
  void LoadShardsWith(const std::function<void(size_t unit, at::Tensor& shard)>& fill,
                      const std::map<std::string, at::Tensor>& buffers);
  // What LoadShardedStateDict would refuse, one line per problem (empty: the
  // pieces fit). No communication; nothing changes.
  std::vector<std::string> CheckShardedStateDict(const std::vector<ShardedStateDict>& pieces) const;
  // The copies that fill this rank's shards from `pieces` (by_rank: the
  // piece of each saved shard rank, PieceOfShardRank), one list per unit;
  // what does not fit (parameters, buffers) is added to `problems`.
  std::vector<std::vector<ShardCopy>> PlanShardedLoad(const std::vector<ShardedStateDict>& pieces,
                                                      const std::vector<size_t>& by_rank,
                                                      std::vector<std::string>* problems) const;

  // For optimizer-state consolidation: turns per-unit tensors shaped like this
  // rank's shards (e.g. Adam's exp_avg) into full tensors by parameter name
  // (collective), and back.
  std::map<std::string, at::Tensor> GatherFullFromShards(const std::vector<at::Tensor>& per_unit_shards);
  std::vector<at::Tensor> ShardsFromFull(const std::map<std::string, at::Tensor>& full) const;
  // Streaming form of GatherFullFromShards, for saving without holding the
  // full model: for each unit in turn, gathers the shard-shaped tensor
  // `shard_of_unit(u)` gives (or, with a null `shard_of_unit`, the unit's
  // parameter shard) into the unit's full flat tensor and, on world
  // rank `root` only, calls `fn` with each parameter's full tensor (float32,
  // a view of that flat tensor, valid during the call) by name, a tied
  // weight once under each of its names (the same tensor). The unit is
  // dropped before the next is gathered: a rank holds one unit beyond its
  // shards (gathered with an all-gather, so every rank briefly holds it).
  // Collective: every rank calls.
  void ForEachFullUnit(const std::function<at::Tensor(int unit)>& shard_of_unit, int root,
                       const std::function<void(const std::string& name, const at::Tensor& full)>& fn);

  std::vector<UnitInfo> units() const;
  int num_units() const;

  // Wall time the calling thread spent inside the sharding core's collectives
  // since the last ResetCommTimes(): issuing them (a call returns once the
  // collective is queued) and blocked waiting for them. Time spent waiting is
  // communication that did not overlap computation. replicate_*: HYBRID_SHARD's
  // (and NO_SHARD's) all-reduce of each unit's reduced shard across replicas.
  struct CommTimes {
    double gather_issue_s = 0, gather_wait_s = 0;
    double reduce_issue_s = 0, reduce_wait_s = 0;
    double replicate_issue_s = 0, replicate_wait_s = 0;
    double wait_s() const { return gather_wait_s + reduce_wait_s + replicate_wait_s; }
  };
  const CommTimes& comm_times() const { return comm_times_; }
  void ResetCommTimes() { comm_times_ = {}; }
  const comm::CommunicatorPtr& world() const { return world_; }
  const comm::CommunicatorPtr& shard_group() const { return shard_group_; }
  const comm::CommunicatorPtr& replicate_group() const { return replicate_group_; }
  // Units currently holding full parameters (gathered or being gathered).
  int NumUnshardedUnits() const;
  // Units currently holding a full-size (unsharded) gradient: being
  // accumulated in backward, or waiting for its reduce-scatter to complete.
  int NumFullGradients() const;
  std::vector<std::string> UnshardedUnitNames() const;

  // Called by wrap points; not for users.
  void UnitPreForward(ShardedUnit* unit);
  void UnitPostForward(ShardedUnit* unit, const std::vector<at::Tensor>& outputs);
  bool UnitCheckpointing(const ShardedUnit* unit) const;

 private:
  friend class ShardedUnit;
  void BeginForward();
  void EndForward(const std::vector<at::Tensor>& outputs);
  void BuildUnits(const WrapPolicy& policy, const std::function<bool(const WrapPoint&)>& checkpoint);
  void InitUnitRuntime(ShardedUnit* u, int index);
  void BuildOrigParamViews();
  void SyncModuleStates();
  void Unshard(ShardedUnit* u);
  void WaitUnshard(ShardedUnit* u);
  void Reshard(ShardedUnit* u);
  void Prefetch(ShardedUnit* u, bool backward);
  void PreBackward(ShardedUnit* u);
  void ArmGrads(ShardedUnit* u);
  void OnGradReady(ShardedUnit* u, size_t entry);
  void LaunchReadyInOrder();
  void LaunchReduce(ShardedUnit* u);
  void LaunchReducePieces(ShardedUnit* u);
  // Issues the unit's reduce-scatter with the core's reduce options, timed, and keeps at most
  // kMaxReducesInFlight in flight.
  void IssueReduce(ShardedUnit* u, const std::function<comm::WorkPtr(const comm::ReduceOptions&)>& reduce_scatter);
  void MoveGradsToFlat(ShardedUnit* u);
  void FinishReduces(size_t keep);
  void PollReduces();
  void IssueReplicatesDue(size_t due);
  void FinishBackward();
  void EnsureBackwardCallback();
  void ResetIteration();
  void RealiasOrigParamGrads();
  bool ReshardsAfterForward() const;

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // hooks check it
  comm::CommunicatorPtr world_;
  comm::CommunicatorPtr shard_group_;
  comm::CommunicatorPtr replicate_group_;
  ShardingOptions options_;
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;
  double pre_divide_ = 1.0;
  double post_divide_ = 1.0;

  std::vector<std::unique_ptr<ShardedUnit>> units_;  // root is units_.back()
  ShardedUnit* root_ = nullptr;
  std::vector<ShardedUnit*> forward_order_;
  std::vector<ShardedUnit*> reduce_order_;
  bool order_recorded_ = false;
  bool callback_queued_ = false;
  bool no_sync_ = false;
  size_t next_launch_ = 0;
  // Reduce-scatters launched and not yet completed, oldest first; at most
  // kMaxReducesInFlight stay in flight while backward runs.
  static constexpr size_t kMaxReducesInFlight = 2;
  std::deque<ShardedUnit*> reducing_;
  // Units whose reduce-scatter completed, in launch order, and how many of
  // them have their replicate all-reduce issued (ReplicateDue).
  std::vector<ShardedUnit*> reduced_;
  size_t replicated_ = 0;
  CommTimes comm_times_;
  // What the iteration's gathers wait for on a CUDA device (nothing on the CPU).
  std::unique_ptr<internal::GatherOrder> gather_order_;
  // Offloaded gradients' copies to the host on a CUDA device (unused on the CPU).
  std::unique_ptr<internal::GradOffload> grad_offload_;
  std::vector<std::pair<std::string, at::Tensor>> orig_param_views_;  // use_orig_params
  std::vector<std::pair<int, std::pair<int64_t, int64_t>>> orig_view_ranges_;  // unit, [begin,len) in shard
};

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_SHARDED_MODEL_H_
