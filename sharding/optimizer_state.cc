// Optimizer state of a ShardedModel (sharding/optimizer_state.h).
#include "sharding/optimizer_state.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <set>
#include <unordered_map>

#include "base/errors.h"
#include "sharding/sharded_model.h"
#include "sharding/source_release.h"

namespace shardtrain::sharding {
namespace {

// Every state key any supported optimizer has (a fixed order: the ranks agree
// on which ones to gather by index).
const std::vector<std::string>& AllKeys() {
  static const std::vector<std::string> keys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
  return keys;
}

// Where an optimized tensor lies in its unit's shard.
struct Loc {
  int unit = -1;
  int64_t offset = 0;
  int64_t len = 0;
};

std::vector<Loc> Locate(const ShardedModel& model, const std::vector<at::Tensor>& params) {
  const auto named = model.named_parameters();
  const auto units = model.units();
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
    if (model.options().use_orig_params) {
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
std::map<std::string, std::vector<int64_t>> ParamShapes(const ShardedModel& model) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& item : model.module().named_parameters(true)) {
    out[item.key()] = item.value().sizes().vec();
  }
  return out;
}

// One unit's state tensor `key` laid out like the unit's shard: the state
// tensor itself when one optimized tensor covers the whole shard (no copy),
// else assembled (zeros where no optimized tensor has the key).
at::Tensor UnitKeyShard(const std::vector<Loc>& locs, const OptimizerStates& states, int unit, int64_t shard_numel,
                        const std::string& key, const at::TensorOptions& options) {
  at::Tensor out;
  for (size_t i = 0; i < locs.size(); ++i) {
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

// Element-wise max over the world, through the CUDA device for NCCL.
void AllReduceMax(comm::Communicator& c, const at::Tensor& t) {
  if (c.size() == 1) return;
  if (c.backend() != "nccl" || t.is_cuda()) {
    c.AllReduce(t, {comm::ReduceOp::kMax})->Wait();
    return;
  }
  at::Tensor d = t.to(c10::Device(c10::kCUDA));
  c.AllReduce(d, {comm::ReduceOp::kMax})->Wait();
  t.copy_(d);
}

// Which (unit, key) pairs hold state on any rank ([u * K + k] > 0) and each
// unit's largest step ([U * K + u]). Collective.
at::Tensor AgreeOnState(const ShardedModel& model, const std::vector<Loc>& locs, const OptimizerStates& states,
                        int64_t U) {
  const auto& keys = AllKeys();
  const int64_t K = static_cast<int64_t>(keys.size());
  at::Tensor flags = at::zeros({U * K + U}, at::kDouble);
  flags.narrow(0, U * K, U).fill_(-1.0);
  auto fa = flags.accessor<double, 1>();
  for (size_t i = 0; i < locs.size(); ++i) {
    if (!states[i]) continue;
    const int u = locs[i].unit;
    for (int64_t k = 0; k < K; ++k) {
      if (states[i]->tensors.count(keys[k])) fa[u * K + k] = 1.0;
    }
    fa[U * K + u] = std::max(fa[U * K + u], static_cast<double>(states[i]->step));
  }
  if (model.world()) AllReduceMax(*model.world(), flags);
  return flags;
}

}  // namespace

std::map<std::string, at::Tensor> UnitOptimizerState(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                                     const OptimizerStates& states, int unit) {
  const auto units = model.units();
  const auto locs = Locate(model, params);
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const Loc& loc = locs[i];
    if (loc.unit != unit || !states[i]) continue;
    for (const auto& [k, t] : states[i]->tensors) {
      at::Tensor& dst = out[k];
      if (!dst.defined() && loc.offset == 0 && loc.len == units[unit].shard_numel && t.scalar_type() == at::kFloat &&
          t.is_contiguous()) {
        dst = t.detach().reshape({-1});  // the unit's whole shard: the state itself
        continue;
      }
      if (!dst.defined()) dst = at::zeros({units[unit].shard_numel}, at::kFloat);
      dst.narrow(0, loc.offset, loc.len).copy_(t.detach().reshape({-1}));
    }
  }
  return out;
}

std::vector<std::vector<std::string>> OptimizedParameterNames(const ShardedModel& model,
                                                              const std::vector<at::Tensor>& params) {
  const auto units = model.units();
  const auto locs = Locate(model, params);
  std::set<std::string> frozen;
  for (const auto& item : model.module().named_parameters(true)) {
    if (!item.value().requires_grad()) frozen.insert(item.key());
  }
  std::unordered_map<const void*, std::string> orig;
  if (model.options().use_orig_params) {
    for (const auto& [n, t] : model.named_parameters()) orig[t.unsafeGetTensorImpl()] = n;
  }
  std::vector<std::vector<std::string>> out;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& names = out.emplace_back();
    if (model.options().use_orig_params) {
      names.push_back(orig.at(params[i].unsafeGetTensorImpl()));
      continue;
    }
    for (const auto& n : units[locs[i].unit].param_names) {
      if (!frozen.count(n)) names.push_back(n);
    }
  }
  return out;
}

std::vector<int64_t> UnitOptimizerSteps(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                        const OptimizerStates& states) {
  const auto locs = Locate(model, params);
  std::vector<int64_t> steps(model.num_units(), -1);
  for (size_t i = 0; i < params.size(); ++i) {
    if (states[i]) steps[locs[i].unit] = std::max(steps[locs[i].unit], states[i]->step);
  }
  return steps;
}

void ForEachFullOptimizerState(ShardedModel& model, const std::vector<at::Tensor>& params,
                               const OptimizerStates& states, int root,
                               const std::function<void(const std::string&, const std::string&, const at::Tensor&)>& fn,
                               std::map<std::string, int64_t>* steps) {
  at::NoGradGuard no_grad;
  const auto units = model.units();
  const auto locs = Locate(model, params);
  const auto& keys = AllKeys();
  const int64_t U = static_cast<int64_t>(units.size()), K = static_cast<int64_t>(keys.size());
  // Every rank must run the same gathers.
  const at::Tensor flags = AgreeOnState(model, locs, states, U);
  auto acc = flags.accessor<double, 1>();
  std::map<std::string, int> unit_of;
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& n : units[u].param_names) unit_of[n] = static_cast<int>(u);
  }
  // Frozen parameters have no optimizer state (a unit's shard of a state key
  // reads zeros there): they are left out, as torch.optim leaves them out.
  for (const auto& item : model.module().named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) unit_of.erase(item.key());
  }
  const auto shards = model.parameters();
  const auto options =
      at::TensorOptions().dtype(at::kFloat).device(shards.empty() ? c10::Device(c10::kCPU) : shards.front().device());
  for (int64_t k = 0; k < K; ++k) {
    bool any = false;
    for (int64_t u = 0; u < U; ++u) any = any || acc[u * K + k] > 0;
    if (!any) continue;
    model.ForEachFullUnit(
        [&](int u) { return UnitKeyShard(locs, states, u, units[u].shard_numel, keys[k], options); }, root,
        [&](const std::string& name, const at::Tensor& full) {
          auto it = unit_of.find(name);  // aliases of tied weights are not optimizer state names
          if (it == unit_of.end() || acc[it->second * K + k] <= 0) return;
          fn(name, keys[k], full);
        });
  }
  if (model.world()->rank() != root) return;
  for (int64_t u = 0; u < U; ++u) {
    const auto step = static_cast<int64_t>(acc[U * K + u]);
    bool has = false;
    for (int64_t k = 0; k < K; ++k) has = has || acc[u * K + k] > 0;
    if (has && step >= 0) {
      for (const auto& n : units[u].param_names) {
        if (unit_of.count(n)) (*steps)[n] = step;  // not the frozen ones
      }
    }
  }
}

