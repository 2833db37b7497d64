#include "trainer/checkpoint_io/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <stdio.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <set>

#include "base/errors.h"
#include "base/file_util.h"
#include "sharding/sharded_state.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/pickle_scan.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "shardtrain.sharded";

c10::impl::GenericDict NewDict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

at::Tensor BytesTensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr<uint8_t>(), s.data(), s.size());
  return t;
}

std::string TensorBytes(const at::Tensor& t) {
  at::Tensor b = t.contiguous();
  return std::string(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()), b.numel());
}

void WritePickle(const std::string& path, const c10::IValue& v) { WriteFileAtomically(path, PickleSavePlain(v)); }

// Files written by PickleSavePlain read back with lists of Any; older ones
// (torch::pickle_save) with typed int lists. Either way: the ints.
std::vector<int64_t> IntList(const c10::IValue& v) {
  if (v.isIntList()) return v.toIntVector();
  std::vector<int64_t> out;
  for (const auto& e : v.toListRef()) out.push_back(e.toInt());
  return out;
}

c10::impl::GenericDict ReadPickleDict(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) ST_THROW(Error, what, " '", path, "' cannot be opened");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue v;
  try {
    ScanPickleArchive(bytes, what + " '" + path + "'");  // before LibTorch reserves its lengths
    v = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    ST_THROW(Error, what, " '", path, "' is truncated or corrupt (", bytes.size(), " bytes; cannot be read: ",
             msg.substr(0, msg.find('\n')), ")");
  }
  if (!v.isGenericDict()) ST_THROW(Error, what, " '", path, "' is not a ShardTrain sharded checkpoint file");
  if (const std::string bad = UnloadableTensorIn(v); !bad.empty())
    ST_THROW(Error, what, " '", path, "' is corrupt: it holds ", bad);
  return v.toGenericDict();
}

// A rank file mapped, not read: its tensors are views of the file's pages,
// read only where a loader touches them.
c10::impl::GenericDict MapPieceDict(const std::string& path) {
  c10::IValue v;
  try {
    v = MapArchive(path);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    ST_THROW(Error, "sharded checkpoint file '", path, "' is truncated or corrupt (", ec ? 0 : size,
             " bytes; cannot be read: ", msg.substr(0, msg.find('\n')), ")");
  }
  if (!v.isGenericDict()) ST_THROW(Error, "sharded checkpoint file '", path, "' is not a ShardTrain sharded checkpoint file");
  return v.toGenericDict();
}

fs::path ParentOf(const fs::path& p) { return p.has_parent_path() ? p.parent_path() : fs::path("."); }

// The piece as the root object of its file; `add` turns each tensor into
// what the root holds (ArchiveWriter::Add: written now, a placeholder kept).
c10::IValue PieceToIValue(const ShardedPiece& p, const std::function<at::Tensor(const at::Tensor&)>& add) {
  auto d = NewDict();
  d.insert("rank", p.rank);
  d.insert("world_size", p.world_size);
  d.insert("shard_rank", static_cast<int64_t>(p.state.shard_rank));
  d.insert("shard_world", static_cast<int64_t>(p.state.shard_world));
  c10::impl::GenericList units(c10::AnyType::get());
  for (size_t i = 0; i < p.state.units.size(); ++i) {
    const auto& u = p.state.units[i];
    auto ud = NewDict();
    ud.insert("name", u.name);
    c10::List<std::string> names;
    for (const auto& n : u.param_names) names.push_back(n);
    ud.insert("param_names", names);
    c10::impl::GenericList shapes(c10::ListType::ofInts());
    for (const auto& s : p.state.param_shapes.at(i)) shapes.push_back(c10::IValue(s));
    ud.insert("param_shapes", shapes);
    ud.insert("numel", u.numel);
    ud.insert("padded_numel", u.padded_numel);
    ud.insert("shard_numel", u.shard_numel);
    units.push_back(ud);
  }
  d.insert("units", units);
  c10::List<at::Tensor> shards;
  for (const auto& s : p.state.shards) shards.push_back(add(s.detach()));
  d.insert("shards", shards);
  c10::Dict<std::string, at::Tensor> buffers;
  for (const auto& [k, v] : p.state.buffers) buffers.insert(k, add(v.detach()));
  d.insert("buffers", buffers);
  auto od = NewDict();
  od.insert("kind", p.optimizer_kind);
  c10::impl::GenericList ounits(c10::AnyType::get());
  const size_t n_units = p.optimizer_unit_source ? p.state.units.size() : p.optimizer.units.size();
  for (size_t i = 0; i < n_units; ++i) {
    // From the source: this unit's state lives only until its tensors are written.
    const std::map<std::string, at::Tensor> m =
        p.optimizer_unit_source ? p.optimizer_unit_source(i) : p.optimizer.units[i];
    c10::Dict<std::string, at::Tensor> md;
    for (const auto& [k, v] : m) md.insert(k, add(v.detach()));
    ounits.push_back(md);
  }
  od.insert("units", ounits);
  od.insert("steps", c10::IValue(p.optimizer.steps));
  od.insert("archive", add(BytesTensor(p.optimizer_archive)));
  d.insert("optimizer", od);
  return d;
}

