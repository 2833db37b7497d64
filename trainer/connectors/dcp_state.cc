// Sharded checkpoints in PyTorch DCP's layout (trainer/checkpoint_io/
// dcp_checkpoint.h) to and from a sharded strategy's flat shards: a rank's
// shard of a unit is a range of the unit's parameters laid end to end, and
// DCP stores boxes of each parameter's global shape, so the range is split
// into the boxes it covers (saving) and the boxes of the file are cut into
// the runs that overlap a rank's range (loading).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "sharding/source_release.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/connectors/internal/checkpoint_state.h"

namespace shardtrain::trainer::internal {
namespace {

// A rank file holds the LibTorch archive of an optimizer other than Adam,
// AdamW and SGD under this path (loads at the same world size only).
std::vector<dcp::PathPart> ArchivePath(int64_t rank) { return {{"shardtrain"}, {"optimizer_archive_" + std::to_string(rank)}}; }

struct Part {  // one parameter's elements [begin, end) (its own flat index) at `at` in the unit's flat parameter
  std::string name;
  std::vector<int64_t> shape;
  int64_t at = 0, begin = 0, end = 0;
};

// The parameters of unit `u` that this rank's shard holds elements of.
std::vector<Part> PartsInShard(const sharding::ShardedStateDict& sd, size_t u,
                               const std::map<std::string, std::vector<int64_t>>& shapes) {
  const auto& unit = sd.units[u];
  const int64_t lo = sd.shard_rank * unit.shard_numel, hi = lo + unit.shard_numel;
  std::vector<Part> out;
  int64_t at = 0;
  for (const auto& name : unit.param_names) {
    const std::vector<int64_t>& shape = shapes.at(name);
    const int64_t n = c10::multiply_integers(shape);
    const int64_t b = std::max(lo, at), e = std::min(hi, at + n);
    if (b < e) out.push_back({name, shape, at, b - at, e - at});
    at += n;
  }
  return out;
}

std::set<std::string> OptimizedNames(const std::vector<OptimizerGroup>& groups) {
  std::set<std::string> out;
  for (const auto& g : groups) out.insert(g.params.begin(), g.params.end());
  return out;
}

}  // namespace

void WriteDcpRank(strategies::Strategy& s, torch::optim::Optimizer& opt, const std::string& path,
                  const std::vector<OptimizerGroup>& groups) {
  ST_CHECK_ARG(s.has_sharded_state(), "strategy '", s.name(), "' is not sharded: it cannot write sharded checkpoints");
  at::NoGradGuard no_grad;
  const sharding::ShardedStateDict sd = s.ShardedState();
  const auto shapes = ParamShapes(s);
  const auto aliases = TiedAliases(s, sd);
  const int64_t rank = s.rank();
  dcp::RankFileWriter file(ShardedTempDir(path), dcp::RankFileName(rank));
  dcp::Metadata part;
  const std::string kind = OptimizerKind(opt);
  const auto params = OptimizerParams(opt);
  const std::set<std::string> optimized = OptimizedNames(groups);
  std::vector<int64_t> steps;
  if (!kind.empty()) steps = s.ShardedOptimizerSteps(params, StatesOf(opt, params));
  // HYBRID_SHARD and NO_SHARD replicas hold equal shards: the first replica
  // (shard groups are consecutive ranks) writes them, as DCP keeps one copy.
  const bool writes_shards = rank < sd.shard_world;
  for (size_t u = 0; writes_shards && u < sd.units.size(); ++u) {
    const at::Tensor shard = sd.shards[u].to(at::kFloat);  // the live shard on the CPU (no copy)
    const int64_t base = sd.shard_rank * sd.units[u].shard_numel;
    // This unit's optimizer state laid out like its shard (copied out of the optimizer only for this unit).
    const std::map<std::string, at::Tensor> ostate =
        kind.empty() ? std::map<std::string, at::Tensor>{} : s.ShardedOptimizerUnit(params, StatesOf(opt, params), static_cast<int>(u));
    for (const Part& p : PartsInShard(sd, u, shapes)) {
      const bool has_state = optimized.count(p.name) && !ostate.empty();
      for (const dcp::Box& box : dcp::BoxesOfRange(p.shape, p.begin, p.end)) {
        const int64_t src = p.at + dcp::FlatIndex(p.shape, box.offsets) - base;
        auto piece = [&](const at::Tensor& flat) { return flat.narrow(0, src, box.numel()).view(box.sizes); };
        const dcp::Chunk chunk{box, file.AddTensor(piece(shard))};
        AddDcpChunk(part, DcpModelPath(p.name), at::kFloat, p.shape, chunk);
        for (const auto& [alias, primary] : aliases) {
          if (primary == p.name) AddDcpChunk(part, DcpModelPath(alias), at::kFloat, p.shape, chunk);  // same bytes
        }
        if (!has_state) continue;
        for (const auto& [key, t] : ostate) {
          AddDcpChunk(part, DcpOptimizerStatePath(p.name, key), at::kFloat, p.shape,
                      {box, file.AddTensor(piece(t.to(at::kFloat)))});
        }
      }
      // Adam's step: a 0-d float32 tensor, as torch.optim keeps it; written by
      // the rank holding the parameter's first element.
      if (has_state && p.begin == 0 && steps[u] >= 0) {
        const at::Tensor step = at::full({}, static_cast<double>(steps[u]), at::kFloat);
        AddDcpChunk(part, DcpOptimizerStatePath(p.name, "step"), at::kFloat, {}, {{}, file.AddTensor(step)});
      }
    }
  }
  if (rank == 0) {
    for (const auto& [name, b] : sd.buffers) {
      dcp::Box whole{std::vector<int64_t>(b.dim(), 0), b.sizes().vec()};
      AddDcpChunk(part, DcpModelPath(name), b.scalar_type(), b.sizes().vec(), {whole, file.AddTensor(b)});
    }
    WriteDcpParamGroups(file, groups, part);
  }
  if (kind.empty()) {  // another optimizer: its LibTorch archive, per rank
    const std::string bytes = SerializeOptimizer(opt);
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    AddDcpChunk(part, ArchivePath(rank), at::kByte, {t.numel()}, {{{0}, {t.numel()}}, file.AddTensor(t)});
  }
  file.Finish();
  WriteDcpPart(path, rank, part);
}

namespace {

// One copy of `len` elements from a chunk (flattened, at `src`) to `dst` in a unit's shard.
struct RunCopy {
  at::Tensor chunk;  // a view of the mapped file, flattened
  int64_t src = 0, dst = 0, len = 0;
};

// Plans the copies that fill a parameter's elements [p.begin, p.end) of the
// tensor `key`, at their place in the shard (p.at - base); checks that the
// chunks cover them. Problems are added to `problems`.
void PlanPart(const dcp::Reader& r, const std::string& key, const Part& p, int64_t base,
              std::map<const dcp::Chunk*, at::Tensor>& opened, std::vector<RunCopy>& out, std::ostringstream& problems) {
  auto it = r.metadata().tensors.find(key);
  if (it == r.metadata().tensors.end()) {
    problems << "\n  missing: '" << key << "' (" << c10::IntArrayRef(p.shape) << ")";
    return;
  }
  const dcp::TensorEntry& e = it->second;
  if (e.shape != p.shape) {
    problems << "\n  shape mismatch: '" << key << "' is " << c10::IntArrayRef(e.shape) << " in the checkpoint, "
             << c10::IntArrayRef(p.shape) << " in the model";
    return;
  }
  if (!at::isFloatingType(e.dtype)) {
    problems << "\n  dtype: '" << key << "' is " << e.dtype << " in the checkpoint; a parameter loads from floating point";
    return;
  }
  int64_t covered = 0;
  for (const dcp::Chunk& c : e.chunks) {
    dcp::ForEachRun(e.shape, c.box, [&](int64_t at, int64_t in_box, int64_t len) {
      const int64_t b = std::max(at, p.begin), en = std::min(at + len, p.end);
      if (b >= en) return;
      at::Tensor& t = opened[&c];
      if (!t.defined()) {
        t = r.ReadChunk(key, c);  // parses the item, touches no data
        t = t.is_contiguous() ? t.view({-1}) : t.contiguous().view({-1});
      }
      out.push_back({t, in_box + (b - at), p.at + b - base, en - b});
      covered += en - b;
    });
  }
  if (covered != p.end - p.begin) {
    problems << "\n  incomplete: the checkpoint's chunks of '" << key << "' cover " << covered << " of the "
             << p.end - p.begin << " elements this rank needs";
  }
}

void RunCopies(at::Tensor& dst, const std::vector<RunCopy>& copies) {
  for (const RunCopy& c : copies) {
    dst.narrow(0, c.dst, c.len).copy_(c.chunk.narrow(0, c.src, c.len));
    sharding::SourceReleaseScope::Release(c.chunk);  // a mapped chunk's pages go once its run is copied
  }
}

// The model's buffers from the file (full, small: assembled now), and the
// file's model tensors that the model does not have, added to `problems`.
std::map<std::string, at::Tensor> BuffersAndUnexpected(const DcpCheckpoint& ck, const sharding::ShardedStateDict& sd,
                                                       const std::map<std::string, std::vector<int64_t>>& shapes,
                                                       std::ostringstream& problems) {
  const dcp::Reader& r = *ck.reader;
  std::map<std::string, at::Tensor> buffers;
  for (const auto& [name, b] : sd.buffers) {
    const std::string key = ck.model_prefix + name;
    auto it = r.metadata().tensors.find(key);
    if (it == r.metadata().tensors.end()) {
      problems << "\n  missing buffer: '" << key << "'";
    } else if (it->second.shape != b.sizes().vec()) {
      problems << "\n  shape mismatch: buffer '" << key << "' is " << c10::IntArrayRef(it->second.shape)
               << " in the checkpoint, " << b.sizes() << " in the model";
    } else {
      buffers[name] = AssembleDcpTensor(r, key).to(b.scalar_type());
    }
  }
  // Tensors of the model's part of the file that the model does not have.
  for (const auto& [key, e] : r.metadata().tensors) {
    if (key.compare(0, ck.model_prefix.size(), ck.model_prefix) != 0) continue;
    if (!ck.optimizer_prefix.empty() && key.compare(0, ck.optimizer_prefix.size(), ck.optimizer_prefix) == 0) continue;
    if (key.rfind("shardtrain.", 0) == 0) continue;
    const std::string name = key.substr(ck.model_prefix.size());
    if (!shapes.count(name) && !sd.buffers.count(name)) problems << "\n  unexpected: '" << key << "'";
  }
  return buffers;
}

// This rank's LibTorch archive of an optimizer other than Adam, AdamW and
// SGD: only at the world size and strategy that saved it ("" and a problem
// otherwise; "" when the file holds none).
std::string ArchiveForThisRank(strategies::Strategy& s, const DcpCheckpoint& ck, std::ostringstream& problems) {
  const dcp::Reader& r = *ck.reader;
  const std::string key = dcp::FlatKey(ArchivePath(s.rank()));
  if (ck.meta.world_size == s.world_size() && ck.meta.strategy == s.name() && r.metadata().tensors.count(key)) {
    at::Tensor t = AssembleDcpTensor(r, key);
    return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), t.numel());
  }
  if (r.metadata().tensors.count(dcp::FlatKey(ArchivePath(0)))) {
    problems << "\n  the checkpoint holds the optimizer's state for " << ck.meta.world_size << " ranks ("
             << ck.meta.strategy << ") and this run has " << s.world_size() << " (" << s.name()
             << "); only Adam, AdamW and SGD state loads at another world size or strategy";
  }
  return "";
}

}  // namespace

