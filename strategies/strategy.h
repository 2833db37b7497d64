// Strategy: how a model is distributed over the ranks of a job.
//
// A Strategy owns the wrapped model and everything that depends on how it is
// distributed: the forward through the wrapper, the parameters the optimizer
// steps, backward with gradient synchronization (or without it, for gradient
// accumulation), gradient clipping that is correct under sharding, metric
// reductions, and state-dict save/load. The Trainer (trainer/) drives it:
//
//   strategy->Setup(world, cluster);          // communicator may be null for W=1
//   strategy->SetDevice(device);              // where the model is (the Trainer: its accelerator)
//   strategy->SetPrecision("32-true");
//   strategy->WrapModel(model);
//   Optimizer opt(strategy->parameters(), ...);
//   at::Tensor loss = loss_fn(strategy->Forward([&] { return net->forward(x); }));
//   strategy->Backward(loss, /*sync_gradients=*/true);
//   strategy->ClipGradients(1.0, GradClipAlgorithm::kNorm);
//   opt.step();
//
// Strategies are created by name through StrategyRegistry
// (strategies/registry.h) or constructed directly with their typed options.
// Every strategy runs on CPU (Gloo); CUDA placement is left to the model (the
// Trainer moves it to SetDevice's device before WrapModel).
#ifndef SHARDTRAIN_STRATEGIES_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_STRATEGY_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "launch/cluster_environment.h"
#include "sharding/sharded_state.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::strategies {

enum class GradClipAlgorithm { kNorm, kValue };
// "norm" or "value"; throws InvalidArgumentError otherwise.
GradClipAlgorithm ParseGradClipAlgorithm(const std::string& name);

// The Trainer's precisions, parsed once (TrainerOptions::precision keeps
// Lightning's names: "32-true", "bf16-mixed", "16-mixed", "bf16-true").
enum class Precision { k32True, kBf16Mixed, k16Mixed, kBf16True };
// Throws InvalidArgumentError listing the valid names for anything else.
Precision ParsePrecision(const std::string& name);
const char* PrecisionName(Precision precision);
// Every name, in the enum's order (flag choices, messages).
const std::vector<std::string>& PrecisionNames();
// ParsePrecision, for its check only.
void CheckPrecision(const std::string& precision);

class Strategy {
 public:
  virtual ~Strategy();

  // Registered short name ("fsdp_native", "ddp", ...).
  virtual std::string name() const = 0;