ShardedPiece PieceFromDict(const c10::impl::GenericDict& d, const std::string& path) {
  auto need = [&](const c10::impl::GenericDict& m, const char* key) {
    if (!m.contains(key)) ST_THROW(Error, "sharded checkpoint file '", path, "' has no '", key, "' entry");
    return m.at(key);
  };
  ShardedPiece p;
  try {
    p.rank = need(d, "rank").toInt();
    p.world_size = need(d, "world_size").toInt();
    const int64_t shard_rank = need(d, "shard_rank").toInt();
    const int64_t shard_world = need(d, "shard_world").toInt();
    if (shard_world < 1 || shard_world > std::numeric_limits<int>::max() || shard_rank < 0 || shard_rank >= shard_world) {
      ST_THROW(Error, "sharded checkpoint file '", path, "': shard rank ", shard_rank, " outside [0, ", shard_world, ")");
    }
    p.state.shard_rank = static_cast<int>(shard_rank);
    p.state.shard_world = static_cast<int>(shard_world);
    for (const auto& uv : need(d, "units").toListRef()) {
      auto ud = uv.toGenericDict();
      sharding::UnitInfo u;
      std::vector<std::vector<int64_t>> shapes;
      u.name = need(ud, "name").toStringRef();
      for (const auto& n : need(ud, "param_names").toListRef()) u.param_names.push_back(n.toStringRef());
      for (const auto& s : need(ud, "param_shapes").toListRef()) shapes.push_back(IntList(s));
      u.numel = need(ud, "numel").toInt();
      u.padded_numel = need(ud, "padded_numel").toInt();
      u.shard_numel = need(ud, "shard_numel").toInt();
      p.state.units.push_back(std::move(u));
      p.state.param_shapes.push_back(std::move(shapes));
    }
    for (const auto& t : need(d, "shards").toListRef()) p.state.shards.push_back(t.toTensor());
    for (const auto& e : need(d, "buffers").toGenericDict()) {
      p.state.buffers[e.key().toStringRef()] = e.value().toTensor();
    }
    auto od = need(d, "optimizer").toGenericDict();
    p.optimizer_kind = need(od, "kind").toStringRef();
    for (const auto& mv : need(od, "units").toListRef()) {
      std::map<std::string, at::Tensor> m;
      for (const auto& e : mv.toGenericDict()) m[e.key().toStringRef()] = e.value().toTensor();
      p.optimizer.units.push_back(std::move(m));
    }
    p.optimizer.steps = IntList(need(od, "steps"));
    p.optimizer_archive = TensorBytes(need(od, "archive").toTensor());
  } catch (const c10::Error& e) {
    std::string what = e.what();
    ST_THROW(Error, "sharded checkpoint file '", path, "' has an unexpected layout: ", what.substr(0, what.find('\n')));
  }
  return p;
}

// The same units with the same saved shapes (the shards themselves differ).
bool SameUnits(const sharding::ShardedStateDict& sa, const sharding::ShardedStateDict& sb) {
  const auto& a = sa.units;
  const auto& b = sb.units;
  if (a.size() != b.size() || sa.param_shapes != sb.param_shapes) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].param_names != b[i].param_names || a[i].numel != b[i].numel ||
        a[i].padded_numel != b[i].padded_numel || a[i].shard_numel != b[i].shard_numel) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string ShardedPieceFileName(int64_t rank) { return "rank_" + std::to_string(rank) + ".pt"; }

