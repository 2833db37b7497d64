#include "trainer/checkpoint_io/dcp_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <filesystem>
#include <set>

#include "base/errors.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;
namespace {

constexpr const char* kModel = "model";
constexpr const char* kOptimizer = "optimizer_0";

std::string PartFileName(int64_t rank) { return ".part_" + std::to_string(rank) + ".metadata"; }

// Adds `part` (one rank's) to `md`; a tensor both name must agree on dtype and shape.
void Merge(dcp::Metadata& md, const dcp::Metadata& part, const std::string& file) {
  for (const auto& [key, e] : part.tensors) {
    auto [it, fresh] = md.tensors.emplace(key, dcp::TensorEntry{e.dtype, e.shape, {}});
    if (!fresh && (it->second.dtype != e.dtype || it->second.shape != e.shape)) {
      ST_THROW(Error, "sharded save: '", file, "' has '", key, "' as ", e.dtype, " ", c10::IntArrayRef(e.shape),
               ", another rank as ", it->second.dtype, " ", c10::IntArrayRef(it->second.shape));
    }
    it->second.chunks.insert(it->second.chunks.end(), e.chunks.begin(), e.chunks.end());
  }
  for (const auto& [key, l] : part.objects) {
    if (!md.objects.emplace(key, l).second) ST_THROW(Error, "sharded save: '", file, "' writes '", key, "' again");
  }
  for (const auto& [key, p] : part.paths) md.paths[key] = p;
}

// Strips a known prefix ("optimizer_0.state." ...) from the keys; the state's entries by fqn and key.
std::map<std::string, std::map<std::string, std::string>> OptimizerStateKeys(const dcp::Metadata& md,
                                                                            const std::string& prefix) {
  std::map<std::string, std::map<std::string, std::string>> out;
  if (prefix.empty()) return out;
  const std::string state = prefix + "state.";
  for (const auto& [key, e] : md.tensors) {
    if (key.compare(0, state.size(), state) != 0) continue;
    auto p = md.paths.find(key);
    std::string fqn, k;
    if (p != md.paths.end() && p->second.size() == 4) {  // (optimizer, "state", fqn, key)
      fqn = p->second[2].key;
      k = p->second[3].key;
    } else {  // no planner data: the key is the last component
      const std::string rest = key.substr(state.size());
      const size_t dot = rest.rfind('.');
      if (dot == std::string::npos) continue;
      fqn = rest.substr(0, dot);
      k = rest.substr(dot + 1);
    }
    out[fqn][k] = key;
  }
  return out;
}

// The optimizer's groups from its DCP values: options and parameter names per group.
std::vector<OptimizerGroup> GroupsFromValues(const dcp::Reader& r, const std::string& prefix) {
  std::map<int64_t, OptimizerGroup> groups;
  const std::string pg = prefix + "param_groups.";
  for (const auto& [key, where] : r.metadata().objects) {
    if (key.compare(0, pg.size(), pg) != 0) continue;
    const std::string rest = key.substr(pg.size());
    const size_t dot = rest.find('.');
    if (dot == std::string::npos) continue;
    int64_t g = -1;
    try {
      g = std::stoll(rest.substr(0, dot));
    } catch (const std::exception&) {
      continue;
    }
    const std::string option = rest.substr(dot + 1);
    const c10::IValue v = r.ReadObject(key);
    if (option == "params") {
      if (!v.isList()) continue;
      for (const auto& e : v.toListRef()) {
        if (e.isString()) groups[g].params.push_back(e.toStringRef());
      }
    } else {
      c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
      d.insert(option, v);
      for (auto& [k, val] : StateDictFromIValue(d)) groups[g].options[k] = val;
    }
  }
  std::vector<OptimizerGroup> out;
  for (auto& [g, group] : groups) out.push_back(std::move(group));
  return out;
}

std::string KindFromKeys(const std::map<std::string, std::map<std::string, std::string>>& keys) {
  for (const auto& [fqn, ks] : keys) {
    if (ks.count("exp_avg")) return "AdamW";
    if (ks.count("momentum_buffer")) return "SGD";
  }
  return "";
}

}  // namespace

