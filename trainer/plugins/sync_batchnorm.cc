#include "trainer/plugins/sync_batchnorm.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>

#include <cstdint>

#include "base/errors.h"

namespace shardtrain::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Dimensions reduced per channel: all but 1.
std::vector<int64_t> ReduceDims(const at::Tensor& x) {
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [1, C, 1, ...] to broadcast a per-channel vector over x.
std::vector<int64_t> ChannelShape(const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = x.size(1);
  return shape;
}

// float for float, half and bfloat16 inputs; double for double.
at::ScalarType ComputeType(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

comm::Communicator* GroupOf(AutogradContext* ctx) {
  return reinterpret_cast<comm::Communicator*>(static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
}

// Batch normalization with statistics over the batches of every rank of
// `group` (the module outlives forward and backward, and with it the group).
struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                            double momentum, double eps, comm::Communicator* group) {
    const int64_t C = input.size(1);
    const auto dims = ReduceDims(input);
    const auto shape = ChannelShape(input);
    const at::Tensor x = input.to(ComputeType(input));
    // Per channel: sum and sum of squares (this rank's, in double: the sum of
    // squares is taken around this rank's mean c, then shifted back, so the
    // global variance does not lose what float squares would), and the count.
    const double n_local = static_cast<double>(x.numel() / std::max<int64_t>(C, 1));
    const at::Tensor s = x.sum(dims, false, at::kDouble);
    const at::Tensor c = (s / std::max(n_local, 1.0)).to(x.scalar_type()).to(at::kDouble);
    const at::Tensor m2 = (x - c.to(x.scalar_type()).view(shape)).square().sum(dims, false, at::kDouble);
    at::Tensor stats = at::cat({s, m2 + 2 * c * s - n_local * c * c, at::full({1}, n_local, s.options())});
    group->AllReduce(stats)->Wait();
    const double n = stats[2 * C].item<double>();
    ST_CHECK_ARG(n > 1, "SyncBatchNorm: expected more than 1 value per channel in training over all ranks, got input ",
                 input.sizes(), " (", n, " values per channel in the global batch)");
    const at::Tensor mean = stats.slice(0, 0, C) / n;
    const at::Tensor var = (stats.slice(0, C, 2 * C) / n - mean.square()).clamp_min(0);
    const at::Tensor invstd = (var + eps).rsqrt();
    if (running_mean.defined()) {
      running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
      running_var.mul_(1 - momentum).add_((var * (n / (n - 1))).to(running_var.scalar_type()), momentum);
    }
    const at::Tensor mean_x = mean.to(x.scalar_type());
    const at::Tensor invstd_x = invstd.to(x.scalar_type());
    at::Tensor y = (x - mean_x.view(shape)) * invstd_x.view(shape);
    if (weight.defined()) y = y * weight.to(x.scalar_type()).view(shape);
    if (bias.defined()) y = y + bias.to(x.scalar_type()).view(shape);
    ctx->save_for_backward({input, weight, mean_x, invstd_x});
    ctx->saved_data["n"] = n;
    ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
    return y.to(input.scalar_type());
  }

  // As torch.nn.SyncBatchNorm: the weight and bias gradients are this rank's
  // (the strategy averages them like any gradient); the input gradient needs
  // the global sums of dy and dy * (x - mean): one all-reduce.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const double n = ctx->saved_data["n"].toDouble();
    const int64_t C = input.size(1);
    const auto dims = ReduceDims(input);
    const auto shape = ChannelShape(input);
    const at::Tensor x = input.to(mean.scalar_type());
    const at::Tensor dy = grad_outputs[0].to(mean.scalar_type());
    const at::Tensor xmu = x - mean.view(shape);
    const at::Tensor sum_dy = dy.sum(dims, false, at::kDouble);
    const at::Tensor sum_dy_xmu = (dy * xmu).sum(dims, false, at::kDouble);
    at::Tensor grad_input, grad_weight, grad_bias;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      grad_weight = (sum_dy_xmu * invstd.to(at::kDouble)).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.defined() ? weight.scalar_type() : input.scalar_type());
    if (ctx->needs_input_grad(0)) {
      at::Tensor sums = at::cat({sum_dy, sum_dy_xmu});
      GroupOf(ctx)->AllReduce(sums)->Wait();
      const at::Tensor mean_dy = (sums.slice(0, 0, C) / n).to(x.scalar_type());
      const at::Tensor mean_dy_xmu = (sums.slice(0, C, 2 * C) / n).to(x.scalar_type());
      at::Tensor scale = invstd;
      if (weight.defined()) scale = scale * weight.to(x.scalar_type());
      grad_input = (dy - mean_dy.view(shape) - xmu * (invstd.square() * mean_dy_xmu).view(shape)) * scale.view(shape);
      grad_input = grad_input.to(input.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void CheckInputDims(const at::Tensor& input, int dims) {
  const bool ok = dims == 1 ? (input.dim() == 2 || input.dim() == 3) : input.dim() == dims + 2;
  ST_CHECK_ARG(ok, "SyncBatchNorm (replacing a BatchNorm", dims, "d): expected a ",
               dims == 1 ? std::string("2D or 3D") : std::to_string(dims + 2) + "D", " input, got ", input.dim(),
               "D ", input.sizes());
}

template <class BN>
bool Replace(torch::nn::Module& parent, const std::string& key, const std::string& name,
             const std::shared_ptr<torch::nn::Module>& child, int dims, const comm::CommunicatorPtr& group,
             std::vector<std::string>* names, std::vector<std::shared_ptr<torch::nn::Module>>* replaced,
             std::vector<at::Tensor>* counts) {
  auto bn = std::dynamic_pointer_cast<BN>(child);
  if (!bn) return false;
  parent.replace_module(key, std::make_shared<SyncBatchNormImpl>(
                                 bn->options, dims, group,
                                 BatchNormTensors{bn->weight, bn->bias, bn->running_mean, bn->running_var,
                                                  bn->num_batches_tracked}));
  // From now on the old module counts only the calls that bypass the tree.
  bn->train(true);
  if (bn->num_batches_tracked.defined()) bn->num_batches_tracked = at::zeros_like(bn->num_batches_tracked);
  names->push_back(name);
  replaced->push_back(bn);
  counts->push_back(bn->num_batches_tracked);
  return true;
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_, int dims,
                                     comm::CommunicatorPtr group, BatchNormTensors t)
    : options(options_), dims_(dims), group_(std::move(group)) {
  ST_CHECK_ARG(dims >= 1 && dims <= 3, "SyncBatchNorm: dims must be 1, 2 or 3 (BatchNorm1d/2d/3d), got ", dims);
  const int64_t C = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", t.weight.defined() ? t.weight : at::ones({C}));
    bias = register_parameter("bias", t.bias.defined() ? t.bias : at::zeros({C}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", t.running_mean.defined() ? t.running_mean : at::zeros({C}));
    running_var = register_buffer("running_var", t.running_var.defined() ? t.running_var : at::ones({C}));
    num_batches_tracked = register_buffer("num_batches_tracked", t.num_batches_tracked.defined()
                                                                     ? t.num_batches_tracked
                                                                     : at::zeros({}, at::kLong));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  CheckInputDims(input, dims_);
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats() && num_batches_tracked.defined()) {
    num_batches_tracked += 1;
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();  // cumulative average
  }
  if (!is_training() || !group_ || group_->size() == 1) {
    return at::batch_norm(input, weight, bias, running_mean, running_var,
                          is_training() || !options.track_running_stats(), factor, options.eps(),
                          at::globalContext().userEnabledCuDNN());
  }
  return SyncBatchNormFunction::apply(input, weight, bias, running_mean, running_var, factor, options.eps(),
                                      group_.get());
}

namespace {
void ConvertBelow(torch::nn::Module& m, const std::string& prefix, const comm::CommunicatorPtr& group,
                  std::vector<std::string>* names, std::vector<std::shared_ptr<torch::nn::Module>>* replaced,
                  std::vector<at::Tensor>* counts) {
  for (const auto& item : m.named_children()) {
    const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
    const auto& child = item.value();
    if (Replace<torch::nn::BatchNorm1dImpl>(m, item.key(), name, child, 1, group, names, replaced, counts) ||
        Replace<torch::nn::BatchNorm2dImpl>(m, item.key(), name, child, 2, group, names, replaced, counts) ||
        Replace<torch::nn::BatchNorm3dImpl>(m, item.key(), name, child, 3, group, names, replaced, counts)) {
      continue;
    }
    ConvertBelow(*child, name, group, names, replaced, counts);
  }
}
}  // namespace

SyncBatchNormConversion ConvertSyncBatchNorm(torch::nn::Module& root, const comm::CommunicatorPtr& group) {
  SyncBatchNormConversion c;
  ConvertBelow(root, "", group, &c.names_, &c.replaced_, &c.bypass_counts_);
  return c;
}

void SyncBatchNormConversion::CheckNotBypassed() const {
  if (checked_) return;
  checked_ = true;
  for (size_t i = 0; i < names_.size(); ++i) {
    const at::Tensor& count = bypass_counts_[i];
    ST_CHECK_ARG(!count.defined() || count.item<int64_t>() == 0, "sync_batchnorm: the model called BatchNorm '",
                 names_[i],
                 "' through its own member (e.g. torch::nn::BatchNorm2d bn_; bn_->forward(x)), which still holds the "
                 "original module, not through the module tree: that layer would not be synchronized. Call it with "
                 "ForwardBatchNorm(*this, \"<child name>\", x) (trainer/plugins/sync_batchnorm.h), or set sync_batchnorm "
                 "to false");
  }
}

at::Tensor ForwardBatchNorm(torch::nn::Module& parent, const std::string& name, const at::Tensor& input) {
  const auto children = parent.named_children();
  const auto* child = children.find(name);
  ST_CHECK_ARG(child != nullptr, "ForwardBatchNorm: module ", parent.name(), " has no child '", name, "'");
  if (auto s = std::dynamic_pointer_cast<SyncBatchNormImpl>(*child)) return s->forward(input);
  if (auto b = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(*child)) return b->forward(input);
  if (auto b = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(*child)) return b->forward(input);
  if (auto b = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(*child)) return b->forward(input);
  ST_THROW(InvalidArgumentError, "ForwardBatchNorm: child '", name, "' of ", parent.name(),
           " is not a BatchNorm1d/2d/3d or SyncBatchNorm");
}

}  // namespace shardtrain::trainer