bool IsShardedCheckpoint(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

std::string ShardedTempDir(const std::string& path) {
  fs::path p = fs::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return (ParentOf(p) / ("." + p.filename().string() + ".tmp-sharded")).string();
}

void BeginShardedSave(const std::string& path) {
  const fs::path tmp = ShardedTempDir(path);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (ec) ST_THROW(Error, "cannot remove the stale temporary directory '", tmp.string(), "': ", ec.message());
  fs::create_directories(tmp, ec);
  if (ec) ST_THROW(Error, "cannot create the temporary directory '", tmp.string(), "': ", ec.message());
}

void WriteShardedPiece(const std::string& path, const ShardedPiece& piece) {
  const fs::path tmp = ShardedTempDir(path);
  if (!fs::is_directory(tmp)) {
    ST_THROW(Error, "sharded save of '", path, "': temporary directory '", tmp.string(), "' does not exist");
  }
  // Streamed: each tensor's bytes go to the file from the tensor itself (no
  // copy of a CPU shard, no pickled copy of the whole file in memory).
  ArchiveWriter writer((tmp / ShardedPieceFileName(piece.rank)).string());
  writer.Finish(PieceToIValue(piece, [&](const at::Tensor& t) { return writer.Add(t); }));
}

void FinishShardedSave(const std::string& path, const CheckpointData& meta) {
  const fs::path tmp = ShardedTempDir(path);
  c10::List<std::string> files;
  for (int64_t r = 0; r < meta.world_size; ++r) {
    const fs::path f = tmp / ShardedPieceFileName(r);
    if (!fs::exists(f)) ST_THROW(Error, "sharded save of '", path, "': rank ", r, " did not write '", f.string(), "'");
    files.push_back(ShardedPieceFileName(r));
  }
  auto d = NewDict();
  d.insert("format", std::string(kFormat));
  d.insert("format_version", kShardedCheckpointFormatVersion);
  d.insert("world_size", meta.world_size);
  d.insert("epoch", meta.epoch);
  d.insert("global_step", meta.global_step);
  d.insert("batch_in_epoch", meta.batch_in_epoch);
  d.insert("strategy", meta.strategy);
  d.insert("rng_state", meta.rng_state.defined() ? meta.rng_state.cpu() : at::empty({0}, at::kByte));
  if (!meta.cuda_rng_states.empty()) {
    c10::List<at::Tensor> states;
    for (const auto& t : meta.cuda_rng_states) states.push_back(t.cpu());
    d.insert("cuda_rng_states", states);
  }
  d.insert("hyper_parameters", StateDictToIValue(meta.hparams));
  auto cbs = NewDict();
  for (const auto& [key, st] : meta.callbacks) cbs.insert(key, StateDictToIValue(st));
  d.insert("callbacks", cbs);
  d.insert("optimizer_groups", OptimizerGroupsToIValue(meta.optimizer_groups));
  if (meta.grad_scaler) d.insert("grad_scaler", GradScalerStateToIValue(*meta.grad_scaler));
  if (!meta.lr_schedulers.empty()) d.insert("lr_schedulers", LRSchedulerStatesToIValue(meta.lr_schedulers));
  d.insert("files", files);
  WritePickle((tmp / kShardedMetadataFile).string(), d);
  // The marker goes last: a directory without it is never loaded.
  WriteFileAtomically((tmp / kShardedCompleteMarker).string(),
                      "shardtrain sharded checkpoint, format version " +
                          std::to_string(kShardedCheckpointFormatVersion) + "\n");
  CommitShardedDir(path);
}

void CommitShardedDir(const std::string& path) {
  const fs::path tmp = ShardedTempDir(path);
  const fs::path target = fs::path(path).lexically_normal();
  SyncDirectory(tmp.string());
  std::error_code ec;
  const bool existed = fs::exists(fs::symlink_status(target, ec));
  if (!existed) {
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      ST_THROW(Error, "cannot rename '", tmp.string(), "' to '", target.string(), "': ", std::strerror(errno));
    }
  } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp, ec);  // now the previous checkpoint
  } else {
    // No atomic exchange on this file system: move the old one aside first.
    const fs::path old = ParentOf(target) / ("." + target.filename().string() + ".old-sharded");
    fs::remove_all(old, ec);
    if (::rename(target.c_str(), old.c_str()) != 0) {
      ST_THROW(Error, "cannot move the previous checkpoint '", target.string(), "' aside: ", std::strerror(errno));
    }
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      const int err = errno;
      ::rename(old.c_str(), target.c_str());
      ST_THROW(Error, "cannot rename '", tmp.string(), "' to '", target.string(), "': ", std::strerror(err));
    }
    fs::remove_all(old, ec);
  }
  SyncDirectory(ParentOf(target).string());
}