  // Joins the job: `world` is the process group of all ranks (nullptr or a
  // group of size 1 for a single process). Must be called before WrapModel.
  virtual void Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster);

  // Trainer precision ("32-true", "bf16-mixed", "16-mixed", "bf16-true"),
  // applied by WrapModel. Strategies with their own mixed-precision option
  // let an explicitly set option win.
  virtual void SetPrecision(const std::string& precision);
  std::string precision() const { return PrecisionName(precision_); }
  Precision precision_kind() const { return precision_; }

  // The device the model computes on: cuda:<local rank> when the Trainer's
  // accelerator is CUDA, else CPU (the default). Options that only mean
  // something with an accelerator (CPU offload of sharded strategies) read it
  // when WrapModel runs, so call it before WrapModel.
  void SetDevice(const c10::Device& device);
  const c10::Device& device() const { return device_; }

  // Held around the model's construction (the Trainer holds it around
  // configure_model) so that building the model follows the strategy's memory
  // plan; destroying it ends that.
  class ConstructionScope {
   public:
    virtual ~ConstructionScope() = default;
  };
  // The strategy's construction scope, or nullptr when it has none or it is
  // off (the default: replicated strategies hold the whole model anyway).
  // Call after Setup and SetDevice, on the thread that constructs the model.
  virtual std::unique_ptr<ConstructionScope> MakeConstructionScope() { return nullptr; }
  // Whether MakeConstructionScope builds the model shard by shard (sharded
  // strategies: ShardedStrategyBase). This default, for strategies that hold
  // the whole model on every rank, refuses true with what is valid.
  virtual void set_sharded_construction(bool on);
  virtual bool sharded_construction() const { return false; }

  // Takes the model (built by the user, e.g. in configure_model) and wraps it.
  virtual void WrapModel(std::shared_ptr<torch::nn::Module> module) = 0;
  bool wrapped() const { return module_ != nullptr; }
  // The user's (unwrapped) module.
  torch::nn::Module& module();
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return module_; }

  // Runs the model's forward through the wrapper (gathers sharded parameters,
  // autocast for mixed precision, ...).
  virtual at::Tensor Forward(const std::function<at::Tensor()>& fn) = 0;

  // dtype the model computes in; the trainer casts floating inputs to it.
  virtual c10::ScalarType compute_dtype() const { return c10::ScalarType::Float; }

  // What the optimizer steps (shards for sharded strategies).
  virtual std::vector<at::Tensor> parameters() const = 0;
  virtual std::vector<std::pair<std::string, at::Tensor>> named_parameters() const = 0;

  // loss.backward() plus gradient synchronization. With sync_gradients false
  // gradients accumulate locally and are synchronized by the next backward
  // that syncs (gradient accumulation without communication).
  virtual void Backward(const at::Tensor& loss, bool sync_gradients = true) = 0;

  // Clips the gradients of parameters(): by global norm (returns the norm
  // before clipping, equal to the unsharded model's) or elementwise by value
  // (returns the value). Call after a syncing Backward.
  virtual double ClipGradNorm(double max_norm, double norm_type = 2.0) = 0;
  // ClipGradNorm without reading the norm on the host: it is returned as a
  // 0-dim float64 tensor on the device that computed it, and on a GPU nothing
  // waits for the device (sharding/grad_clip.h). The Trainer clips this way.
  // The default calls ClipGradNorm.
  virtual at::Tensor ClipGradNormOnDevice(double max_norm, double norm_type = 2.0);
  virtual void ClipGradValue(double clip_value);
  double ClipGradients(double value, GradClipAlgorithm algorithm);

  // Metric helpers over the world group (identity for one process). With an
  // NCCL world the value (and a CPU tensor given to Broadcast) goes through
  // the current CUDA device.
  double ReduceMean(double value);
  double ReduceSum(double value);
  double ReduceMax(double value);
  void Barrier();
  // In place, from `root`.
  void Broadcast(const at::Tensor& tensor, int root = 0);

  int rank() const;
  int world_size() const;
  bool is_global_zero() const { return rank() == 0; }
  // Whether Setup has run.
  bool set_up() const { return set_up_; }
  // The ranks that read distinct batches, and this rank's index among them:
  // the world for data-parallel strategies; model_parallel's data-parallel
  // dimension (the ranks of a tensor-parallel group read the same batches).
  // The Trainer's samplers use them.
  virtual int data_parallel_rank() const { return rank(); }
  virtual int data_parallel_size() const { return world_size(); }
  const comm::CommunicatorPtr& world() const { return world_; }
  const ClusterInfo& cluster() const { return cluster_; }

  // Full state dict (unwrapped parameter and buffer names, float32, CPU).
  // Collective for sharded strategies: every rank calls; rank 0 gets the map,
  // other ranks may get an empty one.
  virtual std::map<std::string, at::Tensor> FullStateDict() = 0;
  // Every rank passes the same full state dict. Names and shapes are checked
  // first; on mismatch nothing changes and InvalidArgumentError lists the problems.
  virtual void LoadFullStateDict(const std::map<std::string, at::Tensor>& state) = 0;

  // Whether checkpoints should be sharded (one piece per rank) by default.
  virtual bool prefers_sharded_checkpoint() const { return false; }

  // --- Model summary ----------------------------------------------------------
  // One row of the Trainer's model summary (trainer/callbacks/model_summary.h).
  struct UnitSummary {
    std::string name;            // module path of the unit ("": the root)
    int64_t parameters = 0;      // parameter elements of the whole unit (a tied weight once)
    int64_t trainable = 0;       // of those, elements of parameters that require grad
    int64_t shard_elements = 0;  // elements this rank stores for the unit (padding included)
    int64_t shard_bytes = 0;     // bytes of those
  };
  // The wrapped model's units (no communication). Sharded strategies: one row
  // per sharded unit (the root last) with this rank's shard. This default,
  // for replicated strategies: one row per direct child module of the model
  // (a tied weight under its first name) and "" for parameters of the model
  // itself; every rank stores everything.
  virtual std::vector<UnitSummary> UnitSummaries() const;
  // Every parameter's shape as checkpoints hold it, by name: the module's
  // (this default), or for a tensor-parallel model the global shapes.
  virtual std::map<std::string, std::vector<int64_t>> ParameterShapes() const;

  // --- Checkpoint state -----------------------------------------------------
  // What the model's and optimizer's state are, for the Trainer's checkpoint
  // files (trainer/connectors/checkpoint_state.cc reads and writes the files; how state
  // is sharded, gathered and resharded stays in the strategy and, for sharded
  // strategies, in sharding/optimizer_state.h). `params` are the tensors an
  // optimizer steps (a subset of parameters()) and `states` their state, in
  // the same order (sharding/sharded_state.h).

  // Receives the full state one tensor at a time.
  struct FullStateSink {
    // Stores a tensor (valid only during the call); returns what the state
    // dict holds for it.
    std::function<at::Tensor(const at::Tensor&)> add;
    // Names a stored tensor. A tensor with several names (a tied weight) is
    // stored once and named once per name.
    std::function<void(const std::string& name, const at::Tensor& stored)> name;
  };
  // The full (unsharded) parameters and buffers by their unwrapped names,
  // float32 for floating tensors, into `sink` on world rank `root`. Sharded
  // strategies gather one unit at a time (a rank holds one unit beyond its
  // shards); collective for them: every rank calls.
  virtual void ForEachFullStateTensor(int root, const FullStateSink& sink);
  // The full optimizer state: fn(parameter name, state key, tensor valid
  // during the call) on `root`, and the steps by parameter name into `steps`
  // there. Collective for sharded strategies.
  using FullOptimizerStateFn =
      std::function<void(const std::string& name, const std::string& key, const at::Tensor& full)>;
  virtual void ForEachFullOptimizerState(const std::vector<at::Tensor>& params, const sharding::OptimizerStates& states,
                                         int root, const FullOptimizerStateFn& fn,
                                         std::map<std::string, int64_t>* steps);
  // The module parameter names each of `params` holds values of: a replicated
  // strategy's parameter its own name; a sharded unit's flat shard its
  // unit's trainable parameters; with use_orig_params its parameter's. No
  // communication (a rank's tensors may leave out parameters of no elements).
  virtual std::vector<std::vector<std::string>> OptimizedParameterNames(const std::vector<at::Tensor>& params) const;
  // This rank's state of `params` from the full state by parameter name
  // (every rank passes the same; the caller checked names and sizes).
  virtual sharding::OptimizerStates OptimizerStatesFromFull(
      const std::vector<at::Tensor>& params, const std::map<std::string, std::map<std::string, at::Tensor>>& state,
      const std::map<std::string, int64_t>& step);

  // Sharded checkpoints (one piece per rank, loadable at any world size): only
  // where has_sharded_state() (a sharded strategy after WrapModel); elsewhere
  // the methods below throw InvalidArgumentError.
  virtual bool has_sharded_state() const { return false; }
  // This rank's piece of the model state (no copies, no communication).
  virtual sharding::ShardedStateDict ShardedState() const;
  // Each unit's optimizer step, and one unit's optimizer state laid out like
  // its shard (sharding/optimizer_state.h), for writing a unit at a time.
  virtual std::vector<int64_t> ShardedOptimizerSteps(const std::vector<at::Tensor>& params,
                                                     const sharding::OptimizerStates& states) const;
  virtual std::map<std::string, at::Tensor> ShardedOptimizerUnit(const std::vector<at::Tensor>& params,
                                                                 const sharding::OptimizerStates& states,
                                                                 int unit) const;
  // Loading pieces saved at any world size: what does not fit the model, one
  // line per problem (empty: they fit); the parameters and buffers; this
  // rank's state of `params` (`optimizer[i]` is pieces[i]'s).
  virtual std::vector<std::string> CheckShardedState(const std::vector<sharding::ShardedStateDict>& pieces) const;
  virtual void LoadShardedState(const std::vector<sharding::ShardedStateDict>& pieces);
  virtual sharding::OptimizerStates OptimizerStatesFromShards(
      const std::vector<at::Tensor>& params, const std::vector<sharding::ShardedStateDict>& pieces,
      const std::vector<sharding::ShardedOptimizerState>& optimizer) const;
  // Loading storage laid out per parameter (PyTorch DCP): `fill(u, shard)`
  // writes this rank's shard of each unit of ShardedState() (zeroed first),
  // then the buffers by name; this rank's state of `params` from each unit's
  // state laid out like its shard (sharding/optimizer_state.h).
  virtual void LoadShardsWith(const std::function<void(size_t unit, at::Tensor& shard)>& fill,
                              const std::map<std::string, at::Tensor>& buffers);
  virtual sharding::OptimizerStates OptimizerStatesFromUnits(
      const std::vector<at::Tensor>& params,
      const std::function<sharding::UnitShardState(size_t unit)>& unit_state) const;

 protected:
  void CheckSetUp(const char* what) const;
  void CheckWrapped(const char* what) const;
  // For replicated strategies: runs fn under CPU autocast for "bf16-mixed" /
  // "16-mixed", plainly otherwise.
  at::Tensor ForwardWithPrecision(const std::function<at::Tensor()>& fn);
  // For replicated strategies: "bf16-true" casts the module's floating
  // parameters and buffers to bfloat16.
  void ApplyTruePrecision(torch::nn::Module& module);
  // Elementwise clamp of parameters()' gradients.
  void ClampGrads(double clip_value);
  // Throws InvalidArgumentError: `what` needs a sharded strategy.
  [[noreturn]] void NotSharded(const char* what) const;

  comm::CommunicatorPtr world_;
  ClusterInfo cluster_;
  Precision precision_ = Precision::k32True;
  c10::Device device_{c10::kCPU};
  bool set_up_ = false;
  std::shared_ptr<torch::nn::Module> module_;
};

