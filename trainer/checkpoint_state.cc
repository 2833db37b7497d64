#include "trainer/checkpoint_state.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "base/errors.h"
#include "sharding/shard_layout.h"
#include "sharding/sharded_model.h"
#include "trainer/accelerator.h"

namespace shardtrain::trainer::internal {
namespace {

// Every state key any supported optimizer has (a fixed order: the ranks agree
// on which ones to gather by index).
const std::vector<std::string>& AllKeys() {
  static const std::vector<std::string> keys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
  return keys;
}

struct TensorState {
  std::map<std::string, at::Tensor> tensors;
  int64_t step = -1;
};

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

// Where an optimized tensor of a sharded strategy lives in its unit's shard.
struct Loc {
  int unit = -1;
  int64_t offset = 0;
  int64_t len = 0;
};

std::vector<Loc> Locate(sharding::ShardedModel& sm, const std::vector<at::Tensor>& params) {
  const auto named = sm.named_parameters();
  const auto units = sm.units();
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < named.size(); ++i) index[named[i].second.unsafeGetTensorImpl()] = i;
  std::map<std::string, int> unit_of;
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& n : units[u].param_names) unit_of[n] = static_cast<int>(u);
  }
  std::vector<Loc> out;
  for (const auto& p : params) {
    auto it = index.find(p.unsafeGetTensorImpl());
    ST_CHECK_ARG(it != index.end(),
                 "the optimizer steps a tensor that is not one of the strategy's parameters(); checkpoints of "
                 "sharded strategies need an optimizer over (a subset of) strategy parameters()");
    Loc loc;
    if (sm.options().use_orig_params) {
      loc.unit = unit_of.at(named[it->second].first);
      loc.offset = p.storage_offset();
    } else {
      loc.unit = static_cast<int>(it->second);  // one shard per unit, in unit order
      loc.offset = 0;
    }
    loc.len = p.numel();
    out.push_back(loc);
  }
  return out;
}

// Full parameter shapes by name (the module keeps them while sharded).
std::map<std::string, std::vector<int64_t>> ParamShapes(strategies::Strategy& s) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& item : s.module().named_parameters(true)) out[item.key()] = item.value().sizes().vec();
  return out;
}

// This rank's optimizer state of unit `unit` laid out like the unit's shard:
// the state itself when one optimized tensor is the whole shard (no copy),
// else a shard-sized copy. `step` gets the largest step (-1: none).
std::map<std::string, at::Tensor> FlattenUnitState(const std::vector<sharding::UnitInfo>& units,
                                                   const torch::optim::Optimizer& opt,
                                                   const std::vector<at::Tensor>& params, const std::vector<Loc>& locs,
                                                   int unit, int64_t* step) {
  std::map<std::string, at::Tensor> out;
  *step = -1;
  for (size_t i = 0; i < params.size(); ++i) {
    const Loc& loc = locs[i];
    if (loc.unit != unit) continue;
    auto st = GetState(opt, params[i]);
    if (!st) continue;
    for (const auto& [k, t] : st->tensors) {
      at::Tensor& dst = out[k];
      if (!dst.defined() && loc.offset == 0 && loc.len == units[unit].shard_numel && t.scalar_type() == at::kFloat &&
          t.is_contiguous()) {
        dst = t.detach().reshape({-1});  // the unit's whole shard: the state itself
        continue;
      }
      if (!dst.defined()) dst = at::zeros({units[unit].shard_numel}, at::kFloat);
      dst.narrow(0, loc.offset, loc.len).copy_(t.detach().reshape({-1}));
    }
    *step = std::max(*step, st->step);
  }
  return out;
}

// This rank's optimizer state laid out per unit like the unit's shard.
void FlattenOptimizerState(sharding::ShardedModel& sm, const torch::optim::Optimizer& opt,
                           std::vector<std::map<std::string, at::Tensor>>& units_out, std::vector<int64_t>& steps) {
  const auto units = sm.units();
  units_out.assign(units.size(), {});
  steps.assign(units.size(), -1);
  const auto params = OptimizerParams(opt);
  const auto locs = Locate(sm, params);
  for (size_t u = 0; u < units.size(); ++u) {
    units_out[u] = FlattenUnitState(units, opt, params, locs, static_cast<int>(u), &steps[u]);
  }
}

}  // namespace

std::string OptimizerKind(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "Adam";
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "SGD";
  return "";
}

