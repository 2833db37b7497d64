// Data for the Trainer: Batch (inputs, targets and any further named
// tensors), an abstract Dataset that returns whole batches, a TensorDataset
// over row-aligned tensors, and DistributedSampler, which gives each rank its
// share of the indices. (trainer/data/data_loader.h prepares the batches on
// background threads; trainer/data_module.h groups the data sets of a run.)
//
// DistributedSampler follows torch.utils.data.DistributedSampler: with
// shuffle, the order is a permutation drawn from seed + epoch (identical on all
// ranks); rank r takes positions r, r+W, r+2W, ... With drop_last the tail that
// does not divide evenly is dropped; otherwise indices from the start are
// repeated to pad. Either way every rank gets the same number of samples, so
// every rank runs the same number of steps (collectives stay matched).
#ifndef SHARDTRAIN_TRAINER_DATA_DATA_H_
#define SHARDTRAIN_TRAINER_DATA_DATA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtrain::trainer {

// One batch as the Dataset returns it and training_step/validation_step see
// it. `inputs` and `targets` serve the common case ({x, y} still builds one);
// batches of any other structure put further tensors in `fields` by name
// (Lightning's dict batches: a mask, sample weights, a second input, ...).
// The Trainer moves every defined tensor to the rank's device; only `inputs`
// is cast to a low-precision compute dtype (as before).
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
  std::map<std::string, at::Tensor> fields;

  // The tensor named `name`: "inputs", "targets" or a key of `fields`;
  // InvalidArgumentError naming the tensors this batch has otherwise.
  const at::Tensor& get(const std::string& name) const;
  // Sets "inputs", "targets" or a field (added when new).
  void set(const std::string& name, at::Tensor tensor);
  bool has(const std::string& name) const;
  // "inputs" and "targets" when defined, then the field names (sorted).
  std::vector<std::string> names() const;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The samples at `indices` stacked along dimension 0. With the Trainer's
  // num_workers > 0 it is called from several background threads at once
  // (trainer/data/data_loader.h): it must not change shared state, and should not
  // draw from the global random generator (the order of draws would vary).
  virtual Batch get_batch(const std::vector<int64_t>& indices) const = 0;
};

// Samples are rows (dimension 0) of `inputs`, `targets` and each of `fields`
// (all with the same number of rows); a batch carries the same names.
class TensorDataset : public Dataset {
 public:
  TensorDataset(at::Tensor inputs, at::Tensor targets, std::map<std::string, at::Tensor> fields = {});
  int64_t size() const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;

 private:
  at::Tensor inputs_, targets_;
  std::map<std::string, at::Tensor> fields_;
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

#endif  // SHARDTRAIN_TRAINER_DATA_DATA_H_
