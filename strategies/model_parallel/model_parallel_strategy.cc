#include "strategies/model_parallel/model_parallel_strategy.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/grad_clip.h"
#include "sharding/optimizer_state.h"

namespace shardtrain::strategies {
namespace {

using O = ModelParallelOptions;
using tensor_parallel::Placement;

// Holds the tensor-parallel scope and, inside it, the sharding core's
// construction scope over the data-parallel group (members end in reverse
// order: the inner scope first).
class MeshConstructionScope : public Strategy::ConstructionScope {
 public:
  MeshConstructionScope(comm::CommunicatorPtr tp, bool sequence_parallel,
                        std::unique_ptr<Strategy::ConstructionScope> inner)
      : tp_(std::move(tp), sequence_parallel), inner_(std::move(inner)) {}

 private:
  tensor_parallel::TensorParallelScope tp_;
  std::unique_ptr<Strategy::ConstructionScope> inner_;
};

}  // namespace

const OptionTable<ModelParallelOptions>& ModelParallelOptions::Table() {
  static const OptionTable<O> table({
      OptionInt("data_parallel_size", &O::data_parallel_size,
                "ranks FSDP shards over (default 0: the world size / tensor_parallel_size)"),
      OptionInt("tensor_parallel_size", &O::tensor_parallel_size,
                "ranks that split each layer, consecutive ranks (default 0: the world size / data_parallel_size; with "
                "both 0, the ranks of one host); data_parallel_size x tensor_parallel_size = world size"),
      OptionBool("sequence_parallel", &O::sequence_parallel,
                 "keep the activations between tensor-parallel layers (norms, dropout, residuals) split along the "
                 "sequence over the tensor-parallel group (default false)"),
      OptionTypeList("activation_checkpointing", &O::activation_checkpointing,
                     "units of the listed module types recompute forward in backward (default none)"),
      OptionShardedConstruction(&O::sharded_construction),
      OptionBool("save_distributed_checkpoint", &O::save_distributed_checkpoint,
                 "checkpoints as PyTorch DCP directories, one file per rank, every tensor at its global shape "
                 "(Lightning's ModelParallelStrategy option; default false: one full file)"),
  });
  return table;
}

ModelParallelOptions ModelParallelOptions::FromStrings(const StrategyOptions& options) {
  return Table().Parse(options, "model_parallel");
}

ModelParallelStrategy::ModelParallelStrategy(ModelParallelOptions options) : options_(std::move(options)) {
  ST_CHECK_ARG(options_.data_parallel_size >= 0 && options_.tensor_parallel_size >= 0,
               "strategy 'model_parallel': data_parallel_size and tensor_parallel_size must be >= 0 (0: derived), "
               "got ",
               options_.data_parallel_size, " and ", options_.tensor_parallel_size);
  if (!options_.activation_checkpointing.empty()) {
    checkpoint_ = [by_type = sharding::WrapPolicy::ByType(options_.activation_checkpointing)](
                      const sharding::WrapPoint& wp) { return by_type.should_wrap(wp, 0); };
  }
  sharded_construction_ = options_.sharded_construction;
  // The optimizer steps per-parameter views of the shards, so that the
  // strategy can tell sharded, replicated and partial gradients apart.
  sharding_options_.use_orig_params = true;
}

void ModelParallelStrategy::Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) {
  Strategy::Setup(std::move(world), cluster);
  int tp = options_.tensor_parallel_size;
  if (tp == 0 && options_.data_parallel_size == 0 && cluster_.local_world_size > 0 &&
      cluster_.local_world_size < world_size()) {
    tp = cluster_.local_world_size;
  }
  mesh_ = tensor_parallel::MakeDeviceMesh(world_, options_.data_parallel_size, tp);
  if (rank() == 0) ST_LOG(INFO) << "model_parallel: device mesh " << mesh_.ToString();
}

void ModelParallelStrategy::PrepareOptions(sharding::ShardingOptions& s) const {
  s.mixed_precision = PrecisionToMixed(precision_);
  s.use_orig_params = true;
}

std::unique_ptr<Strategy::ConstructionScope> ModelParallelStrategy::MakeConstructionScope() {
  CheckSetUp("MakeConstructionScope");
  return std::make_unique<MeshConstructionScope>(mesh_.tp, options_.sequence_parallel,
                                                 ShardedStrategyBase::MakeConstructionScope());
}

void ModelParallelStrategy::WrapModel(std::shared_ptr<torch::nn::Module> module) {
  CheckSetUp("WrapModel");
  ST_CHECK_ARG(module != nullptr, name(), ": WrapModel needs a module");
  placements_ = tensor_parallel::CollectPlacements(*module);
  CheckPlacements();
  ShardedStrategyBase::WrapModel(std::move(module));
}

