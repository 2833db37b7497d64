// Loading a sharded checkpoint in PyTorch DCP's layout (trainer/checkpoint_io/
// dcp_checkpoint.h) into a sharded strategy's flat shards: a rank's shard of
// a unit is a range of the unit's parameters laid end to end, and DCP stores
// boxes of each parameter's global shape, so the boxes of the file are cut
// into the runs that overlap a rank's range. (Saving:
// trainer/connectors/dcp_rank_writer.cc.)
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "sharding/source_release.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/connectors/internal/checkpoint_state.h"
#include "trainer/connectors/internal/dcp_rank_writer.h"

namespace shardtrain::trainer::internal {
namespace {

// One copy of `len` elements from a chunk (flattened, at `src`) to `dst` in a unit's shard.
struct RunCopy {
  at::Tensor chunk;  // a view of the mapped file, flattened
  int64_t src = 0, dst = 0, len = 0;
};

// The elements of chunk `c` of `key` in `pair.global` (its part that `p`
// stores), flattened: a view of the mapped file for a whole chunk, a copy of
// the part otherwise.
at::Tensor ChunkPart(const dcp::Reader& r, const std::string& key, const dcp::Chunk& c, const ShardPart& p,
                     const BoxPair& pair, std::map<const dcp::Chunk*, at::Tensor>& opened) {
  at::Tensor& t = opened[&c];
  if (!t.defined()) {
    t = r.ReadChunk(key, c);  // parses the item, touches no data
    t = t.is_contiguous() ? t.view({-1}) : t.contiguous().view({-1});
  }
  if (pair.global == c.box) return t;
  at::Tensor part = t.view(c.box.sizes);
  for (size_t d = 0; d < c.box.sizes.size(); ++d) {
    part = part.narrow(static_cast<int64_t>(d), pair.global.offsets[d] - c.box.offsets[d], pair.global.sizes[d]);
  }
  return part.contiguous().view({-1});
}

// Plans the copies that fill a parameter's elements [p.begin, p.end) of the
// tensor `key`, at their place in the shard (p.at - base); checks that the
// chunks cover them. Problems are added to `problems`.
void PlanPart(const dcp::Reader& r, const std::string& key, const ShardPart& p, int64_t base,
              std::map<const dcp::Chunk*, at::Tensor>& opened, std::vector<RunCopy>& out,
              std::ostringstream& problems) {
  auto it = r.metadata().tensors.find(key);
  if (it == r.metadata().tensors.end()) {
    problems << "\n  missing: '" << key << "' (" << c10::IntArrayRef(p.shape) << ")";
    return;
  }
  const dcp::TensorEntry& e = it->second;
  if (e.shape != p.global_shape) {
    problems << "\n  shape mismatch: '" << key << "' is " << c10::IntArrayRef(e.shape) << " in the checkpoint, "
             << c10::IntArrayRef(p.global_shape) << " in the model";
    return;
  }
  if (!at::isFloatingType(e.dtype)) {
    problems << "\n  dtype: '" << key << "' is " << e.dtype << " in the checkpoint; a parameter loads from floating point";
    return;
  }
  int64_t covered = 0;
  for (const dcp::Chunk& c : e.chunks) {
    for (const BoxPair& pair : StoredBoxes(p, c.box)) {  // a tensor-parallel piece: what it holds of the chunk
      at::Tensor t;
      dcp::ForEachRun(p.shape, pair.stored, [&](int64_t at, int64_t in_box, int64_t len) {
        const int64_t b = std::max(at, p.begin), en = std::min(at + len, p.end);
        if (b >= en) return;
        if (!t.defined()) t = ChunkPart(r, key, c, p, pair, opened);
        out.push_back({t, in_box + (b - at), p.at + b - base, en - b});
        covered += en - b;
      });
    }
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
  const std::string key = dcp::FlatKey(DcpArchivePath(s.rank()));
  if (ck.meta.world_size == s.world_size() && ck.meta.strategy == s.name() && r.metadata().tensors.count(key)) {
    at::Tensor t = AssembleDcpTensor(r, key);
    return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), t.numel());
  }
  if (r.metadata().tensors.count(dcp::FlatKey(DcpArchivePath(0)))) {
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
  const auto stored = StoredShapes(s);
  std::ostringstream problems;
  std::map<const dcp::Chunk*, at::Tensor> opened;
  // Parameters: the copies into each unit's shard.
  std::vector<std::vector<RunCopy>> param_copies(sd.units.size());
  std::vector<std::vector<ShardPart>> parts(sd.units.size());
  for (size_t u = 0; u < sd.units.size(); ++u) {
    const int64_t base = sd.shard_rank * sd.units[u].shard_numel;
    parts[u] = PartsInShard(sd, u, stored);
    for (const ShardPart& p : parts[u])
      PlanPart(r, ck.model_prefix + p.name, p, base, opened, param_copies[u], problems);
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
    for (const ShardPart& p : parts[u]) {
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
