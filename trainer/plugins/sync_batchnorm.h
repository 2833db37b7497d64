// SyncBatchNorm: batch normalization over the global batch of all ranks
// (torch.nn.SyncBatchNorm; TrainerOptions::sync_batchnorm).
//
// In training each layer all-reduces [sum, sum of squares, count] of its input
// per channel once in forward and [sum of dy, sum of dy * (x - mean)] once in
// backward, so outputs, input gradients and (after the strategy's gradient
// averaging) parameter gradients equal those of one process normalizing the
// concatenated batch; running statistics are updated as BatchNorm does, with
// the global mean and unbiased variance (the same on every rank). In eval mode
// it normalizes with the running statistics, as BatchNorm.
//
// ConvertSyncBatchNorm replaces every BatchNorm1d/2d/3d of a module tree by a
// SyncBatchNorm holding the same parameters and buffers (the state dict is
// unchanged). LibTorch modules usually keep children in typed members
// (torch::nn::BatchNorm2d bn_; bn_->forward(x)): such a call still reaches the
// original module, which the returned SyncBatchNormConversion detects at the
// first training batch (InvalidArgumentError naming the layer). Models meant
// for sync_batchnorm call their BatchNorm through the module tree with
// ForwardBatchNorm(*this, "bn", x).
#ifndef SHARDTRAIN_TRAINER_PLUGINS_SYNC_BATCHNORM_H_
#define SHARDTRAIN_TRAINER_PLUGINS_SYNC_BATCHNORM_H_

#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace shardtrain::trainer {

// The tensors a SyncBatchNorm takes over from a BatchNorm (undefined: fresh ones).
struct BatchNormTensors {
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};

class SyncBatchNormImpl : public torch::nn::Module {
 public:
  // `dims`: 1, 2 or 3 (what BatchNorm<dims>d it replaces: inputs of rank 2 or
  // 3, 4, 5). `group`: the ranks to normalize over (null or size 1: local).
  // `tensors`: parameters and buffers to register (a converted BatchNorm's);
  // those undefined are made as BatchNorm makes them.
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, int dims, comm::CommunicatorPtr group,
                    BatchNormTensors tensors = {});
  at::Tensor forward(const at::Tensor& input);

  torch::nn::BatchNormOptions options;
  // As BatchNorm's (undefined without affine / track_running_stats).
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  int dims_;
  comm::CommunicatorPtr group_;
};

// What ConvertSyncBatchNorm replaced.
class SyncBatchNormConversion {
 public:
  // Names of the converted layers ("block1.bn", ...).
  const std::vector<std::string>& layers() const { return names_; }
  // Throws InvalidArgumentError when a replaced BatchNorm ran in training
  // since the conversion (the model calls it through a typed member, so the
  // layer is not synchronized). The Trainer calls it after the first training_step.
  void CheckNotBypassed() const;

 private:
  friend SyncBatchNormConversion ConvertSyncBatchNorm(torch::nn::Module&, const comm::CommunicatorPtr&);
  std::vector<std::string> names_;
  // Each replaced module (forced to training mode) with a private
  // num_batches_tracked of its own: it counts only calls that bypass the tree.
  std::vector<std::shared_ptr<torch::nn::Module>> replaced_;
  std::vector<at::Tensor> bypass_counts_;
  mutable bool checked_ = false;  // checked once
};

// Replaces every BatchNorm1d/2d/3d below `root` (not `root` itself) by a
// SyncBatchNorm over `group`, sharing its tensors.
SyncBatchNormConversion ConvertSyncBatchNorm(torch::nn::Module& root, const comm::CommunicatorPtr& group);

// Runs `parent`'s child `name`: a BatchNorm1d/2d/3d or a SyncBatchNorm
// (InvalidArgumentError for anything else or a missing child).
at::Tensor ForwardBatchNorm(torch::nn::Module& parent, const std::string& name, const at::Tensor& input);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_PLUGINS_SYNC_BATCHNORM_H_