void SaveShardedCheckpoint(const std::string& path, const ShardedCheckpoint& ckpt) {
  BeginShardedSave(path);
  for (const auto& p : ckpt.pieces) WriteShardedPiece(path, p);
  CheckpointData meta = ckpt.meta;
  meta.world_size = static_cast<int64_t>(ckpt.pieces.size());
  FinishShardedSave(path, meta);
}

namespace {

// metadata.pt of the sharded checkpoint `path`: the loop position, RNG state,
// hyperparameters and callback states, and the rank files it lists.
CheckpointData ReadShardedMetadata(const std::string& path, const std::string& meta_path,
                                   std::vector<std::string>* files) {
  auto md = ReadPickleDict(meta_path, "sharded checkpoint metadata");
  CheckpointData m;
  try {
    if (!md.contains("format") || md.at("format").toStringRef() != kFormat) {
      ST_THROW(Error, "'", meta_path, "' is not ShardTrain sharded checkpoint metadata");
    }
    const int64_t version = md.at("format_version").toInt();
    if (version > kShardedCheckpointFormatVersion) {
      ST_THROW(Error, "sharded checkpoint '", path, "' has format version ", version, "; this build reads up to ",
               kShardedCheckpointFormatVersion);
    }
    m.world_size = md.at("world_size").toInt();
    m.epoch = md.at("epoch").toInt();
    m.global_step = md.at("global_step").toInt();
    m.batch_in_epoch = md.at("batch_in_epoch").toInt();
    m.strategy = md.at("strategy").toStringRef();
    m.rng_state = md.at("rng_state").toTensor();
    if (md.contains("cuda_rng_states")) {
      for (const auto& t : md.at("cuda_rng_states").toList()) m.cuda_rng_states.push_back(t.get().toTensor());
    }
    if (md.contains("hyper_parameters")) {
      m.hparams = StateDictFromIValue(md.at("hyper_parameters"));
    } else {  // format 1: strings
      for (const auto& e : md.at("hparams").toGenericDict()) {
        m.hparams[e.key().toStringRef()] = StateValue::Infer(e.value().toStringRef());
      }
    }
    for (const auto& e : md.at("callbacks").toGenericDict()) {
      m.callbacks[e.key().toStringRef()] = StateDictFromIValue(e.value());
    }
    if (md.contains("optimizer_groups")) m.optimizer_groups = OptimizerGroupsFromIValue(md.at("optimizer_groups"));
    if (md.contains("grad_scaler")) m.grad_scaler = GradScalerStateFromIValue(md.at("grad_scaler"));
    if (md.contains("lr_schedulers")) m.lr_schedulers = LRSchedulerStatesFromIValue(md.at("lr_schedulers"));
    for (const auto& f : md.at("files").toListRef()) files->push_back(f.toStringRef());
  } catch (const c10::Error& e) {
    std::string what = e.what();
    ST_THROW(Error, "sharded checkpoint metadata '", meta_path, "' has an unexpected layout: ",
             what.substr(0, what.find('\n')));
  } catch (const std::out_of_range& e) {  // c10::Dict::at on a missing key (fuzzer finding)
    ST_THROW(Error, "sharded checkpoint metadata '", meta_path, "' has an unexpected layout: an entry is missing (",
             e.what(), ")");
  }
  return m;
}

// Checks that the piece read from `file` is rank `r` of `W`, that its units'
// sizes, shards and optimizer state agree with each other, and that its units,
// shard group and optimizer agree with rank 0's piece (`first`, null for rank 0).
void CheckPiece(const ShardedPiece& p, int64_t r, int64_t W, const ShardedPiece* first, const std::string& file) {
  auto bad = [&](const auto&... what) { ST_THROW(Error, "sharded checkpoint file '", file, "': ", what...); };
  if (p.rank != r || p.world_size != W) {
    bad("holds rank ", p.rank, " of ", p.world_size, ", expected rank ", r, " of ", W);
  }
  const sharding::ShardedStateDict& s = p.state;  // shard rank and world checked when read
  if (s.shards.size() != s.units.size()) bad(s.shards.size(), " unit shards for ", s.units.size(), " units");
  for (size_t i = 0; i < s.units.size(); ++i) {
    const auto& u = s.units[i];
    const auto& shapes = s.param_shapes[i];  // read with the unit
    if (u.param_names.size() != shapes.size()) bad("unit '", u.name, "' names and shapes disagree");
    int64_t n = 0;
    for (const auto& shape : shapes) n += c10::multiply_integers(shape);
    if (n != u.numel || u.shard_numel * s.shard_world != u.padded_numel || u.padded_numel < u.numel) {
      bad("unit '", u.name, "' has inconsistent sizes");
    }
    if (s.shards[i].numel() != u.shard_numel) {
      bad("unit '", u.name, "' shard has ", s.shards[i].numel(), " elements, expected ", u.shard_numel);
    }
  }
  const auto& o = p.optimizer;
  if (!o.units.empty()) {
    if (o.units.size() != s.units.size() || o.steps.size() != s.units.size()) {
      bad("optimizer state for ", o.units.size(), " units, expected ", s.units.size());
    }
    for (size_t i = 0; i < s.units.size(); ++i) {
      for (const auto& [k, t] : o.units[i]) {
        if (t.numel() != s.units[i].shard_numel) {
          bad("optimizer state '", k, "' of unit '", s.units[i].name, "' has the wrong size");
        }
      }
    }
  }
  if (first) {
    if (s.shard_world != first->state.shard_world || !SameUnits(s, first->state)) {
      bad("its units or shard group disagree with rank 0's file");
    }
    if (p.optimizer_kind != first->optimizer_kind) {
      bad("optimizer '", p.optimizer_kind, "' but rank 0's file has '", first->optimizer_kind, "'");
    }
  }
}

}  // namespace

