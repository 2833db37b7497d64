#include "trainer/data/data_loader.h"

#include <ATen/Context.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

namespace shardtrain::trainer {
namespace {

// The batch's CPU tensors in page-locked memory (DataLoaderOptions::pin_memory).
void PinBatch(Batch& b) {
  const auto pin = [](at::Tensor& t) {
    if (t.defined() && t.device().is_cpu() && !t.is_pinned()) t = t.pin_memory();
  };
  pin(b.inputs);
  pin(b.targets);
  for (auto& kv : b.fields) pin(kv.second);
}

// get_batch of batch `position` (then pinned when asked); an exception from
// get_batch becomes a DataLoaderError that names the batch (the same on the
// calling thread and on a worker).
Batch LoadBatch(const Dataset& dataset, const std::vector<std::vector<int64_t>>& batches, int64_t position,
                bool pin_memory) {
  const std::vector<int64_t>& indices = batches[static_cast<size_t>(position)];
  Batch b;
  try {
    b = dataset.get_batch(indices);
  } catch (...) {
    std::ostringstream msg;
    msg << "Dataset::get_batch failed for batch " << position << " of " << batches.size() << " (samples ";
    const size_t shown = std::min<size_t>(indices.size(), 4);
    for (size_t i = 0; i < shown; ++i) msg << (i ? ", " : "") << indices[i];
    if (shown < indices.size()) msg << ", ... " << indices.size() << " in all";
    msg << "): ";
    try {
      throw;
    } catch (const std::exception& e) {
      msg << e.what();
    } catch (...) {
      msg << "an exception not derived from std::exception";
    }
    throw DataLoaderError(msg.str(), position, std::current_exception());
  }
  if (pin_memory) PinBatch(b);
  return b;
}

}  // namespace

void CheckDataLoaderOptions(const DataLoaderOptions& o) {
  ST_CHECK_ARG(o.num_workers >= 0 && o.num_workers <= kMaxDataLoaderWorkers, "num_workers must be in [0, ",
               kMaxDataLoaderWorkers,
               "] (0: batches are loaded on the training thread; N: by N background threads), got ", o.num_workers);
  ST_CHECK_ARG(o.prefetch_factor >= 1 && o.prefetch_factor <= 1024,
               "prefetch_factor (batches prepared ahead per worker) must be in [1, 1024], got ", o.prefetch_factor);
  ST_CHECK_ARG(!o.pin_memory || at::globalContext().hasCUDA(),
               "pin_memory (page-locked batches for asynchronous copies to a CUDA device) needs CUDA, and this "
               "process has none; valid: pin_memory = false here");
}

// The queue between the workers and Next(): results keyed by batch position.
struct DataLoader::Shared {
  struct Slot {
    Batch batch;
    std::exception_ptr error;
  };
  std::mutex mu;
  std::condition_variable ready_cv;  // a slot was filled
  std::condition_variable space_cv;  // Next() took a batch, or stop
  int64_t claimed = 0;               // the next position a worker takes
  int64_t consumed = 0;              // positions below it were taken by Next()
  int64_t capacity = 1;              // positions in [consumed, consumed + capacity) may be claimed
  bool stop = false;
  std::map<int64_t, Slot> done;
  std::vector<std::thread> workers;

  // Asks the workers to stop and joins them (each finishes the get_batch it is in).
  void StopWorkers() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    space_cv.notify_all();
    for (auto& t : workers) t.join();
    workers.clear();
  }
};

DataLoader::DataLoader(const Dataset& dataset, std::vector<std::vector<int64_t>> batches, DataLoaderOptions options,
                       int64_t begin, int64_t end)
    : dataset_(dataset),
      batches_(std::move(batches)),
      options_(options),
      end_(end < 0 ? static_cast<int64_t>(batches_.size()) : end),
      next_(begin) {
  CheckDataLoaderOptions(options_);
  ST_CHECK_ARG(end_ <= static_cast<int64_t>(batches_.size()), "DataLoader: end ", end_, " is past the ",
               batches_.size(), " batches; valid: -1 (all) or [begin, ", batches_.size(), "]");
  ST_CHECK_ARG(begin >= 0 && begin <= end_, "DataLoader: begin ", begin, " must be in [0, ", end_, "]");
  if (options_.num_workers == 0 || begin == end_) return;
  shared_ = std::make_unique<Shared>();
  Shared& s = *shared_;
  s.claimed = s.consumed = begin;
  s.capacity = static_cast<int64_t>(options_.num_workers) * options_.prefetch_factor;
  auto work = [this, &s] {
    for (;;) {
      int64_t pos;
      {
        std::unique_lock<std::mutex> lock(s.mu);
        s.space_cv.wait(lock, [&] { return s.stop || s.claimed >= end_ || s.claimed < s.consumed + s.capacity; });
        if (s.stop || s.claimed >= end_) return;
        pos = s.claimed++;
      }
      Shared::Slot slot;
      try {
        slot.batch = LoadBatch(dataset_, batches_, pos, options_.pin_memory);
      } catch (...) {
        slot.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(s.mu);
        s.done.emplace(pos, std::move(slot));
      }
      s.ready_cv.notify_all();
    }
  };
  try {
    for (int w = 0; w < options_.num_workers; ++w) s.workers.emplace_back(work);
  } catch (...) {  // no thread for a worker: stop the ones started (no destructor runs)
    s.StopWorkers();
    throw;
  }
}

DataLoader::~DataLoader() {
  if (shared_) shared_->StopWorkers();
}

Batch DataLoader::Next() {
  ST_CHECK_ARG(next_ < end_, "DataLoader::Next: no batch left (position ", next_, ", end ", end_,
               "); check has_next()");
  const int64_t pos = next_++;
  if (!shared_) return LoadBatch(dataset_, batches_, pos, options_.pin_memory);
  Shared& s = *shared_;
  Shared::Slot slot;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    s.ready_cv.wait(lock, [&] { return s.done.count(pos) > 0; });
    auto it = s.done.find(pos);
    slot = std::move(it->second);
    s.done.erase(it);
    s.consumed = pos + 1;
  }
  s.space_cv.notify_all();
  if (slot.error) std::rethrow_exception(slot.error);
  return std::move(slot.batch);
}

}  // namespace shardtrain::trainer