void ModelParallelStrategy::CheckPlacements() const {
  if (mesh_.tp_size == 1) return;
  bool any_sharded = false, any_partial = false;
  for (const auto& [fqn, p] : placements_) {
    any_sharded |= p.sharded;
    any_partial |= p.partial_grad;
  }
  ST_CHECK_ARG(any_sharded, "model_parallel: the model has no tensor-parallel parameters, so its ", mesh_.tp_size,
               " tensor-parallel ranks would each hold and compute all of it; build it with tensor_parallel/layers.h "
               "while the strategy's MakeConstructionScope() is held (the Trainer does around configure_model)");
  // Partial gradients are summed over the tensor-parallel group piece by
  // piece of the data-parallel shards: the ranks of the group must lay their
  // shards out alike, that is hold pieces of equal shapes.
  for (const auto& [fqn, p] : placements_) {
    if (!any_partial || !p.sharded) continue;
    const int64_t rows = p.global_shape[p.dim] / p.chunks;
    ST_CHECK_ARG(rows % mesh_.tp_size == 0, "model_parallel with sequence_parallel: ", fqn, " (", p.ToString(),
                 ") has ", rows, " rows", p.chunks > 1 ? " per chunk" : "",
                 ", which do not divide by tensor_parallel_size ", mesh_.tp_size,
                 "; pad that dimension to a multiple of it (a vocabulary: add unused ids) or turn sequence_parallel "
                 "off");
  }
}

void ModelParallelStrategy::Backward(const at::Tensor& loss, bool sync_gradients) {
  ShardedStrategyBase::Backward(loss, sync_gradients);
  if (sync_gradients) ReducePartialGradients();
}

void ModelParallelStrategy::ReducePartialGradients() {
  if (mesh_.tp_size == 1) return;
  for (const auto& [name, view] : sm_->named_parameters()) {
    const auto it = placements_.find(name);
    if (it == placements_.end() || !it->second.partial_grad || !view.grad().defined()) continue;
    mesh_.tp->AllReduce(view.grad())->Wait();
  }
}

at::Tensor ModelParallelStrategy::ClipGradNormOnDevice(double max_norm, double norm_type) {
  CheckWrapped("ClipGradNorm");
  // The pieces each rank counts are disjoint over the world: sharded ones
  // everywhere, a replicated gradient (the same on every rank of its
  // tensor-parallel group) on the group's rank 0 only. The other ranks' copies
  // are scaled by the same coefficient (sharding::ClipGradNorm's rule).
  std::vector<at::Tensor> counted, copies;
  for (const auto& [name, view] : sm_->named_parameters()) {
    if (!view.grad().defined()) continue;
    const auto it = placements_.find(name);
    const bool sharded = it != placements_.end() && it->second.sharded;
    (sharded || mesh_.tp_rank == 0 ? counted : copies).push_back(view.grad());
  }
  const at::Tensor norm = sharding::ClipGradNorm(counted, max_norm, norm_type, world_);
  if (!copies.empty()) {
    const at::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    for (auto& g : copies) g.mul_(coef.to(g.device()));
  }
  return norm;
}

std::map<std::string, at::Tensor> ModelParallelStrategy::FullStateDict() {
  CheckWrapped("FullStateDict");
  // On data-parallel rank 0 (all of the first tensor-parallel group): every
  // rank's pieces, gathered over the tensor-parallel group in name order.
  std::map<std::string, at::Tensor> local = sm_->FullStateDict(/*rank0_only=*/true, /*to_cpu=*/true);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : local) {
    const auto it = placements_.find(name);
    out[name] = it == placements_.end() ? t : tensor_parallel::GatherGlobal(t, it->second, mesh_.tp);
  }
  if (rank() != 0) out.clear();
  return out;
}

void ModelParallelStrategy::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  CheckWrapped("LoadFullStateDict");
  std::map<std::string, at::Tensor> local;
  for (const auto& [name, t] : state) {
    const auto it = placements_.find(name);
    local[name] =
        it == placements_.end() ? t : tensor_parallel::LocalPiece(t, it->second, mesh_.tp_rank, mesh_.tp_size);
  }
  sm_->LoadFullStateDict(local);
}

void ModelParallelStrategy::ForEachFullStateTensor(int root, const FullStateSink& sink) {
  CheckWrapped("ForEachFullStateTensor");
  ST_CHECK_ARG(root == 0, "model_parallel: full state is gathered to rank 0, not ", root);
  at::NoGradGuard no_grad;
  at::Tensor last_full, last_stored;
  sm_->ForEachFullUnit(nullptr, /*root=*/0, [&](const std::string& name, const at::Tensor& full) {
    if (!last_full.defined() || !last_full.is_same(full)) {
      last_full = full;
      const auto it = placements_.find(name);
      at::Tensor global = it == placements_.end() ? full : tensor_parallel::GatherGlobal(full, it->second, mesh_.tp);
      if (rank() == 0) last_stored = sink.add(global);
    }
    if (rank() == 0) sink.name(name, last_stored);
  });
  last_full = last_stored = at::Tensor();
  if (rank() != 0) return;
  for (const auto& item : module_->named_buffers(true)) {
    at::Tensor b = item.value().detach();
    if (at::isFloatingType(b.scalar_type())) b = b.to(at::kFloat);
    sink.name(item.key(), sink.add(b));
  }
}

