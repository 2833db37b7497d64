// Activation checkpointing of a unit: forward without saving activations,
// recompute the unit's forward in backward (its parameters were re-gathered
// by then). The WrapPoint side of it (sharding/wrap_point.h).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "sharding/internal/sharded_unit.h"
#include "sharding/sharded_model.h"
#include "sharding/wrap_point.h"

namespace shardtrain::sharding {
namespace {

// One run of a checkpointed forward: what backward needs besides the inputs.
struct CheckpointRun : torch::CustomClassHolder {
  WrapPoint::TensorsFn fn;
  at::Tensor rng_state;  // default CPU generator before the forward
  // The default generator of each accelerator device (CUDA) the inputs live
  // on, before the forward: dropout there recomputes the same masks (as
  // torch.utils.checkpoint's preserve_rng_state).
  std::vector<std::pair<c10::Device, at::Tensor>> device_rng_states;
};

at::Generator DeviceGenerator(const c10::Device& device) { return at::globalContext().defaultGenerator(device); }

// The generator state of each accelerator device `tensors` live on, each device once.
std::vector<std::pair<c10::Device, at::Tensor>> DeviceRngStates(at::TensorList tensors) {
  std::vector<std::pair<c10::Device, at::Tensor>> out;
  for (const auto& t : tensors) {
    if (!t.defined() || t.device().is_cpu() || t.device().is_meta()) continue;
    const c10::Device device = t.device();
    if (std::any_of(out.begin(), out.end(), [&](const auto& s) { return s.first == device; })) continue;
    at::Generator gen = DeviceGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(device, gen.get_state());
  }
  return out;
}

// Sets every saved generator's state, returning the states they had.
std::vector<std::pair<c10::Device, at::Tensor>> SwapDeviceRngStates(
    const std::vector<std::pair<c10::Device, at::Tensor>>& states) {
  std::vector<std::pair<c10::Device, at::Tensor>> before;
  for (const auto& [device, state] : states) {
    at::Generator gen = DeviceGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    before.emplace_back(device, gen.get_state());
    gen.set_state(state);
  }
  return before;
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `anchor` requires grad so that the outputs do even when no input does
  // (the unit's parameters are not inputs of this Function).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                const at::Tensor& anchor, const c10::intrusive_ptr<CheckpointRun>& run) {
    run->rng_state = at::detail::getDefaultCPUGenerator().get_state();
    run->device_rng_states = DeviceRngStates(inputs);
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    ctx->save_for_backward(inputs.vec());
    at::NoGradGuard no_grad;
    auto outputs = run->fn(inputs.vec());
    for (const auto& o : outputs) {
      if (o.defined() && !at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type())) {
        ctx->mark_non_differentiable({o});
      }
    }
    return outputs;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    // saved_data keeps the run alive.
    auto* run = static_cast<CheckpointRun*>(ctx->saved_data["run"].toCapsule().get());
    std::vector<at::Tensor> xs;
    for (const auto& input : ctx->get_saved_variables()) {
      xs.push_back(input.defined() ? input.detach().set_requires_grad(input.requires_grad()) : input);
    }
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor rng_now = gen.get_state();
    gen.set_state(run->rng_state);
    const auto device_rng_now = SwapDeviceRngStates(run->device_rng_states);
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode enable(true);
      outputs = run->fn(xs);
    }
    gen.set_state(rng_now);
    SwapDeviceRngStates(device_rng_now);
    // Backpropagate through the outputs that carry a gradient (unused outputs
    // and ones that do not depend on anything trainable carry none).
    std::vector<at::Tensor> outs, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        outs.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!outs.empty()) torch::autograd::backward(outs, grads);
    torch::autograd::variable_list result;
    for (const auto& x : xs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    result.push_back(at::Tensor());  // anchor
    result.push_back(at::Tensor());  // run
    return result;
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// WrapPoint

void WrapPoint::PreForward() { unit_->model->UnitPreForward(unit_); }
void WrapPoint::PostForward(const std::vector<at::Tensor>& outputs) { unit_->model->UnitPostForward(unit_, outputs); }
bool WrapPoint::checkpointing() const { return unit_ && unit_->model->UnitCheckpointing(unit_); }

void WrapPoint::CheckpointUnsupported(const std::string& why) const {
  ST_THROW(InvalidArgumentError, "activation checkpointing of unit '", unit_ ? unit_->name : std::string("?"), "' (",
           WrapTypeName(), ") is not possible: ", why,
           "; leave this module type out of the activation checkpointing policy");
}

std::vector<at::Tensor> WrapPoint::MaybeCheckpoint(const std::vector<at::Tensor>& inputs, const TensorsFn& fn) {
  if (!checkpointing() || !at::GradMode::is_enabled()) return fn(inputs);
  auto run = c10::make_intrusive<CheckpointRun>();
  run->fn = fn;
  // One anchor per call, not a process-wide one: every apply adds an edge to
  // the anchor's gradient accumulator and writes to that node without a lock
  // (Node::set_next_edges), so ranks run as threads, or two models trained in
  // two threads, raced on a shared one (ThreadSanitizer found it).
  const at::Tensor anchor = at::empty({0}).set_requires_grad(true);
  return CheckpointFunction::apply(at::TensorList(inputs), anchor, run);
}

}  // namespace shardtrain::sharding
