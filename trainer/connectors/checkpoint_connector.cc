// The checkpoint connector (trainer/connectors/internal/checkpoint_connector.h):
// writing and loading the Trainer's checkpoints (full and sharded), collective
// over the ranks, and resolving ckpt_path.
#include "trainer/connectors/internal/checkpoint_connector.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/host_memory.h"
#include "sharding/source_release.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/resume.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/connectors/internal/checkpoint_state.h"
#include "trainer/connectors/internal/dcp_rank_writer.h"
#include "trainer/connectors/internal/optimizer_ownership.h"
#include "trainer/connectors/internal/process_connector.h"
#include "trainer/loops/internal/lr_stepping.h"
#include "trainer/loops/run_controls.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;
namespace {

// Every visible CUDA device's generator state, by device index (none without CUDA).
std::vector<at::Tensor> CudaRngStates() {
  std::vector<at::Tensor> out;
  if (!at::hasCUDA()) return out;
  for (size_t i = 0; i < at::getNumGPUs(); ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<int8_t>(i)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.push_back(gen.get_state());
  }
  return out;
}

// Restores what CudaRngStates saved, device by device. Where CUDA devices
// are visible and their number differs from the checkpoint's, restores the
// devices both have and says so: CUDA random draws then differ from the
// saved run's. (A CPU-only resume of a CUDA run has no CUDA draws to match.)
void SetCudaRngStates(const std::vector<at::Tensor>& states, const std::string& path, int rank) {
  const size_t here = at::hasCUDA() ? at::getNumGPUs() : 0;
  const size_t n = std::min(here, states.size());
  for (size_t i = 0; i < n; ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<int8_t>(i)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(states[i]);
  }
  if (here > 0 && states.size() != here && rank == 0) {
    ST_LOG(WARNING) << "checkpoint '" << path << "' holds the generator states of " << states.size()
                    << " CUDA device(s), this process sees " << here << "; restored " << n
                    << ": CUDA random draws (dropout) will differ from the saved run";
  }
}

}  // namespace

std::vector<std::string> internal::CheckpointConnector::GatherOptimizerStates() {
  std::string mine = internal::SerializeOptimizer(*t_.opt_.optimizer);
  const int W = t_.world_size();
  if (W == 1) return {mine};
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({W}, at::kLong);
  HostAllGather(*t_.world_, len, lens);
  const int64_t max_len = lens.max().item<int64_t>();
  at::Tensor buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({W * max_len}, at::kByte);
  HostAllGather(*t_.world_, buf, all);
  std::vector<std::string> out;
  const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < W; ++r) out.emplace_back(p + r * max_len, lens[r].item<int64_t>());
  return out;
}

void internal::CheckpointConnector::AgreeOrThrow(bool failed, const std::string& message, const std::string& what) {
  const int failing = static_cast<int>(t_.strategy_->ReduceMax(failed ? t_.rank() : -1.0));
  if (failing < 0) return;
  // Every rank stops with the (highest) failing rank's message.
  const std::string shared = t_.process_connector_->BroadcastString(message, failing);
  if (failed) throw Error(message);
  throw Error(what + " failed on rank " + std::to_string(failing) + ": " + shared);
}

std::map<std::string, StateDict> internal::CheckpointConnector::CallbackStates() {
  std::map<std::string, StateDict> out;
  for (const auto& cb : t_.options_.callbacks) {
    const std::string key = cb->state_key();
    ST_CHECK_ARG(key != kExtraStateKey, "callback state_key \"", key, "\" is reserved for on_save_checkpoint's state");
    if (!key.empty()) out[key] = cb->checkpoint_state();
  }
  std::map<std::string, std::string> extra;
  t_.module_->on_save_checkpoint(extra);
  for (const auto& cb : t_.options_.callbacks) cb->on_save_checkpoint(t_, *t_.module_, extra);
  if (!extra.empty()) {
    StateDict& e = out[kExtraStateKey];
    for (auto& [k, v] : extra) e[k] = StateValue(std::move(v));  // text, kept as text
  }
  return out;
}