OptimizerStates OptimizerStatesFromFull(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                        const std::map<std::string, std::map<std::string, at::Tensor>>& state,
                                        const std::map<std::string, int64_t>& step) {
  at::NoGradGuard no_grad;
  const auto units = model.units();
  const auto shapes = ParamShapes(model);
  std::set<std::string> keys;
  for (const auto& [name, ks] : state) {
    for (const auto& [k, t] : ks) keys.insert(k);
  }
  // Reshard each key: full tensors by name -> this rank's unit shards.
  std::map<std::string, std::vector<at::Tensor>> shards;
  for (const auto& key : keys) {
    std::map<std::string, at::Tensor> full;
    for (const auto& u : units) {
      for (const auto& n : u.param_names) {
        auto sit = state.find(n);
        const at::Tensor* t = nullptr;
        if (sit != state.end()) {
          auto kit = sit->second.find(key);
          if (kit != sit->second.end()) t = &kit->second;
        }
        // A missing key reads as zeros without allocating the full tensor
        // (a zero-strided view; ShardOfFull copies only this rank's slice).
        full[n] = t ? t->reshape(shapes.at(n)).to(at::kFloat) : at::zeros({}, at::kFloat).expand(shapes.at(n));
      }
    }
    shards[key] = model.ShardsFromFull(full);
  }
  std::vector<bool> has(units.size(), false);
  std::vector<int64_t> unit_step(units.size(), -1);
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& n : units[u].param_names) {
      auto sit = state.find(n);
      if (sit != state.end() && !sit->second.empty()) has[u] = true;
      auto st = step.find(n);
      if (st != step.end()) unit_step[u] = std::max(unit_step[u], st->second);
    }
  }
  const auto locs = Locate(model, params);
  OptimizerStates out(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Loc& loc = locs[i];
    if (!has[loc.unit]) continue;
    OptimizerTensorState st;
    for (const auto& [k, per_unit] : shards) {
      // ShardsFromFull made fresh tensors: a state covering a whole unit
      // shard takes it as is (no second copy of the optimizer state).
      at::Tensor v = per_unit[loc.unit].narrow(0, loc.offset, loc.len).reshape(params[i].sizes());
      const bool whole = loc.offset == 0 && loc.len == per_unit[loc.unit].numel();
      st.tensors[k] = whole ? v.to(params[i].options()) : v.to(params[i].options()).clone();
    }
    st.step = unit_step[loc.unit];
    out[i] = std::move(st);
  }
  return out;
}

