// VocabParallelCrossEntropy (declared in tensor_parallel/layers.h).
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "base/errors.h"
#include "tensor_parallel/layers.h"

namespace shardtrain::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void AllReduce(at::Tensor& t, comm::Communicator* group, comm::ReduceOp op) {
  comm::ReduceOptions options;
  options.op = op;
  group->AllReduce(t, options)->Wait();
}

// logits [N, V_local] (float32), targets [N].
struct VocabParallelCrossEntropyFn : torch::autograd::Function<VocabParallelCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_begin, int64_t ignore_index, comm::Communicator* group) {
    const int64_t vocab_local = logits.size(1);
    at::Tensor max = std::get<0>(logits.max(1));
    AllReduce(max, group, comm::ReduceOp::kMax);
    const at::Tensor shifted = logits - max.unsqueeze(1);
    const at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = exp.sum(1);
    AllReduce(sum_exp, group, comm::ReduceOp::kSum);
    const at::Tensor valid = targets != ignore_index;
    const at::Tensor mine = valid & (targets >= vocab_begin) & (targets < vocab_begin + vocab_local);
    const at::Tensor local_targets = (targets - vocab_begin).masked_fill(mine.logical_not(), 0);
    at::Tensor target_logit =
        shifted.gather(1, local_targets.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0);
    AllReduce(target_logit, group, comm::ReduceOp::kSum);
    const at::Tensor count = valid.sum().to(at::kFloat);
    const at::Tensor loss = (sum_exp.log() - target_logit).masked_fill(valid.logical_not(), 0).sum() / count;
    ctx->save_for_backward({exp / sum_exp.unsqueeze(1), local_targets, mine, valid, count});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax over the whole vocabulary, this rank's columns
    grad.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(saved[3].to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(grad_outputs[0] / saved[4]);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_begin,
                                     const comm::CommunicatorPtr& group, int64_t ignore_index) {
  ST_CHECK_ARG(logits.dim() >= 1 && targets.sizes() == logits.sizes().slice(0, logits.dim() - 1),
               "VocabParallelCrossEntropy: targets of shape ", targets.sizes(), " do not match logits of shape ",
               logits.sizes(), " (expected the logits' shape without its last dimension)");
  const at::Tensor flat_logits = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
  const at::Tensor flat_targets = targets.reshape({-1});
  if (!group || group->size() == 1) {
    return at::cross_entropy_loss(flat_logits, flat_targets, {}, at::Reduction::Mean, ignore_index);
  }
  return VocabParallelCrossEntropyFn::apply(flat_logits, flat_targets, vocab_begin, ignore_index, group.get());
}

}  // namespace shardtrain::tensor_parallel
