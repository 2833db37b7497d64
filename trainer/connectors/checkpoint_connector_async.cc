// The checkpoint connector's asynchronous saves
// (trainer/connectors/internal/checkpoint_connector.h, "Asynchronous saves";
// the writer and copy-on-write: trainer/connectors/internal/async_save.h).
#include <torch/optim/optimizer.h>

#include <iomanip>
#include <sstream>

#include "base/errors.h"
#include "base/logging.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/connectors/internal/async_save.h"
#include "trainer/connectors/internal/checkpoint_connector.h"
#include "trainer/connectors/internal/dcp_rank_writer.h"
#include "trainer/connectors/internal/process_connector.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

internal::CheckpointConnector::CheckpointConnector(Trainer& trainer) : t_(trainer) {}

internal::CheckpointConnector::~CheckpointConnector() = default;

void internal::CheckpointConnector::StartAsyncSave(std::unique_ptr<DcpRankWriter> writer, const std::string& path,
                                                   CheckpointData meta) {
  async_ = std::make_unique<AsyncSave>(std::move(writer), path, std::move(meta),
                                       t_.options_.async_checkpoint_max_extra_memory);
}

void internal::CheckpointConnector::StepOptimizer() {
  torch::optim::Optimizer& opt = *t_.opt_.optimizer;
  if (async_) {
    async_->StepOptimizer(opt);
  } else {
    opt.step();
  }
}

std::vector<double> internal::CheckpointConnector::AsyncSaveSlots() const {
  const bool finished = !async_ || async_->finished();
  return {finished ? 1.0 : 0.0, finished && async_ && !async_->error().empty() ? 1.0 : 0.0};
}

void internal::CheckpointConnector::AfterAsyncSaveSlots(const std::vector<double>& summed) {
  if (!async_) return;
  if (summed.at(1) > 0 || summed.at(0) >= t_.world_size()) FinishAsyncSave();
}

void internal::CheckpointConnector::FinishAsyncSave() {
  if (!async_) return;
  std::unique_ptr<AsyncSave> save = std::move(async_);
  std::vector<std::function<void()>> deferred = std::move(when_saved_);
  when_saved_.clear();
  save->Join();
  const std::string& path = save->path();
  const std::string what = "saving sharded checkpoint '" + path + "' (asynchronously)";
  try {
    AgreeOrThrow(!save->error().empty(), save->error(), what);
    RunAgreed(
        t_.rank() == 0, [&] { FinishDcpSave(path, save->meta(), t_.world_size()); }, what);
  } catch (...) {
    DropShardedSave(path);  // every writer has returned: nothing writes there any more
    throw;
  }
  t_.last_ckpt_ = path;
  // The most any rank held aside and took to write (one small collective per save).
  const int W = t_.world_size(), r = t_.rank();
  const AsyncSaveStats st = save->stats();
  std::vector<double> v(6 * static_cast<size_t>(W), 0.0);
  v[r] = static_cast<double>(st.peak_extra_bytes);
  v[W + r] = st.write_seconds;
  v[2 * W + r] = st.units_copied;
  v[3 * W + r] = st.units;
  v[4 * W + r] = st.wait_seconds;
  v[5 * W + r] = static_cast<double>(st.budget_bytes);
  v = t_.process_connector_->AllReduceSum(std::move(v));
  AsyncCheckpointStats& total = t_.async_checkpoint_stats_;
  AsyncCheckpointStats out;  // this save
  for (int i = 0; i < W; ++i) {
    out.peak_extra_bytes = std::max(out.peak_extra_bytes, static_cast<int64_t>(v[i]));
    out.write_seconds = std::max(out.write_seconds, v[W + i]);
    out.units_copied += static_cast<int64_t>(v[2 * W + i]);
    out.units += static_cast<int64_t>(v[3 * W + i]);
    out.wait_seconds = std::max(out.wait_seconds, v[4 * W + i]);
    out.budget_bytes = std::max(out.budget_bytes, static_cast<int64_t>(v[5 * W + i]));
  }
  total.path = path;
  ++total.saves;
  total.write_seconds = out.write_seconds;
  total.wait_seconds += out.wait_seconds;
  total.budget_bytes = std::max(total.budget_bytes, out.budget_bytes);
  total.units += out.units;
  total.units_copied += out.units_copied;
  total.peak_extra_bytes = std::max(total.peak_extra_bytes, out.peak_extra_bytes);
  if (r == 0) {
    std::ostringstream msg;
    msg << "wrote sharded checkpoint '" << path << "' in the background in " << std::fixed << std::setprecision(2)
        << out.write_seconds << " s; copied aside before the optimizer changed them: " << out.units_copied << " of "
        << out.units << " unit shards, at most " << std::setprecision(1)
        << static_cast<double>(out.peak_extra_bytes) / (1 << 20) << " MiB on a rank (budget "
        << static_cast<double>(out.budget_bytes) / (1 << 20) << " MiB); the optimizer waited for it "
        << std::setprecision(2) << out.wait_seconds << " s";
    ST_LOG(INFO) << msg.str();
  }
  for (auto& fn : deferred) fn();
}

void internal::CheckpointConnector::AbandonAsyncSave() {
  if (!async_) return;
  async_->Join();
  if (t_.rank() == 0) {
    ST_LOG(WARNING) << "the asynchronous save of '" << async_->path()
                    << "' did not complete (Fit stopped by an exception); the checkpoints before it are intact";
  }
  async_.reset();
  when_saved_.clear();
}

void internal::CheckpointConnector::WhenSaved(std::function<void()> fn) {
  if (async_) {
    when_saved_.push_back(std::move(fn));
  } else {
    fn();
  }
}

}  // namespace shardtrain::trainer
