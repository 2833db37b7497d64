// A small CNN for 28x28 grey images (Fashion-MNIST):
//
//   ConvBlock(1 -> 32)  : conv 3x3 pad 1, batch norm, ReLU, max-pool 2 -> 32 x 14 x 14
//   ConvBlock(32 -> 64) : conv 3x3 pad 1, batch norm, ReLU, max-pool 2 -> 64 x 7 x 7
//   dropout, flatten
//   Head                : fc 3136 -> 128, ReLU, fc 128 -> 10  -> logits
//
// The two conv blocks and the head are Sharded<> wrap points, so FSDP
// strategies (fsdp_native, fsdp) shard each as its own unit; without a
// sharding strategy (ddp, single_device) the model is a plain module.
// Pooling after each convolution keeps the second convolution at 14x14
// (a quarter of the work at 28x28) on CPU; batch norm gets the model past 90%
// test accuracy in a few epochs. As in PyTorch FSDP and DDP without
// SyncBatchNorm, each rank keeps its own running statistics (buffers); with
// TrainerOptions::sync_batchnorm (--sync_batchnorm) the batch norms become
// SyncBatchNorm (statistics over the global batch): ConvBlock calls its batch
// norm through the module tree for that.
#ifndef SHARDTRAIN_EXAMPLES_FASHION_MNIST_CNN_MODEL_H_
#define SHARDTRAIN_EXAMPLES_FASHION_MNIST_CNN_MODEL_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>

#include "sharding/wrap_point.h"

namespace shardtrain::examples {

struct CnnConfig {
  int64_t channels1 = 32;
  int64_t channels2 = 64;
  int64_t hidden = 128;
  int64_t num_classes = 10;
  double dropout = 0.25;
};

class ConvBlockImpl : public torch::nn::Module {
 public:
  ConvBlockImpl(int64_t in_channels, int64_t out_channels);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Conv2d conv_{nullptr};
  torch::nn::BatchNorm2d bn_{nullptr};
};

class HeadImpl : public torch::nn::Module {
 public:
  HeadImpl(int64_t in_features, int64_t hidden, int64_t num_classes);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};

class CnnImpl : public torch::nn::Module {
 public:
  explicit CnnImpl(const CnnConfig& c = {});
  // x: [B, 1, 28, 28] -> logits [B, num_classes]
  at::Tensor forward(const at::Tensor& x);
  int64_t NumParameters();

 private:
  std::shared_ptr<sharding::Sharded<ConvBlockImpl>> block1_, block2_;
  torch::nn::Dropout dropout_{nullptr};
  std::shared_ptr<sharding::Sharded<HeadImpl>> head_;
};

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_FASHION_MNIST_CNN_MODEL_H_