// What both kinds of save record besides the model and optimizer state.
void internal::CheckpointConnector::FillCommon(CheckpointData& data) {
  data.optimizer_groups = internal::OptimizerGroups(*t_.strategy_, *t_.opt_.optimizer, [this](std::vector<double> v) {
    return t_.process_connector_->AllReduceSum(std::move(v));
  });
  data.epoch = t_.epoch_;
  data.global_step = t_.global_step_;
  data.batch_in_epoch = t_.batch_in_epoch_;
  data.world_size = t_.world_size();
  data.strategy = t_.strategy_->name();
  data.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  data.cuda_rng_states = CudaRngStates();
  data.hparams = t_.module_->hyper_parameters();
  data.callbacks = CallbackStates();
  if (t_.scaler_) data.grad_scaler = t_.scaler_->state();
  data.lr_schedulers = t_.lr_stepping_->States();
  data.accumulate_grad_batches = t_.options_.accumulate_grad_batches;
}

void internal::CheckpointConnector::Save(const std::string& path, CheckpointFormat format) {
  ST_CHECK_ARG(t_.strategy_ && t_.strategy_->wrapped(), "SaveCheckpoint needs a model (call Fit first)");
  auto profiled = t_.Profile(kActionSaveCheckpoint);
  const bool sharded = format == CheckpointFormat::kSharded ||
                       (format == CheckpointFormat::kAuto && t_.strategy_->prefers_sharded_checkpoint());
  ST_CHECK_ARG(!sharded || t_.strategy_->has_sharded_state(), "strategy '", t_.strategy_->name(),
               "' is not sharded: it cannot write sharded checkpoints (use CheckpointFormat::kFull)");
  FinishAsyncSave();  // at most one save in flight
  const bool async = t_.options_.async_checkpoint && t_.fitting_;
  if (async && !sharded && !warned_full_sync_ && t_.rank() == 0) {
    ST_LOG(WARNING) << "async_checkpoint: '" << path << "' is a full checkpoint, written synchronously (full "
                    << "checkpoints gather every unit through rank 0; sharded ones, as fsdp_native "
                    << "state_dict_type=sharded writes them, are written in the background)";
    warned_full_sync_ = true;
  }
  if (sharded) {
    SaveSharded(path, async);
  } else {
    SaveFull(path);
  }
  if (!async || !sharded) t_.last_ckpt_ = path;  // else once it is complete (FinishAsyncSave)
  // A save outside Fit ran once: its freed host blocks are not kept. (Inside
  // Fit they serve the next steps, whose peak bounds them.)
  if (!t_.fitting_) sharding::ReleaseHostBlockCache();
}

void internal::CheckpointConnector::SaveFull(const std::string& path) {
  // Streamed: rank 0 opens the file, every rank takes part in gathering one
  // unit at a time, rank 0 writes each tensor as it arrives and drops it.
  const std::string what = "saving checkpoint '" + path + "'";
  std::unique_ptr<ArchiveWriter> writer;
  RunAgreed(
      t_.rank() == 0, [&] { writer = std::make_unique<ArchiveWriter>(path); }, what);
  CheckpointData data;
  FillCommon(data);
  // The per-rank LibTorch archives only where the state by name cannot
  // restore the optimizer (then the file resumes at this world size only).
  if (internal::OptimizerKind(*t_.opt_.optimizer).empty()) data.optimizer_states = GatherOptimizerStates();
  internal::StreamedState streamed = internal::StreamFullState(*t_.strategy_, *t_.opt_.optimizer, writer.get());
  bool failed = false;
  std::string msg;
  if (t_.rank() == 0) {
    try {
      if (!streamed.error.empty()) throw Error(streamed.error);
      FinishCheckpoint(*writer, data, streamed.state_dict, &streamed.optimizer_full);
    } catch (const std::exception& e) {
      failed = true;
      msg = e.what();
    }
    writer.reset();  // after a failure: removes the temporary file
  }
  AgreeOrThrow(failed, msg, what);
}

