// Data for the Trainer: an abstract Dataset that returns whole batches, a
// TensorDataset over two tensors, and DistributedSampler, which gives each rank
// its share of the indices.
//
// DistributedSampler follows torch.utils.data.DistributedSampler: with
// shuffle, the order is a permutation drawn from seed + epoch (identical on all
// ranks); rank r takes positions r, r+W, r+2W, ... With drop_last the tail that
// does not divide evenly is dropped; otherwise indices from the start are
// repeated to pad. Either way every rank gets the same number of samples, so
// every rank runs the same number of steps (collectives stay matched).
#ifndef SHARDTRAIN_TRAINER_DATA_H_
#define SHARDTRAIN_TRAINER_DATA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardtrain::trainer {

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The samples at `indices` stacked along dimension 0.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const = 0;
};

// Samples are rows (dimension 0) of `inputs` and `targets`.
class TensorDataset : public Dataset {
 public:
  TensorDataset(at::Tensor inputs, at::Tensor targets);
  int64_t size() const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;

 private:
  at::Tensor inputs_, targets_;
};

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle, uint64_t seed, bool drop_last);
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  // Samples per rank per epoch.
  int64_t num_samples() const { return num_samples_; }
  // This rank's indices for the current epoch.
  std::vector<int64_t> indices() const;

 private:
  int64_t size_;
  int replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
  int64_t num_samples_;
};

// Batches of `batch_size` from `indices`; the last smaller batch is kept
// unless drop_last (it is the same size on every rank).
std::vector<std::vector<int64_t>> MakeBatches(const std::vector<int64_t>& indices, int64_t batch_size, bool drop_last);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_DATA_H_
