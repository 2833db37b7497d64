// DataLoader: the batches of one pass over a Dataset (a list of sample-index
// batches, e.g. MakeBatches of a DistributedSampler's indices), prepared on
// background threads so that the training step does not wait for data that
// could have been ready (PyTorch's DataLoader with num_workers threads
// instead of processes).
//
//   DataLoader loader(dataset, MakeBatches(sampler.indices(), 32, false), {/*num_workers=*/2});
//   while (loader.has_next()) train(loader.Next());
//
// Order: Next() returns the batches in exactly the order of the list, at any
// num_workers: worker threads claim batch positions in order and Next() waits
// for the next position, so the batches are those of num_workers = 0 (which
// calls Dataset::get_batch on the calling thread, as the Trainer did before).
// Bounded: at most num_workers * prefetch_factor batches are being prepared
// or waiting at any time, the one Next() returns next included (PyTorch's
// meaning of prefetch_factor); a worker that is that far ahead waits.
// Errors: an exception from get_batch (any thread) is rethrown by the Next()
// that reaches that batch, as DataLoaderError naming the batch position and
// its first sample indices. Destruction (also mid-pass, after an exception,
// with workers blocked on a full queue or inside get_batch) stops the
// workers and joins them: it waits at most for the get_batch calls running.
#ifndef SHARDTRAIN_TRAINER_DATA_DATA_LOADER_H_
#define SHARDTRAIN_TRAINER_DATA_DATA_LOADER_H_

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "base/errors.h"
#include "trainer/data/data.h"

namespace shardtrain::trainer {

// Largest num_workers accepted (threads per loader; each rank has its own).
inline constexpr int kMaxDataLoaderWorkers = 256;

struct DataLoaderOptions {
  // Background threads calling Dataset::get_batch; 0: none (Next() calls it).
  int num_workers = 0;
  // Batches prepared ahead per worker (>= 1; unused with num_workers = 0).
  int prefetch_factor = 2;
  // Copy each batch's CPU tensors into page-locked memory where it is
  // prepared (on the worker with num_workers > 0), so that a later copy to a
  // CUDA device can be asynchronous (PyTorch's DataLoader pin_memory). Needs
  // CUDA; the Trainer sets it when it trains on a CUDA device.
  bool pin_memory = false;
};

// InvalidArgumentError naming the option, its value and the valid range.
void CheckDataLoaderOptions(const DataLoaderOptions& options);

// A get_batch failure, rethrown on the thread that called Next(). what():
// "Dataset::get_batch failed for batch <position> (samples i, j, ...): <cause>".
class DataLoaderError : public Error {
 public:
  DataLoaderError(const std::string& what, int64_t batch_index, std::exception_ptr cause)
      : Error(what), batch_index_(batch_index), cause_(std::move(cause)) {}
  // The failed batch's position in the list given to the DataLoader.
  int64_t batch_index() const { return batch_index_; }
  // What get_batch threw (std::rethrow_exception to inspect its type).
  const std::exception_ptr& cause() const { return cause_; }

 private:
  int64_t batch_index_;
  std::exception_ptr cause_;
};

class DataLoader {
 public:
  // Serves batches[begin], ..., batches[end - 1] (end = -1: to the end of the
  // list; begin > 0 resumes in the middle of a pass). `dataset` must outlive
  // the loader. Starts the workers.
  DataLoader(const Dataset& dataset, std::vector<std::vector<int64_t>> batches, DataLoaderOptions options = {},
             int64_t begin = 0, int64_t end = -1);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The position Next() returns next, and the end of the range.
  int64_t position() const { return next_; }
  int64_t end() const { return end_; }
  bool has_next() const { return next_ < end_; }
  // The batch at position(), then advances; blocks until a worker has
  // prepared it. DataLoaderError if get_batch threw for it;
  // InvalidArgumentError past the end.
  Batch Next();

 private:
  struct Shared;  // the queue the workers fill (data_loader.cc)

  const Dataset& dataset_;
  const std::vector<std::vector<int64_t>> batches_;
  const DataLoaderOptions options_;
  const int64_t end_;
  int64_t next_;
  std::unique_ptr<Shared> shared_;  // null with num_workers = 0
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_DATA_DATA_LOADER_H_