void internal::CheckpointConnector::SaveSharded(const std::string& path, bool async) {
  CheckpointData meta;
  FillCommon(meta);
  meta.optimizer_full.kind = internal::OptimizerKind(*t_.opt_.optimizer);  // meta.pt says which (no state there)
  const std::string what = "saving sharded checkpoint '" + path + "'";
  try {
    RunAgreed(
        t_.rank() == 0, [&] { BeginShardedSave(path); }, what);
    if (async) {  // planned now, written by this rank's background thread
      std::unique_ptr<DcpRankWriter> writer;
      RunAgreed(
          true,
          [&] {
            writer = std::make_unique<DcpRankWriter>(*t_.strategy_, *t_.opt_.optimizer, path, meta.optimizer_groups,
                                                     /*background=*/true);
          },
          what);
      StartAsyncSave(std::move(writer), path, std::move(meta));
      return;
    }
    RunAgreed(
        true, [&] { internal::WriteDcpRank(*t_.strategy_, *t_.opt_.optimizer, path, meta.optimizer_groups); }, what);
    RunAgreed(
        t_.rank() == 0, [&] { FinishDcpSave(path, meta, t_.world_size()); }, what);
  } catch (...) {
    // Every rank throws at the same step (or a peer died): a failed save leaves nothing behind.
    DropShardedSave(path);
    throw;
  }
}

void internal::CheckpointConnector::RunAgreed(bool mine, const std::function<void()>& fn, const std::string& what) {
  bool failed = false;
  std::string msg;
  if (mine) {
    try {
      fn();
    } catch (const std::exception& e) {
      failed = true;
      msg = e.what();
    }
  }
  AgreeOrThrow(failed, msg, what);
}

void internal::CheckpointConnector::DropShardedSave(const std::string& path) {
  if (t_.rank() != 0) return;
  std::error_code ec;
  std::filesystem::remove_all(ShardedTempDir(path), ec);
}

// Gives a loaded file's state the names and keys the loaders read: a file
// from Python holds its optimizer state by index in the optimizer's order
// (this run's optimizer says which parameter each index is); format 2 keeps
// the optimizer's lrs and momentums in its groups, format 1 in each
// scheduler's state. Returns the groups' lrs and momentums (empty: none).
// Collective where the state is by index (every rank loads the same file).
internal::LoadedGroupLrs internal::CheckpointConnector::NameLoadedState(CheckpointData& ck, const std::string& path) {
  if (!ck.optimizer_indexed.empty()) {
    const std::string kind = internal::OptimizerKind(*t_.opt_.optimizer);
    if (kind.empty()) {
      ST_THROW(Error, "checkpoint '", path,
               "' holds torch.optim state, which loads into Adam, AdamW or SGD only; "
               "this run's optimizer is another kind (nothing was loaded)");
    }
    std::vector<std::vector<std::string>> names;
    for (auto& g : internal::OptimizerGroups(*t_.strategy_, *t_.opt_.optimizer, [this](std::vector<double> v) {
           return t_.process_connector_->AllReduceSum(std::move(v));
         })) {
      names.push_back(std::move(g.params));
    }
    NameOptimizerState(ck, names, kind, path);
  }
  // Format 2 keeps the optimizer's lrs and momentums in its groups (the
  // truth, also where a scheduler's state carries stale copies), format 1 in
  // each scheduler's state: give the schedulers' loader what it reads.
  internal::LoadedGroupLrs groups = internal::GroupLrsAndMomentums(ck.optimizer_groups);
  if (!groups.lrs.empty()) {
    for (auto& st : ck.lr_schedulers) {
      st["optimizer_lrs"] = DoublesToString(groups.lrs);
      st["optimizer_momentums"] = DoublesToString(groups.momentums);
    }
  }
  return groups;
}

// The generators' states and the callbacks' states of a loaded checkpoint.
void internal::CheckpointConnector::RestoreRngAndCallbacks(const CheckpointData& ck, const std::string& path) {
  if (ck.rng_state.defined() && ck.rng_state.numel() > 0) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(ck.rng_state);
  }
  SetCudaRngStates(ck.cuda_rng_states, path, t_.rank());
  for (const auto& cb : t_.options_.callbacks) {
    if (cb->state_key().empty()) continue;
    auto it = ck.callbacks.find(cb->state_key());
    if (it == ck.callbacks.end() && !cb->legacy_state_key().empty()) it = ck.callbacks.find(cb->legacy_state_key());
    if (it != ck.callbacks.end()) cb->load_checkpoint_state(it->second);
  }
}