bool IsDcpCheckpoint(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / dcp::kMetadataFile, ec);
}

std::vector<dcp::PathPart> DcpModelPath(const std::string& fqn) { return {{kModel}, {fqn}}; }
std::vector<dcp::PathPart> DcpOptimizerStatePath(const std::string& fqn, const std::string& key) {
  return {{kOptimizer}, {"state"}, {fqn}, {key}};
}
std::vector<dcp::PathPart> DcpParamGroupPath(int64_t group, const std::string& option) {
  return {{kOptimizer}, {"param_groups"}, {"", group}, {option}};
}

void AddDcpChunk(dcp::Metadata& md, const std::vector<dcp::PathPart>& path, at::ScalarType dtype,
                 const std::vector<int64_t>& shape, const dcp::Chunk& chunk) {
  const std::string key = dcp::FlatKey(path);
  dcp::TensorEntry& e = md.tensors[key];
  e.dtype = dtype;
  e.shape = shape;
  e.chunks.push_back(chunk);
  md.paths[key] = path;
}

void AddDcpObject(dcp::Metadata& md, const std::vector<dcp::PathPart>& path, const dcp::Location& where) {
  const std::string key = dcp::FlatKey(path);
  md.objects[key] = where;
  md.paths[key] = path;
}

void WriteDcpParamGroups(dcp::RankFileWriter& file, const std::vector<OptimizerGroup>& groups, dcp::Metadata& md) {
  const c10::IValue all = OptimizerGroupsToIValue(groups);  // [{"param_names", "options"}]
  int64_t g = 0;
  for (const auto& gv : all.toListRef()) {
    const auto d = gv.toGenericDict();
    for (const auto& e : d.at("options").toGenericDict()) {
      AddDcpObject(md, DcpParamGroupPath(g, e.key().toStringRef()), file.AddObject(e.value()));
    }
    AddDcpObject(md, DcpParamGroupPath(g, "params"), file.AddObject(d.at("param_names")));
    ++g;
  }
}

void WriteDcpPart(const std::string& path, int64_t rank, const dcp::Metadata& part) {
  const fs::path tmp = ShardedTempDir(path);
  WriteFileAtomically((tmp / PartFileName(rank)).string(), dcp::MetadataPickle(part, path));
}

void FinishDcpSave(const std::string& path, const CheckpointData& meta, int64_t world_size) {
  const fs::path tmp = ShardedTempDir(path);
  dcp::Metadata md;
  for (int64_t r = 0; r < world_size; ++r) {
    const fs::path part = tmp / PartFileName(r);
    if (!fs::exists(part)) ST_THROW(Error, "sharded save of '", path, "': rank ", r, " did not write '", part.string(), "'");
    Merge(md, dcp::ReadMetadataFile(part.string()), part.string());
  }
  for (const auto& [key, e] : md.tensors) {
    int64_t covered = 0;
    for (const auto& c : e.chunks) covered += c.box.numel();
    const int64_t numel = c10::multiply_integers(e.shape);
    if (covered != numel) {
      ST_THROW(Error, "sharded save of '", path, "': the ranks wrote ", covered, " elements of '", key, "', which has ",
               numel);
    }
  }
  SaveCheckpointMeta((tmp / kDcpMetaFile).string(), meta);
  dcp::WriteMetadata(tmp.string(), md);  // last: DCP's readers look for it
  for (int64_t r = 0; r < world_size; ++r) fs::remove(tmp / PartFileName(r));
  CommitShardedDir(path);
}

