// Trainer: writing and loading checkpoints (full and sharded), collective
// over the ranks; split from trainer.cc.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/optimizer.h>

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
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/connectors/internal/checkpoint_state.h"
#include "trainer/connectors/internal/optimizer_ownership.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

std::vector<std::string> Trainer::GatherOptimizerStates() {
  std::string mine = internal::SerializeOptimizer(*opt_.optimizer);
  const int W = world_size();
  if (W == 1) return {mine};
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({W}, at::kLong);
  HostAllGather(*world_, len, lens);
  const int64_t max_len = lens.max().item<int64_t>();
  at::Tensor buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({W * max_len}, at::kByte);
  HostAllGather(*world_, buf, all);
  std::vector<std::string> out;
  const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < W; ++r) out.emplace_back(p + r * max_len, lens[r].item<int64_t>());
  return out;
}

void Trainer::AgreeOrThrow(bool failed, const std::string& message, const std::string& what) {
  const double any = strategy_->ReduceMax(failed ? 1.0 : 0.0);
  if (any <= 0) return;
  if (failed) throw Error(message);
  ST_THROW(Error, what, " failed on another rank (see its error)");
}

std::map<std::string, std::map<std::string, std::string>> Trainer::CallbackStates() {
  std::map<std::string, std::map<std::string, std::string>> out;
  for (const auto& cb : options_.callbacks) {
    const std::string key = cb->state_key();
    ST_CHECK_ARG(key != kExtraStateKey, "callback state_key \"", key, "\" is reserved for on_save_checkpoint's state");
    if (!key.empty()) out[key] = cb->state_dict();
  }
  std::map<std::string, std::string> extra;
  module_->on_save_checkpoint(extra);
  for (const auto& cb : options_.callbacks) cb->on_save_checkpoint(*this, *module_, extra);
  if (!extra.empty()) out[kExtraStateKey] = std::move(extra);
  return out;
}

void Trainer::SaveCheckpoint(const std::string& path, CheckpointFormat format) {
  ST_CHECK_ARG(strategy_ && strategy_->wrapped(), "SaveCheckpoint needs a model (call Fit first)");
  auto profiled = Profile(kActionSaveCheckpoint);
  const bool sharded = format == CheckpointFormat::kSharded ||
                       (format == CheckpointFormat::kAuto && strategy_->prefers_sharded_checkpoint());
  ST_CHECK_ARG(!sharded || strategy_->has_sharded_state(), "strategy '", strategy_->name(),
               "' is not sharded: it cannot write sharded checkpoints (use CheckpointFormat::kFull)");
  if (sharded) {
    SaveSharded(path);
  } else {
    SaveFull(path);
  }
  last_ckpt_ = path;
  // A save outside Fit ran once: its freed host blocks are not kept. (Inside
  // Fit they serve the next steps, whose peak bounds them.)
  if (!fitting_) sharding::ReleaseHostBlockCache();
}

void Trainer::SaveFull(const std::string& path) {
  // Streamed: rank 0 opens the file, every rank takes part in gathering one
  // unit at a time, rank 0 writes each tensor as it arrives and drops it.
  const std::string what = "saving checkpoint '" + path + "'";
  std::unique_ptr<ArchiveWriter> writer;
  {
    bool failed = false;
    std::string msg;
    if (rank() == 0) {
      try {
        writer = std::make_unique<ArchiveWriter>(path);
      } catch (const std::exception& e) {
        failed = true;
        msg = e.what();
      }
    }
    AgreeOrThrow(failed, msg, what);
  }
  CheckpointData data;
  // The per-rank LibTorch archives only where "optimizer_full" cannot
  // restore the optimizer (then the file resumes at this world size only).
  if (internal::OptimizerKind(*opt_.optimizer).empty()) data.optimizer_states = GatherOptimizerStates();
  internal::StreamedState streamed = internal::StreamFullState(*strategy_, *opt_.optimizer, writer.get());
  data.epoch = epoch_;
  data.global_step = global_step_;
  data.batch_in_epoch = batch_in_epoch_;
  data.world_size = world_size();
  data.strategy = strategy_->name();
  data.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  data.hparams = module_->hparams();
  data.callbacks = CallbackStates();
  if (scaler_) data.grad_scaler = scaler_->state();
  data.lr_schedulers = LRSchedulerStates();
  bool failed = false;
  std::string msg;
  if (rank() == 0) {
    try {
      if (!streamed.error.empty()) throw Error(streamed.error);
      FinishCheckpoint(*writer, data, streamed.state_dict, streamed.optimizer_full);
    } catch (const std::exception& e) {
      failed = true;
      msg = e.what();
    }
    writer.reset();  // after a failure: removes the temporary file
  }
  AgreeOrThrow(failed, msg, what);
}