std::function<void()> PrepareDcpLoad(strategies::Strategy& s, torch::optim::Optimizer& opt, const DcpCheckpoint& ck,
                                     const std::string& path) {
  ST_CHECK_ARG(s.has_sharded_state(), "strategy '", s.name(), "' is not sharded: it loads sharded checkpoints consolidated");
  at::NoGradGuard no_grad;
  const dcp::Reader& r = *ck.reader;
  const sharding::ShardedStateDict sd = s.ShardedState();
  const auto shapes = ParamShapes(s);  // tied weights' further names too: not "unexpected"
  std::ostringstream problems;
  std::map<const dcp::Chunk*, at::Tensor> opened;
  // Parameters: the copies into each unit's shard.
  std::vector<std::vector<RunCopy>> param_copies(sd.units.size());
  std::vector<std::vector<Part>> parts(sd.units.size());
  for (size_t u = 0; u < sd.units.size(); ++u) {
    const int64_t base = sd.shard_rank * sd.units[u].shard_numel;
    parts[u] = PartsInShard(sd, u, shapes);
    for (const Part& p : parts[u]) PlanPart(r, ck.model_prefix + p.name, p, base, opened, param_copies[u], problems);
  }
  // Buffers (full, small): assembled now; tensors the model does not have.
  std::map<std::string, at::Tensor> buffers = BuffersAndUnexpected(ck, sd, shapes, problems);
  // Optimizer state: the same plan per state key.
  const std::string kind = OptimizerKind(opt);
  const auto params = OptimizerParams(opt);
  std::vector<std::map<std::string, std::vector<RunCopy>>> state_copies(sd.units.size());
  std::vector<int64_t> unit_steps(sd.units.size(), -1);
  const bool has_state = !ck.optimizer_state_keys.empty();
  if (has_state && kind.empty()) {
    problems << "\n  the checkpoint holds torch.optim state, which loads into Adam, AdamW or SGD only; this run's "
                "optimizer is another kind";
  } else if (has_state && !ck.optimizer_kind.empty() && ck.optimizer_kind != kind) {
    problems << "\n  the checkpoint holds " << ck.optimizer_kind << " optimizer state but this run's optimizer is " << kind;
  }
  const std::set<std::string> valid_keys = kind == "SGD" ? std::set<std::string>{"momentum_buffer"}
                                                         : std::set<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"};
  for (size_t u = 0; has_state && !kind.empty() && u < sd.units.size(); ++u) {
    const int64_t base = sd.shard_rank * sd.units[u].shard_numel;
    for (const Part& p : parts[u]) {
      auto it = ck.optimizer_state_keys.find(p.name);
      if (it == ck.optimizer_state_keys.end()) continue;
      for (const auto& [k, key] : it->second) {
        if (!valid_keys.count(k)) {
          problems << "\n  optimizer state '" << key << "' is not " << kind << "'s";
        } else if (k == "step") {
          unit_steps[u] = std::max(unit_steps[u], static_cast<int64_t>(AssembleDcpTensor(r, key).item<double>()));
        } else {
          PlanPart(r, key, p, base, opened, state_copies[u][k], problems);
        }
      }
    }
  }
  // Another optimizer's LibTorch archive (same world size and strategy only).
  const std::string archive = kind.empty() ? ArchiveForThisRank(s, ck, problems) : std::string();
  if (!problems.str().empty()) {
    ST_THROW(Error, "checkpoint '", path, "' does not match the model (nothing was loaded):", problems.str());
  }
  std::vector<int64_t> shard_numels;
  for (const auto& unit : sd.units) shard_numels.push_back(unit.shard_numel);
  return [&s, &opt, kind, params, shard_numels, param_copies = std::move(param_copies), buffers = std::move(buffers),
          state_copies = std::move(state_copies), unit_steps = std::move(unit_steps), has_state, archive, path] {
    s.LoadShardsWith([&](size_t u, at::Tensor& shard) { RunCopies(shard, param_copies[u]); }, buffers);
    if (!archive.empty()) {
      LoadOptimizerArchive(opt, archive, path);
      return;
    }
    if (!has_state || kind.empty()) return;
    auto states = s.OptimizerStatesFromUnits(params, [&](size_t u) {
      sharding::UnitShardState st;
      if (u >= shard_numels.size()) return st;
      for (const auto& [k, copies] : state_copies[u]) {
        at::Tensor t = at::zeros({shard_numels[u]}, at::kFloat);
        RunCopies(t, copies);
        st.tensors[k] = t;
      }
      st.step = unit_steps[u];
      return st;
    });
    for (size_t i = 0; i < params.size(); ++i) SetState(opt, kind, params[i], states[i]);
  };
}

}  // namespace shardtrain::trainer::internal