using StrategyPtr = std::shared_ptr<Strategy>;

// Global-norm clipping of the gradients of already synchronized `params`;
// returns the norm as sharding::ClipGradNorm does (a 0-dim float64 tensor, on
// a GPU not read). Without `shard_group` the gradients are whole (ddp,
// single_device); with it they are this rank's disjoint pieces (use_orig_params
// views of a shard) and the local sum of squares (or max) is all-reduced over
// the group.
at::Tensor ClipLocalGradNorm(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                             const comm::CommunicatorPtr& shard_group = nullptr);
// The module's parameters with each tensor once, under its first name, as
// Python's Module.parameters() (LibTorch's lists a tensor registered in
// several modules, a tied weight, once per name: an optimizer over that list
// would step it twice).
std::vector<std::pair<std::string, at::Tensor>> UniqueNamedParameters(const torch::nn::Module& module);
std::vector<at::Tensor> UniqueParameters(const torch::nn::Module& module);
// Parameters and buffers by name, float32 for floating tensors, cloned to CPU.
std::map<std::string, at::Tensor> ModuleStateDict(torch::nn::Module& module);
// Checks names and shapes first (nothing changes on mismatch; the error lists
// every problem), then copies.
void LoadModuleStateDict(torch::nn::Module& module, const std::map<std::string, at::Tensor>& state);

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_STRATEGY_H_
