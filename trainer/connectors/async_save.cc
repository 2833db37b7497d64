// Asynchronous sharded saves with copy-on-write per unit
// (trainer/connectors/internal/async_save.h).
#include "trainer/connectors/internal/async_save.h"

#include <pthread.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <numeric>

#include "trainer/connectors/internal/checkpoint_state.h"
#include "trainer/connectors/internal/dcp_rank_writer.h"

namespace shardtrain::trainer::internal {

int AsyncSaveUnitDelayMs() {
  const char* v = std::getenv("SHARDTRAIN_ASYNC_SAVE_UNIT_DELAY_MS");
  return v == nullptr ? 0 : std::max(0, std::atoi(v));
}

AsyncSave::AsyncSave(std::unique_ptr<DcpRankWriter> writer, std::string path, CheckpointData meta,
                     double max_extra_fraction)
    : writer_(std::move(writer)),
      unit_of_(writer_->unit_of_optimizer_tensors()),
      path_(std::move(path)),
      meta_(std::move(meta)) {
  const int n = writer_->num_units();
  state_.assign(n, UnitState::kPending);
  aside_bytes_.assign(n, 0);
  int64_t total = 0;
  for (int u = 0; u < n; ++u) total += unit_bytes_.emplace_back(writer_->UnitBytes(u));
  stats_.budget_bytes = static_cast<int64_t>(max_extra_fraction * static_cast<double>(total));
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

int AsyncSave::NextUnit(const std::vector<int>& todo) {
  std::unique_lock<std::mutex> lock(mu_);
  std::chrono::steady_clock::time_point since;
  auto picked = [&](int u) {
    if (since != std::chrono::steady_clock::time_point()) {
      stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
    }
    return u;
  };
  for (;;) {
    for (int u : todo) {
      if (state_[u] == UnitState::kWritten) return picked(u);
    }
    // Within the budget, copy aside a unit the writer has not reached: the
    // last it will reach, so that the copy is the only one made of it.
    for (auto it = todo.rbegin(); it != todo.rend(); ++it) {
      if (state_[*it] == UnitState::kPending && extra_bytes_ + unit_bytes_[*it] <= stats_.budget_bytes) {
        CopyAsideLocked(*it);
        return picked(*it);
      }
    }
    if (since == std::chrono::steady_clock::time_point()) since = std::chrono::steady_clock::now();
    cv_.wait(lock);  // the writer notifies after each unit
  }
}

void AsyncSave::StepOptimizer(torch::optim::Optimizer& opt) {
  if (state_.empty() || finished()) {
    opt.step();
  } else if (unit_of_.empty()) {  // a step that may change any unit: every unit written or copied first
    std::vector<int> todo(state_.size());
    std::iota(todo.begin(), todo.end(), 0);
    while (!todo.empty()) std::erase(todo, NextUnit(todo));
    opt.step();
  } else {
    StepOptimizerByUnit(opt, unit_of_, [this](const std::vector<int>& todo) { return NextUnit(todo); });
  }
}

void StepOptimizerByUnit(torch::optim::Optimizer& opt, const std::vector<int>& unit_of,
                         const std::function<int(const std::vector<int>& todo)>& next) {
  std::vector<at::Tensor> params = OptimizerParams(opt);
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  std::vector<int> todo;  // the units with a gradient
  for (size_t i = 0; i < params.size(); ++i) {
    grads.push_back(params[i].grad());
    if (grads.back().defined()) todo.push_back(unit_of.at(i));
  }
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  auto restore = [&] {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
  };
  try {
    while (!todo.empty()) {
      const int u = next(todo);
      std::erase(todo, u);
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = unit_of[i] == u ? grads[i] : at::Tensor();
      opt.step();
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace shardtrain::trainer::internal