void Trainer::SaveSharded(const std::string& path) {
  ShardedPiece piece = internal::MakeShardedPiece(*strategy_, *opt_.optimizer);
  CheckpointData meta;
  meta.epoch = epoch_;
  meta.global_step = global_step_;
  meta.batch_in_epoch = batch_in_epoch_;
  meta.world_size = world_size();
  meta.strategy = strategy_->name();
  meta.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  meta.hparams = module_->hparams();
  meta.callbacks = CallbackStates();
  if (scaler_) meta.grad_scaler = scaler_->state();
  meta.lr_schedulers = LRSchedulerStates();
  const std::string what = "saving sharded checkpoint '" + path + "'";
  auto step = [&](bool mine, const std::function<void()>& fn) {
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
  };
  try {
    step(rank() == 0, [&] { BeginShardedSave(path); });
    step(true, [&] { WriteShardedPiece(path, piece); });
    step(rank() == 0, [&] { FinishShardedSave(path, meta); });
  } catch (...) {
    // Every rank throws at the same step (or a peer died): rank 0 removes the
    // temporary directory, so a failed save leaves nothing behind.
    if (rank() == 0) {
      std::error_code ec;
      std::filesystem::remove_all(ShardedTempDir(path), ec);
    }
    throw;
  }
}

void Trainer::LoadFrom(const std::string& path) {
  // A sharded checkpoint into a sharded strategy: every rank maps the rank
  // files and reads only the ranges of its own new shards (no full model).
  // Replicated strategies need the full model anyway: they load it consolidated.
  std::optional<ShardedCheckpoint> sharded;
  if (IsShardedCheckpoint(path)) sharded = LoadShardedCheckpoint(path);
  const bool direct = sharded && strategy_->has_sharded_state();
  CheckpointData ck = direct ? sharded->meta : sharded ? ConsolidateShardedCheckpoint(*sharded) : LoadCheckpoint(path);
  // Each rank copies its slices of the mapped records, then drops their pages.
  sharding::SourceReleaseScope release_pages(&ReleaseMappedPages);
  const int W = world_size();
  // The per-rank LibTorch archives restore everything (including parameter
  // group options) but only into the same strategy at the same world size;
  // the state by parameter name reshards anywhere.
  const bool archives = static_cast<int>(ck.optimizer_states.size()) == W && ck.world_size == W &&
                        ck.strategy == strategy_->name();
  std::function<void()> apply_optimizer;
  std::function<void()> apply_sharded;  // parameters, buffers and optimizer state
  if (direct) {
    apply_sharded = internal::PrepareShardedLoad(*strategy_, *opt_.optimizer, *sharded, path);
  } else if (!archives) {
    if (!ck.optimizer_full.empty()) {
      apply_optimizer = internal::PrepareOptimizerLoad(*strategy_, *opt_.optimizer, ck.optimizer_full, path);
    } else if (!ck.optimizer_states.empty()) {
      ST_THROW(Error, "checkpoint '", path, "' holds optimizer state of ", ck.optimizer_states.size(), " ranks (",
               ck.strategy, ") but this run has ", W, " (", strategy_->name(),
               "); only Adam, AdamW and SGD state is saved in a form that loads at another world size or strategy");
    }
  }
  std::optional<GradScaler> scaler;  // checked now, installed with the rest
  if (scaler_ && ck.grad_scaler) {
    scaler.emplace(*scaler_);
    try {
      scaler->load_state(*ck.grad_scaler);
    } catch (const std::exception& e) {
      ST_THROW(Error, "checkpoint '", path, "': ", e.what());
    }
  }
  // Checked now, installed after the optimizer (its lrs and momentums).
  const std::function<void()> apply_lr_schedulers = PrepareLRSchedulerLoad(ck.lr_schedulers, ck.global_step, path);
  if (apply_sharded) {
    apply_sharded();  // checks everything before changing anything
  } else {
    strategy_->LoadFullStateDict(ck.state_dict);  // checks everything before changing anything
    if (archives) {
      internal::LoadOptimizerArchive(*opt_.optimizer, ck.optimizer_states[rank()], path);
    } else if (apply_optimizer) {
      apply_optimizer();
    }
  }
  apply_lr_schedulers();
  if (ck.rng_state.defined() && ck.rng_state.numel() > 0) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(ck.rng_state);
  }
  for (const auto& cb : options_.callbacks) {
    auto it = ck.callbacks.find(cb->state_key());
    if (!cb->state_key().empty() && it != ck.callbacks.end()) cb->load_state_dict(it->second);
  }
  if (scaler) *scaler_ = *scaler;
  epoch_ = ck.epoch;
  global_step_ = ck.global_step;
  batch_in_epoch_ = ck.batch_in_epoch;
  const auto extra = ck.callbacks.find(kExtraStateKey);
  const std::map<std::string, std::string> extra_state =
      extra != ck.callbacks.end() ? extra->second : std::map<std::string, std::string>{};
  module_->on_load_checkpoint(extra_state);
  for (const auto& cb : options_.callbacks) cb->on_load_checkpoint(*this, *module_, extra_state);
  if (rank() == 0) {
    ST_LOG(INFO) << "resumed from " << path << " (saved at world size " << ck.world_size << ", now " << W
                 << ") at epoch " << epoch_ << ", global step " << global_step_;
  }
}

}  // namespace shardtrain::trainer