OptimizerStates OptimizerStatesFromShards(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                          const std::vector<ShardedStateDict>& pieces,
                                          const std::vector<ShardedOptimizerState>& optimizer) {
  ST_CHECK_ARG(optimizer.size() == pieces.size(), "sharded optimizer state for ", optimizer.size(),
               " pieces, expected ", pieces.size());
  at::NoGradGuard no_grad;
  const auto by_rank = PieceOfShardRank(pieces);
  std::vector<std::string> problems;
  const auto plans = model.PlanShardedLoad(pieces, by_rank, &problems);
  const auto units = model.units();
  return OptimizerStatesFromUnits(model, params, [&](size_t u) {
    UnitShardState st;
    for (const auto& c : plans[u]) {
      const ShardedOptimizerState& p = optimizer[by_rank[c.src_rank]];
      if (p.units.empty()) continue;
      st.step = std::max(st.step, p.steps[c.src_unit]);
      for (const auto& [k, t] : p.units[c.src_unit]) {
        at::Tensor& d = st.tensors[k];
        if (!d.defined()) d = at::zeros({units[u].shard_numel}, at::kFloat);
        d.narrow(0, c.dst_offset, c.len).copy_(t.reshape({-1}).narrow(0, c.src_offset, c.len));
        SourceReleaseScope::Release(t);  // e.g. drop the mapped record's pages: one source range resident at a time
      }
    }
    return st;
  });
}

OptimizerStates OptimizerStatesFromUnits(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                         const std::function<UnitShardState(size_t unit)>& unit_state) {
  at::NoGradGuard no_grad;
  const auto units = model.units();
  const auto locs = Locate(model, params);
  OptimizerStates out(params.size());
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitShardState dense = unit_state(u);
    if (dense.tensors.empty()) continue;
    for (size_t i = 0; i < params.size(); ++i) {
      const Loc& loc = locs[i];
      if (loc.unit != static_cast<int>(u)) continue;
      OptimizerTensorState st;
      for (const auto& [k, t] : dense.tensors) {
        at::Tensor part = loc.offset == 0 && loc.len == t.numel() ? t : t.narrow(0, loc.offset, loc.len).clone();
        st.tensors[k] = part.view(params[i].sizes()).to(params[i].options());
      }
      st.step = dense.step;
      out[i] = std::move(st);
    }
  }
  return out;
}

}  // namespace shardtrain::sharding