namespace {

// A checkpoint as the Restore of a run whose strategy is sharded or not reads
// it: a PyTorch DCP directory (what sharded saves write), a directory of the
// format of earlier releases, or a full file. `direct`: sharded into a
// sharded strategy (each rank reads its ranges); else `data` holds the whole
// state (consolidated).
struct OpenedCheckpoint {
  std::optional<DcpCheckpoint> dcp;
  std::optional<ShardedCheckpoint> sharded;
  bool direct = false;
  CheckpointData data;
};

OpenedCheckpoint OpenCheckpoint(const std::string& path, bool sharded_strategy, const std::string& run_kind) {
  OpenedCheckpoint o;
  if (IsDcpCheckpoint(path)) {
    o.dcp = OpenDcpCheckpoint(path);
  } else if (IsShardedCheckpoint(path)) {
    o.sharded = LoadShardedCheckpoint(path);
  }
  o.direct = (o.sharded || o.dcp) && sharded_strategy;
  o.data = o.direct && o.dcp ? o.dcp->meta
           : o.dcp           ? ConsolidateDcpCheckpoint(*o.dcp, run_kind)
           : o.direct        ? o.sharded->meta
           : o.sharded       ? ConsolidateShardedCheckpoint(*o.sharded)
                             : LoadCheckpoint(path);
  return o;
}

}  // namespace

// Each rank reads other chunks: all ranks agree before any installs.
std::function<void()> internal::CheckpointConnector::PrepareDcpLoadAgreed(const DcpCheckpoint& dcp,
                                                                          const std::string& path) {
  std::function<void()> apply;
  RunAgreed(
      true, [&] { apply = internal::PrepareDcpLoad(*t_.strategy_, *t_.opt_.optimizer, dcp, path); },
      "loading checkpoint '" + path + "'");
  return apply;
}

