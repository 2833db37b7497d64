#include "sharding/grad_ready_hook.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "base/errors.h"

namespace shardtrain::sharding {
namespace {

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<bool> alive, std::function<void()> on_ready)
      : alive_(std::move(alive)), on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (alive_.lock()) on_ready_();
    return outputs;
  }

 private:
  std::weak_ptr<bool> alive_;
  std::function<void()> on_ready_;
};

}  // namespace

std::shared_ptr<torch::autograd::Node> OnGradientReady(const at::Tensor& param, std::weak_ptr<bool> alive,
                                                       std::function<void()> on_ready) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  ST_CHECK_ARG(acc != nullptr, "a gradient hook needs a leaf tensor that requires grad");
  acc->add_post_hook(std::make_unique<GradReadyHook>(std::move(alive), std::move(on_ready)));
  return acc;
}

}  // namespace shardtrain::sharding