const Placement* ModelParallelStrategy::ShardedPlacement(const std::string& name, const at::Tensor& t) const {
  const auto it = placements_.find(name);
  // A state shaped like its parameter (exp_avg), not a scalar one.
  if (it == placements_.end() || !it->second.sharded ||
      t.dim() != static_cast<int64_t>(it->second.global_shape.size())) {
    return nullptr;
  }
  return &it->second;
}

void ModelParallelStrategy::ForEachFullOptimizerState(const std::vector<at::Tensor>& params,
                                                      const sharding::OptimizerStates& states, int root,
                                                      const FullOptimizerStateFn& fn,
                                                      std::map<std::string, int64_t>* steps) {
  CheckWrapped("ForEachFullOptimizerState");
  ST_CHECK_ARG(root == 0, "model_parallel: full state is gathered to rank 0, not ", root);
  // On data-parallel rank 0 (the first tensor-parallel group, every rank in
  // the same order): each state tensor gathered to its global shape.
  sharding::ForEachFullOptimizerState(
      *sm_, params, states, /*root=*/0,
      [&](const std::string& name, const std::string& key, const at::Tensor& full) {
        const Placement* p = ShardedPlacement(name, full);
        const at::Tensor global = p ? tensor_parallel::GatherGlobal(full, *p, mesh_.tp) : full;
        if (rank() == 0) fn(name, key, global);
      },
      steps);
  if (rank() != 0 && steps != nullptr) steps->clear();
}

sharding::OptimizerStates ModelParallelStrategy::OptimizerStatesFromFull(
    const std::vector<at::Tensor>& params, const std::map<std::string, std::map<std::string, at::Tensor>>& state,
    const std::map<std::string, int64_t>& step) {
  CheckWrapped("OptimizerStatesFromFull");
  std::map<std::string, std::map<std::string, at::Tensor>> local;
  for (const auto& [name, keys] : state) {
    for (const auto& [key, t] : keys) {
      const Placement* p = ShardedPlacement(name, t);
      local[name][key] = p ? tensor_parallel::LocalPiece(t, *p, mesh_.tp_rank, mesh_.tp_size) : t;
    }
  }
  return ShardedStrategyBase::OptimizerStatesFromFull(params, local, step);
}

std::map<std::string, std::vector<int64_t>> ModelParallelStrategy::ParameterShapes() const {
  CheckWrapped("ParameterShapes");
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& [name, p] : placements_) out[name] = p.global_shape;
  return out;
}

std::vector<Strategy::UnitSummary> ModelParallelStrategy::UnitSummaries() const {
  std::vector<UnitSummary> rows = ShardedStrategyBase::UnitSummaries();
  const auto units = sm_->units();
  std::map<std::string, bool> trainable;
  for (const auto& item : module_->named_parameters(true)) trainable[item.key()] = item.value().requires_grad();
  for (size_t u = 0; u < rows.size() && u < units.size(); ++u) {
    rows[u].parameters = rows[u].trainable = 0;
    for (const auto& name : units[u].param_names) {
      const auto it = placements_.find(name);
      if (it == placements_.end()) continue;
      const int64_t n = c10::multiply_integers(it->second.global_shape);
      rows[u].parameters += n;
      if (trainable[name]) rows[u].trainable += n;
    }
  }
  return rows;
}

sharding::ShardedStateDict ModelParallelStrategy::ShardedState() const {
  sharding::ShardedStateDict sd = ShardedStrategyBase::ShardedState();
  sd.writes_whole = mesh_.tp_rank == 0;
  for (const auto& [name, p] : placements_) {
    if (!p.sharded || mesh_.tp_size == 1) continue;
    // This rank's rows [begin, end) of each of the `chunks` blocks along p.dim.
    const auto [begin, end] = p.Range(mesh_.tp_rank, mesh_.tp_size);
    const int64_t block_rows = p.global_shape[p.dim] / p.chunks;
    sharding::GlobalPiece piece;
    piece.global_shape = p.global_shape;
    piece.dim = p.dim;
    for (int64_t c = 0; c < p.chunks; ++c) {
      piece.blocks.push_back({c * (end - begin), c * block_rows + begin, end - begin});
    }
    sd.pieces[name] = std::move(piece);
  }
  return sd;
}

namespace {
const bool kRegistered = RegisterStrategy(
    "model_parallel", ModelParallelOptions::Table().Docs(),
    [](const StrategyOptions& o) {
      return std::make_shared<ModelParallelStrategy>(ModelParallelOptions::FromStrings(o));
    },
    "tensor parallel within groups of tensor_parallel_size ranks, FSDP across data_parallel_size groups");
}  // namespace

}  // namespace shardtrain::strategies