ShardedCheckpoint LoadShardedCheckpoint(const std::string& path) {
  const fs::path dir(path);
  std::error_code ec;
  if (!fs::exists(dir, ec)) ST_THROW(Error, "cannot open checkpoint '", path, "': it does not exist");
  if (!fs::is_directory(dir, ec)) ST_THROW(Error, "checkpoint '", path, "' is not a sharded checkpoint directory");
  if (!fs::exists(dir / kShardedMetadataFile, ec) && !fs::exists(dir / kShardedCompleteMarker, ec)) {
    // Not this format's: a DCP directory (what sharded saves write) is complete once .metadata is there.
    ST_THROW(Error, "sharded checkpoint '", path, "' is incomplete: '", (dir / ".metadata").string(),
             "' is missing (the save did not finish, or this is not a checkpoint directory)");
  }
  if (!fs::exists(dir / kShardedCompleteMarker, ec)) {
    ST_THROW(Error, "sharded checkpoint '", path, "' is incomplete: '", (dir / kShardedCompleteMarker).string(),
             "' is missing (the save did not finish)");
  }
  const std::string meta_path = (dir / kShardedMetadataFile).string();
  if (!fs::exists(meta_path, ec)) {
    ST_THROW(Error, "sharded checkpoint '", path, "' is missing its metadata file '", meta_path, "'");
  }
  ShardedCheckpoint ck;
  std::vector<std::string> files;
  ck.meta = ReadShardedMetadata(path, meta_path, &files);
  const int64_t W = ck.meta.world_size;
  if (W < 1 || static_cast<int64_t>(files.size()) != W) {
    ST_THROW(Error, "sharded checkpoint metadata '", meta_path, "' lists ", files.size(), " rank files for world size ",
             W);
  }
  // Every file must be there before any is read.
  for (int64_t r = 0; r < W; ++r) {
    const fs::path f = dir / files[r];
    if (!fs::exists(f, ec)) {
      ST_THROW(Error, "sharded checkpoint '", path, "' is missing the shard file '", f.string(), "' (rank ", r, " of ",
               W, ")");
    }
  }
  for (int64_t r = 0; r < W; ++r) {
    const std::string f = (dir / files[r]).string();
    ShardedPiece p = PieceFromDict(MapPieceDict(f), f);
    CheckPiece(p, r, W, ck.pieces.empty() ? nullptr : &ck.pieces.front(), f);
    ck.pieces.push_back(std::move(p));
  }
  std::vector<bool> seen(ck.pieces.front().state.shard_world, false);
  for (const auto& p : ck.pieces) seen[p.state.shard_rank] = true;
  for (size_t s = 0; s < seen.size(); ++s) {
    if (!seen[s]) ST_THROW(Error, "sharded checkpoint '", path, "' has no file holding shard rank ", s);
  }
  return ck;
}

}  // namespace shardtrain::trainer
