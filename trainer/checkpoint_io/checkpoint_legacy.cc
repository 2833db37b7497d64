// Reading the full checkpoints of earlier releases (format 1: "hparams",
// "optimizer_full", string-valued callbacks and lr schedulers), so that
// their runs still resume (trainer/checkpoint_io/internal/layout.h).
#include <ATen/ATen.h>

#include "trainer/checkpoint_io/internal/layout.h"

namespace shardtrain::trainer::internal {
namespace {

std::map<std::string, std::string> Strings(const c10::IValue& v) {
  std::map<std::string, std::string> out;
  for (const auto& e : v.toGenericDict()) out[e.key().toStringRef()] = e.value().toStringRef();
  return out;
}

}  // namespace

void ReadLegacyLayout(const c10::impl::GenericDict& d, CheckpointData& out) {
  out.legacy_layout = true;
  for (const auto& t : At(d, "optimizer_states").toList()) {
    at::Tensor b = t.get().toTensor().contiguous();
    out.optimizer_states.emplace_back(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()), b.numel());
  }
  out.epoch = At(d, "epoch").toInt();
  out.global_step = At(d, "global_step").toInt();
  out.batch_in_epoch = At(d, "batch_in_epoch").toInt();
  out.world_size = At(d, "world_size").toInt();
  out.strategy = At(d, "strategy").toStringRef();
  out.rng_state = At(d, "rng_state").toTensor();
  out.hparams = InferTypes(Strings(At(d, "hparams")));
  if (d.contains("cuda_rng_states")) {
    for (const auto& t : d.at("cuda_rng_states").toList()) out.cuda_rng_states.push_back(t.get().toTensor());
  }
  if (d.contains("optimizer_full")) {
    auto of = d.at("optimizer_full").toGenericDict();
    out.optimizer_full.kind = of.at("kind").toStringRef();
    for (const auto& e : of.at("state").toGenericDict()) {
      auto& keys = out.optimizer_full.state[e.key().toStringRef()];
      for (const auto& k : e.value().toGenericDict()) keys[k.key().toStringRef()] = k.value().toTensor();
    }
    for (const auto& e : of.at("step").toGenericDict())
      out.optimizer_full.step[e.key().toStringRef()] = e.value().toInt();
  }
  if (d.contains("callbacks")) {
    for (const auto& e : d.at("callbacks").toGenericDict()) {
      out.callbacks[e.key().toStringRef()] = InferTypes(Strings(e.value()));
    }
  }
  if (d.contains("grad_scaler")) out.grad_scaler = GradScalerStateFromIValue(d.at("grad_scaler"));
  if (d.contains("lr_schedulers")) out.lr_schedulers = LRSchedulerStatesFromIValue(d.at("lr_schedulers"));
}

}  // namespace shardtrain::trainer::internal
