#include "examples/fashion_mnist/cnn_model.h"

#include <ATen/ATen.h>

#include "trainer/plugins/sync_batchnorm.h"

namespace shardtrain::examples {

ConvBlockImpl::ConvBlockImpl(int64_t in_channels, int64_t out_channels) {
  conv_ = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, out_channels, 3).padding(1)));
  bn_ = register_module("bn", torch::nn::BatchNorm2d(out_channels));
}

at::Tensor ConvBlockImpl::forward(const at::Tensor& x) {
  // Through the module tree, so that sync_batchnorm's SyncBatchNorm replaces it (trainer/plugins/sync_batchnorm.h).
  return at::max_pool2d(at::relu(trainer::ForwardBatchNorm(*this, "bn", conv_->forward(x))), {2, 2});
}

HeadImpl::HeadImpl(int64_t in_features, int64_t hidden, int64_t num_classes) {
  fc1_ = register_module("fc1", torch::nn::Linear(in_features, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, num_classes));
}

at::Tensor HeadImpl::forward(const at::Tensor& x) { return fc2_->forward(at::relu(fc1_->forward(x))); }

CnnImpl::CnnImpl(const CnnConfig& c) {
  block1_ = register_module("block1", std::make_shared<sharding::Sharded<ConvBlockImpl>>(1, c.channels1));
  block2_ = register_module("block2", std::make_shared<sharding::Sharded<ConvBlockImpl>>(c.channels1, c.channels2));
  dropout_ = register_module("dropout", torch::nn::Dropout(c.dropout));
  head_ = register_module("head", std::make_shared<sharding::Sharded<HeadImpl>>(c.channels2 * 7 * 7, c.hidden,
                                                                                  c.num_classes));
}

at::Tensor CnnImpl::forward(const at::Tensor& x) {
  at::Tensor h = block2_->forward(block1_->forward(x));
  return head_->forward(dropout_->forward(h).flatten(1));
}

int64_t CnnImpl::NumParameters() {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace shardtrain::examples