std::string SerializeOptimizer(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

void LoadOptimizerArchive(torch::optim::Optimizer& opt, const std::string& bytes, const std::string& path) {
  try {
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

FullOptimizerState GatherFullOptimizerState(strategies::Strategy& s, torch::optim::Optimizer& opt) {
  FullOptimizerState out;
  out.kind = OptimizerKind(opt);
  if (out.kind.empty()) return out;
  at::NoGradGuard no_grad;
  sharding::ShardedModel* sm = s.sharded_model_or_null();
  if (!sm) {
    std::unordered_map<const void*, std::string> names;
    for (const auto& [n, t] : s.named_parameters()) names[t.unsafeGetTensorImpl()] = n;
    for (const auto& p : OptimizerParams(opt)) {
      auto st = GetState(opt, p);
      auto it = names.find(p.unsafeGetTensorImpl());
      if (!st || it == names.end()) continue;
      for (const auto& [k, t] : st->tensors) out.state[it->second][k] = t.detach().cpu().clone();
      if (st->step >= 0) out.step[it->second] = st->step;
    }
    return out;
  }
  std::vector<std::map<std::string, at::Tensor>> local;
  std::vector<int64_t> steps;
  FlattenOptimizerState(*sm, opt, local, steps);
  const auto units = sm->units();
  const auto& keys = AllKeys();
  const int64_t U = static_cast<int64_t>(units.size()), K = static_cast<int64_t>(keys.size());
  // Agree on which (unit, key) pairs exist anywhere and on the steps: every
  // rank must then run the same gathers.
  at::Tensor flags = at::zeros({U * K + U}, at::kDouble);
  for (int64_t u = 0; u < U; ++u) {
    for (int64_t k = 0; k < K; ++k) {
      if (local[u].count(keys[k])) flags[u * K + k] = 1.0;
    }
    flags[U * K + u] = static_cast<double>(steps[u]);
  }
  if (s.world() && s.world()->size() > 1) HostAllReduce(*s.world(), flags, comm::ReduceOp::kMax);
  const auto shard_options = at::TensorOptions().dtype(at::kFloat).device(
      s.parameters().empty() ? c10::Device(c10::kCPU) : s.parameters().front().device());
  auto acc = flags.accessor<double, 1>();
  for (int64_t k = 0; k < K; ++k) {
    bool any = false;
    for (int64_t u = 0; u < U; ++u) any = any || acc[u * K + k] > 0;
    if (!any) continue;
    std::vector<at::Tensor> per_unit;
    for (int64_t u = 0; u < U; ++u) {
      auto it = local[u].find(keys[k]);
      per_unit.push_back(it != local[u].end() ? it->second : at::zeros({units[u].shard_numel}, shard_options));
    }
    auto full = sm->GatherFullFromShards(per_unit);
    for (int64_t u = 0; u < U; ++u) {
      if (acc[u * K + k] <= 0) continue;
      for (const auto& n : units[u].param_names) out.state[n][keys[k]] = full.at(n).cpu();
    }
  }
  for (int64_t u = 0; u < U; ++u) {
    const auto step = static_cast<int64_t>(acc[U * K + u]);
    bool has = false;
    for (int64_t k = 0; k < K; ++k) has = has || acc[u * K + k] > 0;
    if (has && step >= 0) {
      for (const auto& n : units[u].param_names) out.step[n] = step;
    }
  }
  return out;
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

c10::IValue OptimizerFullToIValue(const std::string& kind,
                                  const std::map<std::string, std::map<std::string, at::Tensor>>& state,
                                  const std::map<std::string, int64_t>& step) {
  c10::impl::GenericDict st(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [name, keys] : state) {
    c10::Dict<std::string, at::Tensor> ks;
    for (const auto& [k, t] : keys) ks.insert(k, t);
    st.insert(name, ks);
  }
  c10::Dict<std::string, int64_t> steps;
  for (const auto& [name, n] : step) steps.insert(name, n);
  c10::impl::GenericDict of(c10::StringType::get(), c10::AnyType::get());
  of.insert("kind", kind);
  of.insert("state", st);
  of.insert("step", steps);
  return of;
}

// Parameters and buffers of a replicated strategy's module, float32 like
// ModuleStateDict, each tensor once however many names it has.
void StreamReplicated(strategies::Strategy& s, torch::optim::Optimizer& opt, const std::string& kind,
                      StreamSink& sink, c10::Dict<std::string, at::Tensor>& sd,
                      std::map<std::string, std::map<std::string, at::Tensor>>& ostate,
                      std::map<std::string, int64_t>& osteps) {
  std::unordered_map<const void*, at::Tensor> written;
  auto add_named = [&](const std::string& name, const at::Tensor& v) {
    auto it = written.find(v.unsafeGetTensorImpl());
    if (it == written.end()) {
      at::Tensor t = v.detach();
      if (at::isFloatingType(t.scalar_type())) t = t.to(at::kFloat);
      it = written.emplace(v.unsafeGetTensorImpl(), sink.Add(t)).first;
    }
    sd.insert(name, it->second);
  };
  for (const auto& item : s.module().named_parameters(true)) add_named(item.key(), item.value());
  for (const auto& item : s.module().named_buffers(true)) add_named(item.key(), item.value());
  if (kind.empty()) return;
  std::unordered_map<const void*, std::string> names;
  for (const auto& [n, t] : s.named_parameters()) names[t.unsafeGetTensorImpl()] = n;
  for (const auto& p : OptimizerParams(opt)) {
    auto st = GetState(opt, p);
    auto it = names.find(p.unsafeGetTensorImpl());
    if (!st || it == names.end()) continue;
    for (const auto& [k, t] : st->tensors) ostate[it->second][k] = sink.Add(t.detach());
    if (st->step >= 0) osteps[it->second] = st->step;
  }
}

// One unit's state tensor `key` laid out like the unit's shard: the state
// tensor itself when one optimized tensor covers the whole shard (no copy),
// else assembled (zeros where no optimized tensor has the key).
at::Tensor UnitStateShard(const std::vector<at::Tensor>& params, const std::vector<Loc>& locs,
                          const std::vector<std::optional<TensorState>>& states, int unit, int64_t shard_numel,
                          const std::string& key, const at::TensorOptions& options) {
  at::Tensor out;
  for (size_t i = 0; i < params.size(); ++i) {
    if (locs[i].unit != unit || !states[i]) continue;
    auto it = states[i]->tensors.find(key);
    if (it == states[i]->tensors.end()) continue;
    if (locs[i].offset == 0 && locs[i].len == shard_numel && !out.defined()) {
      return it->second.detach().reshape({-1});
    }
    if (!out.defined()) out = at::zeros({shard_numel}, options);
    out.narrow(0, locs[i].offset, locs[i].len).copy_(it->second.detach().reshape({-1}));
  }
  return out.defined() ? out : at::zeros({shard_numel}, options);
}

}  // namespace

StreamedState StreamFullState(strategies::Strategy& s, torch::optim::Optimizer& opt, ArchiveWriter* writer) {
  at::NoGradGuard no_grad;
  StreamSink sink{writer, ""};
  const bool root = s.rank() == 0;
  const std::string kind = OptimizerKind(opt);
  c10::Dict<std::string, at::Tensor> sd;
  std::map<std::string, std::map<std::string, at::Tensor>> ostate;
  std::map<std::string, int64_t> osteps;
  sharding::ShardedModel* sm = s.sharded_model_or_null();
  if (!sm) {
    if (root) StreamReplicated(s, opt, kind, sink, sd, ostate, osteps);
  } else {
    // Parameters, one unit at a time; a tied weight's names share one record.
    at::Tensor last_full, last_written;
    sm->ForEachFullUnit(nullptr, 0, [&](const std::string& name, const at::Tensor& full) {
      if (!last_full.defined() || !last_full.is_same(full)) {
        last_full = full;
        last_written = sink.Add(full);
      }
      sd.insert(name, last_written);
    });
    last_full = last_written = at::Tensor();
    if (root) {
      for (const auto& item : s.module().named_buffers(true)) {
        at::Tensor b = item.value().detach();
        if (at::isFloatingType(b.scalar_type())) b = b.to(at::kFloat);
        sd.insert(item.key(), sink.Add(b));
      }
    }
    if (!kind.empty()) {
      const auto units = sm->units();
      const auto params = OptimizerParams(opt);
      const auto locs = Locate(*sm, params);
      std::vector<std::optional<TensorState>> states;
      for (const auto& p : params) states.push_back(GetState(opt, p));
      const auto& keys = AllKeys();
      const int64_t U = static_cast<int64_t>(units.size()), K = static_cast<int64_t>(keys.size());
      // Agree on which (unit, key) pairs exist anywhere and on the steps: every
      // rank must run the same gathers.
      at::Tensor flags = at::zeros({U * K + U}, at::kDouble);
      flags.narrow(0, U * K, U).fill_(-1.0);
      auto fa = flags.accessor<double, 1>();
      for (size_t i = 0; i < params.size(); ++i) {
        if (!states[i]) continue;
        const int u = locs[i].unit;
        for (int64_t k = 0; k < K; ++k) {
          if (states[i]->tensors.count(keys[k])) fa[u * K + k] = 1.0;
        }
        fa[U * K + u] = std::max(fa[U * K + u], static_cast<double>(states[i]->step));
      }
      if (s.world() && s.world()->size() > 1) HostAllReduce(*s.world(), flags, comm::ReduceOp::kMax);
      auto acc = flags.accessor<double, 1>();
      std::map<std::string, int> unit_of;
      for (size_t u = 0; u < units.size(); ++u) {
        for (const auto& n : units[u].param_names) unit_of[n] = static_cast<int>(u);
      }
      const auto options = at::TensorOptions().dtype(at::kFloat).device(
          s.parameters().empty() ? c10::Device(c10::kCPU) : s.parameters().front().device());
      for (int64_t k = 0; k < K; ++k) {
        bool any = false;
        for (int64_t u = 0; u < U; ++u) any = any || acc[u * K + k] > 0;
        if (!any) continue;
        sm->ForEachFullUnit(
            [&](int u) { return UnitStateShard(params, locs, states, u, units[u].shard_numel, keys[k], options); }, 0,
            [&](const std::string& name, const at::Tensor& full) {
              auto it = unit_of.find(name);  // aliases of tied weights are not optimizer state names
              if (it == unit_of.end() || acc[it->second * K + k] <= 0) return;
              ostate[name][keys[k]] = sink.Add(full);
            });
      }
      for (int64_t u = 0; u < U; ++u) {
        const auto step = static_cast<int64_t>(acc[U * K + u]);
        bool has = false;
        for (int64_t k = 0; k < K; ++k) has = has || acc[u * K + k] > 0;
        if (has && step >= 0) {
          for (const auto& n : units[u].param_names) osteps[n] = step;
        }
      }
    }
  }
  StreamedState out;
  if (!root) return out;
  out.error = sink.error;
  out.state_dict = sd;
  if (!kind.empty()) out.optimizer_full = OptimizerFullToIValue(kind, ostate, osteps);
  return out;
}

ShardedPiece MakeShardedPiece(strategies::Strategy& s, torch::optim::Optimizer& opt) {
  sharding::ShardedModel* sm = s.sharded_model_or_null();
  ST_CHECK_ARG(sm != nullptr, "strategy '", s.name(), "' is not sharded: it cannot write sharded checkpoints");
  at::NoGradGuard no_grad;
  sharding::ShardedStateDict sd = sm->GetShardedStateDict();
  const auto shapes = ParamShapes(s);
  ShardedPiece piece;
  piece.rank = s.rank();
  piece.world_size = s.world_size();
  piece.shard_rank = sd.shard_rank;
  piece.shard_world = sd.shard_world;
  for (const auto& u : sd.units) {
    SavedUnit su;
    su.name = u.name;
    su.param_names = u.param_names;
    for (const auto& n : u.param_names) {
      auto it = shapes.find(n);
      ST_CHECK_ARG(it != shapes.end(), "sharded checkpoint: unit parameter '", n, "' is not a parameter of the module");
      su.param_shapes.push_back(it->second);
    }
    su.numel = u.numel;
    su.padded_numel = u.padded_numel;
    su.shard_numel = u.shard_numel;
    piece.units.push_back(std::move(su));
  }
  for (const auto& t : sd.shards) piece.shards.push_back(t.to(at::kFloat));  // float32 already: the live shard
  piece.buffers = sd.buffers;
  piece.optimizer_kind = OptimizerKind(opt);
  if (piece.optimizer_kind.empty()) {
    piece.optimizer_archive = SerializeOptimizer(opt);
  } else {
    // Steps now; the state one unit at a time while the file is written
    // (copies, where a unit's state is several tensors, never all alive).
    const auto units = sm->units();
    const auto params = OptimizerParams(opt);
    const auto locs = Locate(*sm, params);
    piece.optimizer_steps.assign(units.size(), -1);
    for (size_t i = 0; i < params.size(); ++i) {
      auto st = GetState(opt, params[i]);
      if (st) piece.optimizer_steps[locs[i].unit] = std::max(piece.optimizer_steps[locs[i].unit], st->step);
    }
    piece.optimizer_unit_source = [units, params, locs, &opt](size_t u) {
      int64_t step = -1;
      return FlattenUnitState(units, opt, params, locs, static_cast<int>(u), &step);
    };
  }
  return piece;
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
  std::vector<std::optional<TensorState>> states(params.size());
  sharding::ShardedModel* sm = s.sharded_model_or_null();
  if (!sm) {
    std::unordered_map<const void*, std::string> names;
    for (const auto& [n, t] : s.named_parameters()) names[t.unsafeGetTensorImpl()] = n;
    for (size_t i = 0; i < params.size(); ++i) {
      auto nit = names.find(params[i].unsafeGetTensorImpl());
      if (nit == names.end()) continue;
      auto sit = state.state.find(nit->second);
      if (sit == state.state.end() || sit->second.empty()) continue;
      TensorState st;
      for (const auto& [k, t] : sit->second) st.tensors[k] = t.reshape(params[i].sizes()).to(params[i].options()).clone();
      auto step = state.step.find(nit->second);
      st.step = step == state.step.end() ? -1 : step->second;
      states[i] = std::move(st);
    }
  } else {
    const auto units = sm->units();
    std::set<std::string> keys;
    for (const auto& [name, ks] : state.state) {
      for (const auto& [k, t] : ks) keys.insert(k);
    }
    // Reshard each key: full tensors by name -> this rank's unit shards.
    std::map<std::string, std::vector<at::Tensor>> shards;
    for (const auto& key : keys) {
      std::map<std::string, at::Tensor> full;
      for (const auto& u : units) {
        for (const auto& n : u.param_names) {
          auto sit = state.state.find(n);
          const at::Tensor* t = nullptr;
          if (sit != state.state.end()) {
            auto kit = sit->second.find(key);
            if (kit != sit->second.end()) t = &kit->second;
          }
          full[n] = t ? t->reshape(shapes.at(n)).to(at::kFloat) : at::zeros(shapes.at(n), at::kFloat);
        }
      }
      shards[key] = sm->ShardsFromFull(full);
    }
    std::vector<bool> has(units.size(), false);
    std::vector<int64_t> unit_step(units.size(), -1);
    for (size_t u = 0; u < units.size(); ++u) {
      for (const auto& n : units[u].param_names) {
        auto sit = state.state.find(n);
        if (sit != state.state.end() && !sit->second.empty()) has[u] = true;
        auto step = state.step.find(n);
        if (step != state.step.end()) unit_step[u] = std::max(unit_step[u], step->second);
      }
    }
    const auto locs = Locate(*sm, params);
    for (size_t i = 0; i < params.size(); ++i) {
      const Loc& loc = locs[i];
      if (!has[loc.unit]) continue;
      TensorState st;
      for (const auto& [k, per_unit] : shards) {
        // ShardsFromFull made fresh tensors: a state covering a whole unit
        // shard takes it as is (no second copy of the optimizer state).
        at::Tensor v = per_unit[loc.unit].narrow(0, loc.offset, loc.len).reshape(params[i].sizes());
        const bool whole = loc.offset == 0 && loc.len == per_unit[loc.unit].numel();
        st.tensors[k] = whole ? v.to(params[i].options()) : v.to(params[i].options()).clone();
      }
      st.step = unit_step[loc.unit];
      states[i] = std::move(st);
    }
  }
  return [&opt, kind, params, states = std::move(states)] {
    for (size_t i = 0; i < params.size(); ++i) SetState(opt, kind, params[i], states[i]);
  };
}

std::function<void()> PrepareShardedLoad(strategies::Strategy& s, torch::optim::Optimizer& opt,
                                         const ShardedCheckpoint& ck, const std::string& path) {
  sharding::ShardedModel* sm = s.sharded_model_or_null();
  ST_CHECK_ARG(sm != nullptr, "strategy '", s.name(), "' is not sharded: it loads sharded checkpoints consolidated");
  ST_CHECK_ARG(!ck.pieces.empty(), "sharded checkpoint '", path, "' has no rank files");
  at::NoGradGuard no_grad;
  const ShardedPiece& first = ck.pieces.front();
  const int64_t old_world = first.shard_world;
  std::vector<const ShardedPiece*> by(old_world, nullptr);  // HYBRID_SHARD replicas: the first
  for (const auto& p : ck.pieces) {
    if (!by[p.shard_rank]) by[p.shard_rank] = &p;
  }
  // Layouts: saved (source) and this model's (destination).
  std::vector<sharding::FlatUnitLayout> src;
  for (const auto& u : first.units) {
    sharding::FlatUnitLayout l{u.name, u.param_names, {}, u.shard_numel};
    for (const auto& shape : u.param_shapes) l.param_numels.push_back(c10::multiply_integers(shape));
    src.push_back(std::move(l));
  }
  const auto shapes = ParamShapes(s);
  const auto units = sm->units();
  std::vector<sharding::FlatUnitLayout> dst;
  for (const auto& u : units) {
    sharding::FlatUnitLayout l{u.name, u.param_names, {}, u.shard_numel};
    for (const auto& n : u.param_names) l.param_numels.push_back(c10::multiply_integers(shapes.at(n)));
    dst.push_back(std::move(l));
  }
  const int64_t my_rank = sm->GetShardedStateDict().shard_rank;
  std::ostringstream problems;
  std::vector<std::vector<sharding::ShardCopy>> plans;
  for (const auto& d : dst) {
    std::vector<std::string> unit_problems;
    plans.push_back(sharding::PlanShardCopies(src, old_world, d, my_rank, &unit_problems));
    for (const auto& p : unit_problems) problems << "\n  " << p;
  }
  for (const auto& p : sharding::UnexpectedParameters(src, dst)) problems << "\n  " << p;
  if (!problems.str().empty()) {
    ST_THROW(Error, "checkpoint '", path, "' does not match the model (nothing was loaded):", problems.str());
  }
  // The parameters as pieces of the saved run (views of the mapped files).
  std::vector<sharding::ShardedStateDict> pieces;
  for (const auto& p : ck.pieces) {
    sharding::ShardedStateDict sd;
    sd.shard_rank = static_cast<int>(p.shard_rank);
    sd.shard_world = static_cast<int>(p.shard_world);
    for (const auto& u : p.units) {
      sharding::UnitInfo info;
      info.name = u.name;
      info.param_names = u.param_names;
      info.numel = u.numel;
      info.padded_numel = u.padded_numel;
      info.shard_numel = u.shard_numel;
      sd.units.push_back(std::move(info));
      sd.param_shapes.push_back(u.param_shapes);
    }
    sd.shards = p.shards;
    sd.buffers = p.buffers;
    pieces.push_back(std::move(sd));
  }
  auto load_params = [sm, pieces = std::move(pieces)] { sm->LoadShardedStateDict(pieces); };

  // Optimizer state.
  const std::string kind = OptimizerKind(opt);
  const bool any_state = std::any_of(ck.pieces.begin(), ck.pieces.end(), [](const ShardedPiece& p) {
    return std::any_of(p.optimizer_units.begin(), p.optimizer_units.end(), [](const auto& m) { return !m.empty(); });
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
  // Per destination unit and key: this rank's range only, from the source
  // shards that overlap it; then each optimized tensor's part. A unit's
  // dense state is dropped before the next unit's is built.
  const auto params = OptimizerParams(opt);
  const auto locs = Locate(*sm, params);
  std::vector<std::optional<TensorState>> states(params.size());
  for (size_t u = 0; u < units.size(); ++u) {
    std::map<std::string, at::Tensor> dense;
    int64_t step = -1;
    for (const auto& c : plans[u]) {
      const ShardedPiece& p = *by[c.src_rank];
      if (p.optimizer_units.empty()) continue;
      step = std::max(step, p.optimizer_steps[c.src_unit]);
      for (const auto& [k, t] : p.optimizer_units[c.src_unit]) {
        at::Tensor& d = dense[k];
        if (!d.defined()) d = at::zeros({units[u].shard_numel}, at::kFloat);
        d.narrow(0, c.dst_offset, c.len).copy_(t.reshape({-1}).narrow(0, c.src_offset, c.len));
      }
    }
    if (dense.empty()) continue;
    for (size_t i = 0; i < params.size(); ++i) {
      const Loc& loc = locs[i];
      if (loc.unit != static_cast<int>(u)) continue;
      TensorState st;
      for (const auto& [k, t] : dense) {
        at::Tensor part = loc.offset == 0 && loc.len == t.numel() ? t : t.narrow(0, loc.offset, loc.len).clone();
        st.tensors[k] = part.view(params[i].sizes()).to(params[i].options());
      }
      st.step = step;
      states[i] = std::move(st);
    }
  }
  return [load_params, &opt, kind, params, states = std::move(states)] {
    load_params();
    for (size_t i = 0; i < params.size(); ++i) SetState(opt, kind, params[i], states[i]);
  };
}

}  // namespace shardtrain::trainer::internal
