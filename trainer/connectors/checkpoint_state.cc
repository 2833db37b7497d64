// Moving model and optimizer state between a strategy and checkpoint
// structures. The strategy says what the state is (strategies/strategy.h,
// "Checkpoint state": full tensors by name, shards, resharding); this file
// reads LibTorch's optimizers and fills the checkpoint structures.
#include "trainer/connectors/internal/checkpoint_state.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::trainer::internal {
namespace {

using TensorState = sharding::OptimizerTensorState;

template <typename S>
void AddAdamLike(const S& s, TensorState& out) {
  out.step = s.step();
  if (s.exp_avg().defined()) out.tensors["exp_avg"] = s.exp_avg();
  if (s.exp_avg_sq().defined()) out.tensors["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined() && s.max_exp_avg_sq().numel() > 0) out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
}

std::optional<TensorState> GetState(const torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end() || !it->second) return std::nullopt;
  TensorState out;
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
    AddAdamLike(*a, out);
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    AddAdamLike(*w, out);
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    if (!s->momentum_buffer().defined()) return std::nullopt;
    out.tensors["momentum_buffer"] = s->momentum_buffer();
  } else {
    return std::nullopt;
  }
  return out;
}

template <typename S>
std::unique_ptr<torch::optim::OptimizerParamState> MakeAdamLike(const TensorState& st) {
  auto s = std::make_unique<S>();
  s->step(std::max<int64_t>(st.step, 0));
  auto get = [&](const char* k) {
    auto it = st.tensors.find(k);
    return it == st.tensors.end() ? at::Tensor() : it->second;
  };
  s->exp_avg(get("exp_avg"));
  s->exp_avg_sq(get("exp_avg_sq"));
  s->max_exp_avg_sq(get("max_exp_avg_sq"));
  return s;
}

}  // namespace

void SetState(torch::optim::Optimizer& opt, const std::string& kind, const at::Tensor& p,
              const std::optional<TensorState>& st) {
  void* key = p.unsafeGetTensorImpl();
  opt.state().erase(key);
  if (!st) return;
  if (kind == "Adam") {
    opt.state()[key] = MakeAdamLike<torch::optim::AdamParamState>(*st);
  } else if (kind == "AdamW") {
    opt.state()[key] = MakeAdamLike<torch::optim::AdamWParamState>(*st);
  } else if (kind == "SGD") {
    auto it = st->tensors.find("momentum_buffer");
    if (it == st->tensors.end()) return;
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(it->second);
    opt.state()[key] = std::move(s);
  }
}

std::vector<at::Tensor> OptimizerParams(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) out.push_back(p);
  }
  return out;
}

sharding::OptimizerStates StatesOf(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params) {
  sharding::OptimizerStates out;
  for (const auto& p : params) out.push_back(GetState(opt, p));
  return out;
}

std::map<std::string, std::vector<int64_t>> ParamShapes(strategies::Strategy& s) { return s.ParameterShapes(); }

std::map<std::string, std::vector<int64_t>> StoredShapes(strategies::Strategy& s) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& item : s.module().named_parameters(/*recurse=*/true)) out[item.key()] = item.value().sizes().vec();
  return out;
}

