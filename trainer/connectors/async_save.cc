// Asynchronous sharded saves with copy-on-write per unit
// (trainer/connectors/internal/async_save.h).
#include "trainer/connectors/internal/async_save.h"

#include <pthread.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>

#include "trainer/connectors/internal/checkpoint_state.h"
#include "trainer/connectors/internal/dcp_rank_writer.h"

namespace shardtrain::trainer::internal {

int AsyncSaveUnitDelayMs() {
  const char* v = std::getenv("SHARDTRAIN_ASYNC_SAVE_UNIT_DELAY_MS");
  return v == nullptr ? 0 : std::max(0, std::atoi(v));
}

AsyncSave::AsyncSave(std::unique_ptr<DcpRankWriter> writer, std::string path, CheckpointData meta)
    : writer_(std::move(writer)),
      unit_of_(writer_->unit_of_optimizer_tensors()),
      path_(std::move(path)),
      meta_(std::move(meta)) {
  state_.assign(writer_->num_units(), UnitState::kPending);
  aside_bytes_.assign(writer_->num_units(), 0);
  thread_ = std::thread([this] { Run(); });
}

AsyncSave::~AsyncSave() { Join(); }

void AsyncSave::Join() {
  if (thread_.joinable()) thread_.join();
}

AsyncSaveStats AsyncSave::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void AsyncSave::Run() {
  pthread_setname_np(pthread_self(), "st-async-save");  // for top, perf, gdb
  const auto t0 = std::chrono::steady_clock::now();
  const int delay_ms = AsyncSaveUnitDelayMs();
  try {
    for (int u = 0; u < static_cast<int>(state_.size()); ++u) {
      if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      {
        std::lock_guard<std::mutex> lock(mu_);
        state_[u] = UnitState::kWriting;  // from here the optimizer waits for this unit
      }
      writer_->WriteUnit(u);  // drops the unit's tensors (and its copy)
      {
        std::lock_guard<std::mutex> lock(mu_);
        state_[u] = UnitState::kWritten;
        extra_bytes_ -= aside_bytes_[u];
        aside_bytes_[u] = 0;
        ++stats_.units;
      }
      cv_.notify_all();
    }
    writer_->Finish();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = e.what();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // After a failure the units left are never written: the optimizer must not wait for them.
    for (auto& s : state_) s = UnitState::kWritten;
    stats_.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  cv_.notify_all();
  finished_.store(true);
}

void AsyncSave::CopyAsideLocked(int u) {
  const int64_t bytes = writer_->CopyAside(u);
  aside_bytes_[u] = bytes;
  extra_bytes_ += bytes;
  ++stats_.units_copied;
  stats_.peak_extra_bytes = std::max(stats_.peak_extra_bytes, extra_bytes_);
  state_[u] = UnitState::kWritten;  // for the optimizer: it may change the live tensors now
}

void AsyncSave::BeforeUnitStep(int u) {
  std::unique_lock<std::mutex> lock(mu_);
  const int n = static_cast<int>(state_.size());
  const int first = u < 0 ? 0 : u, end = u < 0 ? n : std::min(u + 1, n);
  for (int v = first; v < end; ++v) {
    cv_.wait(lock, [&] { return state_[v] != UnitState::kWriting; });
    if (state_[v] == UnitState::kPending) CopyAsideLocked(v);
  }
}

void AsyncSave::StepOptimizer(torch::optim::Optimizer& opt) {
  if (state_.empty() || finished()) {
    opt.step();
  } else if (unit_of_.empty()) {  // a step that may change any unit: all copied first
    BeforeUnitStep(-1);
    opt.step();
  } else {
    StepOptimizerByUnit(opt, unit_of_, [this](int u) { BeforeUnitStep(u); });
  }
}

void StepOptimizerByUnit(torch::optim::Optimizer& opt, const std::vector<int>& unit_of,
                         const std::function<void(int)>& before) {
  std::vector<at::Tensor> params = OptimizerParams(opt);
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  int num_units = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    grads.push_back(params[i].grad());
    num_units = std::max(num_units, unit_of.at(i) + 1);
  }
  auto restore = [&] {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
  };
  try {
    for (int u = 0; u < num_units; ++u) {
      bool any = false;
      for (size_t i = 0; i < params.size(); ++i) {
        const bool mine = unit_of[i] == u;
        any = any || (mine && grads[i].defined());
        params[i].mutable_grad() = mine ? grads[i] : at::Tensor();
      }
      if (!any) continue;
      before(u);
      opt.step();
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace shardtrain::trainer::internal
