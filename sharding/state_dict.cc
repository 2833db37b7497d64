// State dicts of a ShardedModel: full (gathered) and sharded (this rank's
// shards, loadable at any world size through sharding/shard_layout.h), and
// the shard <-> full conversions used for optimizer state.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <set>
#include <sstream>

#include "base/errors.h"
#include "sharding/flat_parameter.h"
#include "sharding/internal/sharded_unit.h"
#include "sharding/shard_layout.h"
#include "sharding/sharded_model.h"
#include "sharding/sharded_state.h"
#include "sharding/source_release.h"

namespace shardtrain::sharding {

using internal::IsFloating;

namespace {
// This rank's shard of one unit, read from full tensors by parameter name
// (only this rank's slice of each tensor is copied).
at::Tensor UnitShardOfFull(const FlatParameter& flat, const std::map<std::string, at::Tensor>& full) {
  std::vector<at::Tensor> ts;
  for (auto& e : flat.entries()) {
    auto it = full.find(e.name);
    ST_CHECK_ARG(it != full.end(), "missing tensor for parameter '", e.name, "'");
    ts.push_back(it->second.to(flat.device()));
  }
  return flat.ShardOfFull(ts, at::kFloat);
}
}  // namespace

// --- state dicts ---------------------------------------------------------------

std::map<std::string, at::Tensor> ShardedModel::GatherFullFromShards(const std::vector<at::Tensor>& per_unit) {
  ST_CHECK_ARG(per_unit.size() == units_.size(), "expected one tensor per unit (", units_.size(), "), got ",
               per_unit.size());
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < units_.size(); ++i) {
    const auto& flat = *units_[i]->flat;
    at::Tensor shard = per_unit[i].detach().to(flat.device(), at::kFloat).contiguous();
    ST_CHECK_ARG(shard.numel() == flat.shard_numel(), "unit '", flat.unit_name(), "': shard-shaped tensor has ",
                 shard.numel(), " elements, expected ", flat.shard_numel());
    at::Tensor full = at::empty({flat.padded_numel()}, shard.options());
    shard_group_->AllGather(shard, full)->Wait();
    auto tensors = flat.Unflatten(full);
    for (size_t k = 0; k < tensors.size(); ++k) out[flat.entries()[k].name] = tensors[k];
  }
  return out;
}

void ShardedModel::ForEachFullUnit(const std::function<at::Tensor(int unit)>& shard_of_unit, int root,
                                   const std::function<void(const std::string&, const at::Tensor&)>& fn) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < units_.size(); ++i) {
    const auto& flat = *units_[i]->flat;
    at::Tensor full;
    {
      at::Tensor given = shard_of_unit ? shard_of_unit(static_cast<int>(i)) : flat.shard();
      at::Tensor shard = given.detach().to(flat.device(), at::kFloat).contiguous();
      given = at::Tensor();
      ST_CHECK_ARG(shard.numel() == flat.shard_numel(), "unit '", flat.unit_name(), "': shard-shaped tensor has ",
                   shard.numel(), " elements, expected ", flat.shard_numel());
      full = at::empty({flat.padded_numel()}, shard.options());
      shard_group_->AllGather(shard, full)->Wait();
    }
    if (world_->rank() != root) continue;
    const auto views = flat.Views(full);
    for (size_t k = 0; k < views.size(); ++k) {
      fn(flat.entries()[k].name, views[k]);
      for (const auto& alias : flat.entries()[k].aliases) fn(alias, views[k]);
    }
  }
}

std::vector<at::Tensor> ShardedModel::ShardsFromFull(const std::map<std::string, at::Tensor>& full) const {
  std::vector<at::Tensor> out;
  for (auto& u : units_) out.push_back(UnitShardOfFull(*u->flat, full));
  return out;
}