std::map<std::string, std::string> TiedAliases(strategies::Strategy& s, const sharding::ShardedStateDict& sd) {
  std::set<std::string> primary;
  for (const auto& u : sd.units) primary.insert(u.param_names.begin(), u.param_names.end());
  std::map<const void*, std::string> primary_of;  // tensor -> its name in the units
  const auto params = s.module().named_parameters(true);
  for (const auto& item : params) {
    if (primary.count(item.key())) primary_of[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::map<std::string, std::string> out;
  for (const auto& item : params) {
    auto it = primary_of.find(item.value().unsafeGetTensorImpl());
    if (!primary.count(item.key()) && it != primary_of.end()) out[item.key()] = it->second;
  }
  return out;
}

namespace {

// LibTorch's TorchScript archives (torch::serialize: torch::jit::load and
// the module export behind OutputArchive) build process-wide JIT state on
// first use and share it afterwards: static rewrite tables
// (rewriteQuantizedConvForBC), name manglers, the type caches. LibTorch does
// not say that this is safe from several threads at once, and ranks run as
// threads (tests, threads-as-ranks), where ThreadSanitizer reported those
// accesses. One lock around our two uses: the archives are small and made
// only at checkpoints, and no collective runs while it is held.
std::mutex& TorchScriptArchiveMutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

std::string OptimizerKind(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "Adam";
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "SGD";
  return "";
}

std::string SerializeOptimizer(const torch::optim::Optimizer& opt) {
  std::lock_guard<std::mutex> lock(TorchScriptArchiveMutex());
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

void LoadOptimizerArchive(torch::optim::Optimizer& opt, const std::string& bytes, const std::string& path) {
  try {
    std::lock_guard<std::mutex> lock(TorchScriptArchiveMutex());
    torch::serialize::InputArchive ar;
    std::istringstream is(bytes);
    ar.load_from(is);
    opt.load(ar);
  } catch (const c10::Error& e) {
    std::string what = e.what();
    ST_THROW(Error, "checkpoint '", path, "': optimizer state does not fit this optimizer: ",
             what.substr(0, what.find('\n')));
  }
}

namespace {

// Rank 0's side of StreamFullState: adds tensors to the writer until the
// first error, then only records it.
struct StreamSink {
  ArchiveWriter* writer;
  std::string error;
  at::Tensor Add(const at::Tensor& t) {
    if (!writer || !error.empty()) return at::Tensor();
    try {
      return writer->Add(t);
    } catch (const std::exception& e) {
      error = e.what();
      return at::Tensor();
    }
  }
};

// A group's options with torch.optim's keys, types and defaults (torch 2.x).
StateDict GroupOptions(const torch::optim::OptimizerOptions& o) {
  StateDict d = {{"maximize", false}, {"foreach", StateValue()}, {"differentiable", false}, {"fused", StateValue()}};
  auto adam_like = [&](const auto& a, bool decoupled) {
    d["lr"] = a.lr();
    d["betas"] = std::vector<double>{std::get<0>(a.betas()), std::get<1>(a.betas())};
    d["eps"] = a.eps();
    d["weight_decay"] = a.weight_decay();
    d["amsgrad"] = a.amsgrad();
    d["capturable"] = false;
    d["decoupled_weight_decay"] = decoupled;
  };
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
    adam_like(*a, false);
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
    adam_like(*w, true);
  } else if (auto* g = dynamic_cast<const torch::optim::SGDOptions*>(&o)) {
    d["lr"] = g->lr();
    d["momentum"] = g->momentum();
    d["dampening"] = g->dampening();
    d["weight_decay"] = g->weight_decay();
    d["nesterov"] = g->nesterov();
  } else {
    d["lr"] = o.get_lr();
  }
  return d;
}

}  // namespace

std::vector<OptimizerGroup> OptimizerGroups(
    strategies::Strategy& s, const torch::optim::Optimizer& opt,
    const std::function<std::vector<double>(std::vector<double>)>& all_reduce_sum) {
  // Every trainable name, in the module's order; which group steps it, from
  // every rank's tensors (a rank may hold no elements of some parameters).
  std::vector<std::string> names;
  std::map<std::string, size_t> index;
  for (const auto& item : s.module().named_parameters(true)) {
    if (index.emplace(item.key(), names.size()).second) names.push_back(item.key());
  }
  const size_t N = names.size();
  std::vector<double> sums(2 * N, 0.0);  // [group + 1 summed | ranks that hold it]
  const auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto held = s.OptimizedParameterNames(groups[g].params());
    for (const auto& tensor_names : held) {
      for (const auto& n : tensor_names) {
        auto it = index.find(n);
        if (it == index.end()) continue;
        sums[it->second] += static_cast<double>(g + 1);
        sums[N + it->second] += 1.0;
      }
    }
  }
  if (s.world_size() > 1) sums = all_reduce_sum(std::move(sums));
  std::vector<OptimizerGroup> out(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) out[g].options = GroupOptions(groups[g].options());
  for (size_t i = 0; i < N; ++i) {
    if (sums[N + i] <= 0) continue;  // frozen, or an alias of a tied weight
    const auto g = static_cast<size_t>(std::llround(sums[i] / sums[N + i])) - 1;
    ST_CHECK_ARG(g < groups.size() && std::abs(sums[i] / sums[N + i] - static_cast<double>(g + 1)) < 1e-9,
                 "parameter '", names[i], "' is in more than one of the optimizer's parameter groups");
    out[g].params.push_back(names[i]);
  }
  return out;
}

LoadedGroupLrs GroupLrsAndMomentums(const std::vector<OptimizerGroup>& groups) {
  std::vector<double> lrs, momentums;
  for (const auto& g : groups) {
    auto lr = g.options.find("lr");
    if (lr == g.options.end()) return {};
    lrs.push_back(lr->second.AsDouble());
    if (auto m = g.options.find("momentum"); m != g.options.end()) {
      momentums.push_back(m->second.AsDouble());
    } else if (auto b = g.options.find("betas"); b != g.options.end() && b->second.is<std::vector<double>>() &&
                                                 !b->second.get<std::vector<double>>().empty()) {
      momentums.push_back(b->second.get<std::vector<double>>()[0]);
    }
  }
  if (!momentums.empty() && momentums.size() != lrs.size()) momentums.clear();
  return {std::move(lrs), std::move(momentums)};
}

StreamedState StreamFullState(strategies::Strategy& s, torch::optim::Optimizer& opt, ArchiveWriter* writer) {
  at::NoGradGuard no_grad;
  StreamSink sink{writer, ""};
  const bool root = s.rank() == 0;
  const std::string kind = OptimizerKind(opt);
  c10::Dict<std::string, at::Tensor> sd;
  std::map<std::string, std::map<std::string, at::Tensor>> ostate;
  std::map<std::string, int64_t> osteps;
  s.ForEachFullStateTensor(0, {[&](const at::Tensor& t) { return sink.Add(t); },
                               [&](const std::string& name, const at::Tensor& stored) { sd.insert(name, stored); }});
  if (!kind.empty()) {
    const auto params = OptimizerParams(opt);
    s.ForEachFullOptimizerState(
        params, StatesOf(opt, params), 0,
        [&](const std::string& name, const std::string& key, const at::Tensor& full) {
          ostate[name][key] = sink.Add(full);
        },
        &osteps);
  }
  StreamedState out;
  if (!root) return out;
  out.error = sink.error;
  out.state_dict = sd;
  if (!kind.empty()) out.optimizer_full = FullOptimizerState{kind, std::move(ostate), std::move(osteps)};
  return out;
}

std::function<void()> PrepareOptimizerLoad(strategies::Strategy& s, torch::optim::Optimizer& opt,
                                           const FullOptimizerState& state, const std::string& path) {
  if (state.empty()) return [] {};
  const std::string kind = OptimizerKind(opt);
  if (kind != state.kind) {
    ST_THROW(Error, "checkpoint '", path, "' holds ", state.kind, " optimizer state but this run's optimizer is ",
             kind.empty() ? "another kind" : kind, "; nothing was loaded");
  }
  at::NoGradGuard no_grad;
  const auto shapes = ParamShapes(s);
  std::ostringstream problems;
  for (const auto& [name, keys] : state.state) {
    auto it = shapes.find(name);
    if (it == shapes.end()) {
      problems << "\n  unexpected: optimizer state for '" << name << "', which the model does not have";
      continue;
    }
    const int64_t n = c10::multiply_integers(it->second);
    for (const auto& [k, t] : keys) {
      if (t.numel() != n) {
        problems << "\n  size mismatch: optimizer state '" << k << "' of '" << name << "' has " << t.numel()
                 << " elements, the parameter " << n;
      }
    }
  }
  if (!problems.str().empty()) {
    ST_THROW(Error, "checkpoint '", path, "': optimizer state does not match the model (nothing was loaded):",
             problems.str());
  }
  const auto params = OptimizerParams(opt);
  auto states = s.OptimizerStatesFromFull(params, state.state, state.step);
  return [&opt, kind, params, states = std::move(states)] {
    for (size_t i = 0; i < params.size(); ++i) SetState(opt, kind, params[i], states[i]);
  };
}

namespace {

// The pieces' core states (the parameters as views of the mapped files) and
// optimizer states: handles, no copies.
std::vector<sharding::ShardedStateDict> CorePieces(const ShardedCheckpoint& ck) {
  std::vector<sharding::ShardedStateDict> pieces;
  for (const auto& p : ck.pieces) pieces.push_back(p.state);
  return pieces;
}

std::vector<sharding::ShardedOptimizerState> CoreOptimizerPieces(const ShardedCheckpoint& ck) {
  std::vector<sharding::ShardedOptimizerState> out;
  for (const auto& p : ck.pieces) out.push_back(p.optimizer);
  return out;
}

}  // namespace

std::function<void()> PrepareShardedLoad(strategies::Strategy& s, torch::optim::Optimizer& opt,
                                         const ShardedCheckpoint& ck, const std::string& path) {
  ST_CHECK_ARG(s.has_sharded_state(), "strategy '", s.name(),
               "' is not sharded: it loads sharded checkpoints consolidated");
  ST_CHECK_ARG(!ck.pieces.empty(), "sharded checkpoint '", path, "' has no rank files");
  at::NoGradGuard no_grad;
  const ShardedPiece& first = ck.pieces.front();
  std::vector<sharding::ShardedStateDict> pieces = CorePieces(ck);
  std::ostringstream problems;
  for (const auto& p : s.CheckShardedState(pieces)) problems << "\n  " << p;
  if (!problems.str().empty()) {
    ST_THROW(Error, "checkpoint '", path, "' does not match the model (nothing was loaded):", problems.str());
  }
  std::function<void()> load_params = [&s, pieces] { s.LoadShardedState(pieces); };

  // Optimizer state.
  const std::string kind = OptimizerKind(opt);
  const bool any_state = std::any_of(ck.pieces.begin(), ck.pieces.end(), [](const ShardedPiece& p) {
    return std::any_of(p.optimizer.units.begin(), p.optimizer.units.end(), [](const auto& m) { return !m.empty(); });
  });
  const bool archives = std::all_of(ck.pieces.begin(), ck.pieces.end(),
                                    [](const ShardedPiece& p) { return !p.optimizer_archive.empty(); });
  if (first.optimizer_kind.empty() || !any_state) {
    if (!archives || !first.optimizer_kind.empty()) return load_params;
    // Only a LibTorch archive per rank: restores the same strategy at the same world size.
    const int64_t W = s.world_size();
    if (ck.meta.world_size != W || static_cast<int64_t>(ck.pieces.size()) != W || ck.meta.strategy != s.name()) {
      ST_THROW(Error, "checkpoint '", path, "' holds optimizer state of ", ck.pieces.size(), " ranks (",
               ck.meta.strategy, ") but this run has ", W, " (", s.name(),
               "); only Adam, AdamW and SGD state is saved in a form that loads at another world size or strategy");
    }
    const std::string* bytes = &ck.pieces[s.rank()].optimizer_archive;
    return [load_params, &opt, bytes, path] {
      load_params();
      LoadOptimizerArchive(opt, *bytes, path);
    };
  }
  if (kind != first.optimizer_kind) {
    ST_THROW(Error, "checkpoint '", path, "' holds ", first.optimizer_kind, " optimizer state but this run's optimizer is ",
             kind.empty() ? "another kind" : kind, "; nothing was loaded");
  }
  const auto params = OptimizerParams(opt);
  auto states = s.OptimizerStatesFromShards(params, pieces, CoreOptimizerPieces(ck));
  return [load_params, &opt, kind, params, states = std::move(states)] {
    load_params();
    for (size_t i = 0; i < params.size(); ++i) SetState(opt, kind, params[i], states[i]);
  };
}

}  // namespace shardtrain::trainer::internal
