// OnGradientReady: a callback after AccumulateGrad has written a parameter's
// gradient, the readiness signal both the sharding core (per unit) and the
// ddp strategy (per bucket) count to start reductions during backward.
#ifndef SHARDTRAIN_SHARDING_GRAD_READY_HOOK_H_
#define SHARDTRAIN_SHARDING_GRAD_READY_HOOK_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch::autograd {
struct Node;
}

namespace shardtrain::sharding {

// Registers `on_ready` to run after every AccumulateGrad of `param` (a leaf
// that requires grad), as long as `alive` has not expired: hooks that outlive
// their owner do nothing. Returns the parameter's AccumulateGrad node, which
// the caller must keep: a parameter holds it only weakly, and a new one would
// not carry the hook.
std::shared_ptr<torch::autograd::Node> OnGradientReady(const at::Tensor& param, std::weak_ptr<bool> alive,
                                                       std::function<void()> on_ready);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_GRAD_READY_HOOK_H_