std::map<std::string, at::Tensor> ShardedModel::FullStateDict(bool rank0_only, bool to_cpu) {
  std::vector<at::Tensor> shards;
  for (auto& u : units_) shards.push_back(u->flat->shard());
  auto params = GatherFullFromShards(shards);
  std::map<std::string, at::Tensor> out;
  if (rank0_only && world_->rank() != 0) return out;
  for (auto& [k, v] : params) out[k] = to_cpu ? v.cpu() : v;
  for (auto& u : units_) {
    for (const auto& e : u->flat->entries()) {
      for (const auto& alias : e.aliases) out[alias] = out.at(e.name);  // a tied weight under each of its names
    }
  }
  for (const auto& item : module_->named_buffers(true)) {
    at::Tensor b = item.value().detach();
    if (IsFloating(b)) b = b.to(at::kFloat);
    out[item.key()] = to_cpu ? b.cpu().clone() : b.clone();
  }
  return out;
}

void ShardedModel::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  std::ostringstream problems;
  std::set<std::string> expected;
  auto check = [&](const std::string& name, c10::IntArrayRef shape) {
    expected.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      problems << "\n  missing: '" << name << "' " << shape;
    } else if (it->second.sizes() != shape) {
      problems << "\n  shape mismatch: '" << name << "' is " << it->second.sizes() << " in the state dict, "
               << shape << " in the model";
    } else if (!at::isFloatingType(it->second.scalar_type())) {
      problems << "\n  dtype mismatch: '" << name << "' is " << it->second.scalar_type()
               << ", expected a floating type";
    }
  };
  for (auto& u : units_) {
    for (auto& e : u->flat->entries()) {
      check(e.name, e.shape);
      // A tied weight's further names may be left out; when given they must
      // hold the same values as its first name.
      for (const auto& alias : e.aliases) {
        expected.insert(alias);
        auto a = state.find(alias), primary = state.find(e.name);
        if (a == state.end() || primary == state.end()) continue;
        if (a->second.sizes() != primary->second.sizes() || !at::equal(a->second, primary->second)) {
          problems << "\n  tied parameters differ: '" << alias << "' is the same tensor as '" << e.name
                   << "' in the model, but the state dict holds different values for them";
        }
      }
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  for (const auto& item : module_->named_buffers(true)) {
    expected.insert(item.key());
    auto it = state.find(item.key());
    if (it == state.end()) {
      problems << "\n  missing buffer: '" << item.key() << "'";
    } else if (it->second.sizes() != item.value().sizes()) {
      problems << "\n  shape mismatch: buffer '" << item.key() << "' is " << it->second.sizes()
               << " in the state dict, " << item.value().sizes() << " in the model";
    }
    buffers.emplace_back(item.key(), item.value());
  }
  for (auto& [k, v] : state) {
    if (!expected.count(k)) problems << "\n  unexpected: '" << k << "' " << v.sizes();
  }
  if (!problems.str().empty()) {
    ST_THROW(InvalidArgumentError, "state dict does not match the model (nothing was loaded):", problems.str());
  }
  at::NoGradGuard no_grad;
  // One unit at a time into the live shard: never a second copy of all shards.
  for (auto& u : units_) u->flat->shard().detach().copy_(UnitShardOfFull(*u->flat, state));
  for (auto& [k, b] : buffers) b.copy_(state.at(k));
  // Gathered copies are stale now; aliased units (`full` is the shard) are current.
  for (auto& u : units_) Reshard(u.get());
}

ShardedStateDict ShardedModel::GetShardedStateDict() const {
  ShardedStateDict sd;
  sd.shard_rank = shard_group_->rank();
  sd.shard_world = shard_group_->size();
  sd.first_replica = !replicate_group_ || replicate_group_->rank() == 0;
  sd.units = units();
  // No copies: on the CPU these are the live tensors (the writer streams them).
  for (auto& u : units_) sd.shards.push_back(u->flat->shard().detach().cpu());
  for (const auto& item : module_->named_buffers(true)) sd.buffers[item.key()] = item.value().detach().cpu();
  return sd;
}

std::vector<std::vector<ShardCopy>> ShardedModel::PlanShardedLoad(const std::vector<ShardedStateDict>& pieces,
                                                                 const std::vector<size_t>& by_rank,
                                                                 std::vector<std::string>* problems) const {
  // The model's layout (destination) and the saved one (source).
  std::map<std::string, int64_t> model_numel;
  std::vector<FlatUnitLayout> dst;
  for (auto& u : units_) {
    FlatUnitLayout l{u->name, {}, {}, u->flat->shard_numel()};
    for (auto& e : u->flat->entries()) {
      l.param_names.push_back(e.name);
      l.param_numels.push_back(e.numel);
      model_numel[e.name] = e.numel;
    }
    dst.push_back(std::move(l));
  }
  const std::vector<FlatUnitLayout> src = SavedLayouts(pieces, by_rank, model_numel, problems);
  std::vector<std::vector<ShardCopy>> plans;
  for (const auto& d : dst) {
    plans.push_back(PlanShardCopies(src, static_cast<int64_t>(by_rank.size()), d, shard_group_->rank(), problems));
  }
  for (auto& p : UnexpectedParameters(src, dst)) problems->push_back(std::move(p));
  const ShardedStateDict& first = pieces.front();
  for (const auto& item : module_->named_buffers(true)) {
    auto it = first.buffers.find(item.key());
    std::ostringstream line;
    if (it == first.buffers.end()) {
      line << "missing buffer: '" << item.key() << "'";
    } else if (it->second.sizes() != item.value().sizes()) {
      line << "shape mismatch: buffer '" << item.key() << "' is " << it->second.sizes() << " in the checkpoint, "
           << item.value().sizes() << " in the model";
    }
    if (!line.str().empty()) problems->push_back(line.str());
  }
  return plans;
}

void ShardedModel::LoadShardsWith(const std::function<void(size_t unit, at::Tensor& shard)>& fill,
                                  const std::map<std::string, at::Tensor>& buffers) {
  for (const auto& item : module_->named_buffers(true)) {
    auto it = buffers.find(item.key());
    ST_CHECK_ARG(it != buffers.end() && it->second.sizes() == item.value().sizes(), "buffer '", item.key(), "' ",
                 it == buffers.end() ? "is missing" : "has another shape", " (nothing was loaded)");
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < units_.size(); ++i) {
    at::Tensor shard = units_[i]->flat->shard().detach();
    shard.zero_();
    fill(i, shard);
  }
  for (const auto& item : module_->named_buffers(true)) item.value().copy_(buffers.at(item.key()));
  for (auto& u : units_) Reshard(u.get());
}

std::vector<std::string> ShardedModel::CheckShardedStateDict(const std::vector<ShardedStateDict>& pieces) const {
  std::vector<std::string> problems;
  PlanShardedLoad(pieces, PieceOfShardRank(pieces), &problems);
  return problems;
}

void ShardedModel::LoadShardedStateDict(const std::vector<ShardedStateDict>& pieces) {
  const std::vector<size_t> by_rank = PieceOfShardRank(pieces);
  std::vector<std::string> problems;
  const auto plans = PlanShardedLoad(pieces, by_rank, &problems);
  if (!problems.empty()) {
    std::string lines;
    for (const auto& p : problems) lines += "\n  " + p;
    ST_THROW(InvalidArgumentError, "sharded checkpoint does not match the model (nothing was loaded):", lines);
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < units_.size(); ++i) {
    at::Tensor shard = units_[i]->flat->shard().detach();
    shard.zero_();  // the padding tail (and nothing else stays unwritten)
    for (const auto& c : plans[i]) {
      const at::Tensor& from = pieces[by_rank[c.src_rank]].shards[c.src_unit];
      shard.narrow(0, c.dst_offset, c.len).copy_(from.reshape({-1}).narrow(0, c.src_offset, c.len));
      SourceReleaseScope::Release(from);  // e.g. drop the mapped record's pages once its range is copied
    }
  }
  const ShardedStateDict& first = pieces.front();
  for (const auto& item : module_->named_buffers(true)) item.value().copy_(first.buffers.at(item.key()));
  // Gathered copies are stale now; aliased units (`full` is the shard) are current.
  for (auto& u : units_) Reshard(u.get());
}

}  // namespace shardtrain::sharding