void internal::CheckpointConnector::Restore(const std::string& path) {
  // A sharded checkpoint into a sharded strategy: every rank maps the rank
  // files and reads only the ranges of its own new shards (no full model).
  // Replicated strategies need the full model anyway: they load it consolidated.
  OpenedCheckpoint opened =
      OpenCheckpoint(path, t_.strategy_->has_sharded_state(), internal::OptimizerKind(*t_.opt_.optimizer));
  const std::optional<DcpCheckpoint>& dcp = opened.dcp;
  const std::optional<ShardedCheckpoint>& sharded = opened.sharded;
  const bool direct = opened.direct;
  CheckpointData& ck = opened.data;
  // Each rank copies its slices of the mapped records, then drops their pages.
  sharding::SourceReleaseScope release_pages(&ReleaseMappedPages);
  const int W = t_.world_size();
  // The per-rank LibTorch archives restore everything (including parameter
  // group options) but only into the same strategy at the same world size;
  // the state by parameter name reshards anywhere.
  const bool archives =
      static_cast<int>(ck.optimizer_states.size()) == W && ck.world_size == W && ck.strategy == t_.strategy_->name();
  const internal::LoadedGroupLrs group_lrs = NameLoadedState(ck, path);
  std::function<void()> apply_optimizer;
  std::function<void()> apply_sharded;  // parameters, buffers and optimizer state
  if (direct && dcp) {
    apply_sharded = PrepareDcpLoadAgreed(*dcp, path);
  } else if (direct) {
    apply_sharded = internal::PrepareShardedLoad(*t_.strategy_, *t_.opt_.optimizer, *sharded, path);
  } else if (!archives) {
    if (!ck.optimizer_full.empty()) {
      apply_optimizer = internal::PrepareOptimizerLoad(*t_.strategy_, *t_.opt_.optimizer, ck.optimizer_full, path);
    } else if (!ck.optimizer_states.empty()) {
      ST_THROW(Error, "checkpoint '", path, "' holds optimizer state of ", ck.optimizer_states.size(), " ranks (",
               ck.strategy, ") but this run has ", W, " (", t_.strategy_->name(),
               "); only Adam, AdamW and SGD state is saved in a form that loads at another world size or strategy");
    }
  }
  std::optional<GradScaler> scaler;  // checked now, installed with the rest
  if (t_.scaler_ && ck.grad_scaler) {
    scaler.emplace(*t_.scaler_);
    try {
      scaler->load_state(*ck.grad_scaler);
    } catch (const std::exception& e) {
      ST_THROW(Error, "checkpoint '", path, "': ", e.what());
    }
  }
  // Checked now, installed after the optimizer (its lrs and momentums).
  const std::function<void()> apply_lr_schedulers =
      t_.lr_stepping_->PrepareLoad(ck.lr_schedulers, ck.global_step, path);
  if (apply_sharded) {
    apply_sharded();  // checks everything before changing anything
  } else {
    t_.strategy_->LoadFullStateDict(ck.state_dict);  // checks everything before changing anything
    if (archives) {
      internal::LoadOptimizerArchive(*t_.opt_.optimizer, ck.optimizer_states[t_.rank()], path);
    } else if (apply_optimizer) {
      apply_optimizer();
    }
  }
  if (!group_lrs.lrs.empty() && group_lrs.lrs.size() == t_.opt_.optimizer->param_groups().size()) {
    // As torch.optim's load_state_dict: the groups' learning rates and momentums.
    SetGroupLrs(*t_.opt_.optimizer, group_lrs.lrs);
    if (group_lrs.momentums.size() == GroupMomentums(*t_.opt_.optimizer).size()) {
      SetGroupMomentums(*t_.opt_.optimizer, group_lrs.momentums);
    }
  }
  apply_lr_schedulers();
  RestoreRngAndCallbacks(ck, path);
  if (scaler) *t_.scaler_ = *scaler;
  t_.epoch_ = ck.epoch;
  t_.global_step_ = ck.global_step;
  t_.batch_in_epoch_ = ck.batch_in_epoch;
  const auto extra = ck.callbacks.find(kExtraStateKey);
  const std::map<std::string, std::string> extra_state =
      extra != ck.callbacks.end() ? ToStrings(extra->second) : std::map<std::string, std::string>{};
  t_.module_->on_load_checkpoint(extra_state);
  for (const auto& cb : t_.options_.callbacks) cb->on_load_checkpoint(t_, *t_.module_, extra_state);
  if (t_.rank() == 0) {
    ST_LOG(INFO) << "resumed from " << path << " ("
                 << (ck.world_size > 0 ? "saved at world size " + std::to_string(ck.world_size)
                                       : std::string("written by Python: Lightning or PyTorch"))
                 << ", now " << W << ") at epoch " << t_.epoch_ << ", global step " << t_.global_step_;
  }
}

// "" (start afresh), the given path, or for "last" (and resume="auto" without
// a path) the newest complete checkpoint: rank 0 decides, every rank uses it.
// Also removes what killed saves of earlier runs left behind.
std::string internal::CheckpointConnector::ResolveCheckpointPath(const std::string& ckpt_path) {
  const auto& o = t_.options_;
  const bool find = ckpt_path == "last" || (ckpt_path.empty() && o.resume == "auto");
  // "best": ModelCheckpoint's best (trainer/loops/run_controls.h), the same on every rank.
  std::string path = ckpt_path == "best" ? BestCheckpointPath(o.callbacks) : ckpt_path;
  if (t_.rank() == 0) {
    for (const auto& r : RemoveCheckpointLitter(o.default_root_dir, o.logger_name)) {
      ST_LOG(INFO) << "removed " << r << " (left by a save that was killed)";
    }
    if (find) path = FindLatestCheckpoint(o.default_root_dir, o.logger_name);
  }
  if (!find) return path;
  path = t_.process_connector_->BroadcastString(path);
  if (path.empty()) {
    ST_CHECK_ARG(ckpt_path != "last", "ckpt_path=\"last\": no complete checkpoint under '", o.default_root_dir,
                 "' (looked in ", (fs::path(o.default_root_dir) / o.logger_name / "version_N" / "checkpoints").string(),
                 " and ", (fs::path(o.default_root_dir) / "checkpoints").string(),
                 "); run once without it first, or pass a checkpoint path");
    if (t_.rank() == 0)
      ST_LOG(INFO) << "resume=auto: no checkpoint under " << o.default_root_dir << "; starting afresh";
  }
  return path;
}

}  // namespace shardtrain::trainer