DcpCheckpoint OpenDcpCheckpoint(const std::string& path) {
  DcpCheckpoint ck;
  ck.reader = std::make_shared<const dcp::Reader>(path);
  const fs::path meta = fs::path(path) / kDcpMetaFile;
  std::error_code ec;
  if (fs::exists(meta, ec)) {
    ck.meta = LoadCheckpointMeta(meta.string());
    ck.optimizer_kind = ck.meta.optimizer_full.kind;
    ck.meta.optimizer_full = FullOptimizerState();
  } else {
    ck.meta.world_size = 0;  // PyTorch wrote it: no loop state
  }
  const dcp::Metadata& md = ck.reader->metadata();
  auto has_prefix = [&](const std::string& prefix) {
    for (const auto& [k, e] : md.tensors) {
      if (k.compare(0, prefix.size(), prefix) == 0) return true;
    }
    for (const auto& [k, l] : md.objects) {
      if (k.compare(0, prefix.size(), prefix) == 0) return true;
    }
    return false;
  };
  ck.model_prefix = has_prefix(std::string(kModel) + ".") ? std::string(kModel) + "." : "";
  for (const char* p : {"optimizer_0.", "optim.", "optimizer."}) {
    if (has_prefix(p)) {
      ck.optimizer_prefix = p;
      break;
    }
  }
  ck.optimizer_state_keys = OptimizerStateKeys(md, ck.optimizer_prefix);
  if (ck.meta.optimizer_groups.empty() && !ck.optimizer_prefix.empty()) {
    ck.meta.optimizer_groups = GroupsFromValues(*ck.reader, ck.optimizer_prefix);
  }
  return ck;
}

at::Tensor AssembleDcpTensor(const dcp::Reader& reader, const std::string& key) {
  const dcp::TensorEntry& e = reader.metadata().tensors.at(key);
  at::Tensor full = at::zeros(e.shape, at::TensorOptions().dtype(e.dtype));
  for (const auto& c : e.chunks) {
    at::Tensor v = full;
    for (size_t d = 0; d < e.shape.size(); ++d) v = v.narrow(static_cast<int64_t>(d), c.box.offsets[d], c.box.sizes[d]);
    v.copy_(reader.ReadChunk(key, c));
  }
  return full;
}

CheckpointData ConsolidateDcpCheckpoint(const DcpCheckpoint& ck, const std::string& run_kind) {
  CheckpointData out = ck.meta;
  const dcp::Metadata& md = ck.reader->metadata();
  const std::string opt_prefix = ck.optimizer_prefix.empty() ? std::string("\x01") : ck.optimizer_prefix;
  for (const auto& [key, e] : md.tensors) {
    if (key.compare(0, ck.model_prefix.size(), ck.model_prefix) != 0) continue;
    if (ck.model_prefix.empty() && key.compare(0, opt_prefix.size(), opt_prefix) == 0) continue;
    if (key.rfind("shardtrain.", 0) == 0) continue;  // ShardTrain's own (optimizer archives)
    at::Tensor t = AssembleDcpTensor(*ck.reader, key);
    out.state_dict[key.substr(ck.model_prefix.size())] = t;
  }
  // Optimizers other than Adam, AdamW and SGD: their LibTorch archive per rank.
  for (int64_t r = 0;; ++r) {
    const std::string key = "shardtrain.optimizer_archive_" + std::to_string(r);
    if (!md.tensors.count(key)) break;
    at::Tensor t = AssembleDcpTensor(*ck.reader, key);
    out.optimizer_states.emplace_back(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), t.numel());
  }
  if (!ck.optimizer_state_keys.empty()) {
    FullOptimizerState& o = out.optimizer_full;
    o.kind = !ck.optimizer_kind.empty() ? ck.optimizer_kind : !run_kind.empty() ? run_kind
                                                                                 : KindFromKeys(ck.optimizer_state_keys);
    for (const auto& [fqn, keys] : ck.optimizer_state_keys) {
      for (const auto& [k, key] : keys) {
        at::Tensor t = AssembleDcpTensor(*ck.reader, key);
        if (k == "step") {
          o.step[fqn] = static_cast<int64_t>(t.item<double>());
        } else {
          o.state[fqn][k] = t.to(at::kFloat);
        }
      }
    }
  }
  return out;
}

}  // namespace shardtrain::trainer
