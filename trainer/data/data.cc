#include "trainer/data/data.h"

#include <ATen/ATen.h>

#include "base/errors.h"

namespace shardtrain::trainer {

namespace {
bool IsBuiltinName(const std::string& name) { return name == "inputs" || name == "targets"; }
}  // namespace

const at::Tensor& Batch::get(const std::string& name) const {
  if (name == "inputs" && inputs.defined()) return inputs;
  if (name == "targets" && targets.defined()) return targets;
  auto it = fields.find(name);
  if (it != fields.end()) return it->second;
  std::string valid;
  for (const auto& n : names()) valid += (valid.empty() ? "" : ", ") + n;
  ST_THROW(InvalidArgumentError, "the batch has no tensor '", name, "'; it has: ", valid.empty() ? "none" : valid);
}

void Batch::set(const std::string& name, at::Tensor tensor) {
  if (name == "inputs") {
    inputs = std::move(tensor);
  } else if (name == "targets") {
    targets = std::move(tensor);
  } else {
    fields[name] = std::move(tensor);
  }
}

bool Batch::has(const std::string& name) const {
  if (name == "inputs") return inputs.defined();
  if (name == "targets") return targets.defined();
  return fields.count(name) > 0;
}

std::vector<std::string> Batch::names() const {
  std::vector<std::string> out;
  if (inputs.defined()) out.push_back("inputs");
  if (targets.defined()) out.push_back("targets");
  for (const auto& [k, v] : fields) out.push_back(k);
  return out;
}

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets, std::map<std::string, at::Tensor> fields)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), fields_(std::move(fields)) {
  ST_CHECK_ARG(inputs_.defined() && targets_.defined(), "TensorDataset needs inputs and targets");
  ST_CHECK_ARG(inputs_.dim() >= 1 && targets_.dim() >= 1, "TensorDataset: inputs and targets need a row dimension");
  ST_CHECK_ARG(inputs_.size(0) == targets_.size(0), "TensorDataset: inputs have ", inputs_.size(0),
               " rows but targets have ", targets_.size(0));
  for (const auto& [name, t] : fields_) {
    ST_CHECK_ARG(!IsBuiltinName(name), "TensorDataset: field '", name,
                 "' is reserved (pass it as the inputs or targets argument); use another name");
    ST_CHECK_ARG(t.defined() && t.dim() >= 1, "TensorDataset: field '", name, "' needs a defined tensor with rows");
    ST_CHECK_ARG(t.size(0) == inputs_.size(0), "TensorDataset: field '", name, "' has ", t.size(0),
                 " rows but inputs have ", inputs_.size(0));
  }
}

int64_t TensorDataset::size() const { return inputs_.size(0); }

Batch TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  at::Tensor idx = at::tensor(indices, at::kLong);
  Batch b{inputs_.index_select(0, idx), targets_.index_select(0, idx)};
  for (const auto& [name, t] : fields_) b.fields.emplace(name, t.index_select(0, idx));
  return b;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : size_(dataset_size), replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  ST_CHECK_ARG(num_replicas >= 1 && rank >= 0 && rank < num_replicas, "DistributedSampler: rank ", rank,
               " outside [0, ", num_replicas, ")");
  ST_CHECK_ARG(dataset_size >= 0, "DistributedSampler: negative dataset size");
  num_samples_ = drop_last_ ? dataset_size / replicas_ : (dataset_size + replicas_ - 1) / replicas_;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order(size_);
  if (shuffle_) {
    auto gen = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    at::Tensor perm = at::randperm(size_, gen, at::kLong);
    const int64_t* p = perm.data_ptr<int64_t>();
    for (int64_t i = 0; i < size_; ++i) order[i] = p[i];
  } else {
    for (int64_t i = 0; i < size_; ++i) order[i] = i;
  }
  const int64_t total = num_samples_ * replicas_;
  if (total > size_ && size_ > 0) {  // pad by repeating from the start
    for (int64_t i = 0; static_cast<int64_t>(order.size()) < total; ++i) order.push_back(order[i % size_]);
  }
  order.resize(total);
  std::vector<int64_t> mine;
  mine.reserve(num_samples_);
  for (int64_t i = rank_; i < total; i += replicas_) mine.push_back(order[i]);
  return mine;
}

std::vector<std::vector<int64_t>> MakeBatches(const std::vector<int64_t>& indices, int64_t batch_size, bool drop_last) {
  ST_CHECK_ARG(batch_size > 0, "batch_size must be > 0, got ", batch_size);
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < indices.size(); i += batch_size) {
    const size_t end = std::min(indices.size(), i + static_cast<size_t>(batch_size));
    if (drop_last && static_cast<int64_t>(end - i) < batch_size) break;
    out.emplace_back(indices.begin() + i, indices.begin() + end);
  }
  return out;
}

}  // namespace shardtrain::trainer
