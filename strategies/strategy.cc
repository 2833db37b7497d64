#include "strategies/strategy.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "comm/host_collectives.h"
#include "sharding/grad_clip.h"

namespace shardtrain::strategies {

GradClipAlgorithm ParseGradClipAlgorithm(const std::string& name) {
  if (name == "norm") return GradClipAlgorithm::kNorm;
  if (name == "value") return GradClipAlgorithm::kValue;
  ST_THROW(InvalidArgumentError, "unknown gradient_clip_algorithm '", name, "'; valid: norm, value");
}

const std::vector<std::string>& PrecisionNames() {
  static const std::vector<std::string> names = {"32-true", "bf16-mixed", "16-mixed", "bf16-true"};
  return names;
}

const char* PrecisionName(Precision precision) {
  return PrecisionNames().at(static_cast<size_t>(precision)).c_str();
}

Precision ParsePrecision(const std::string& name) {
  const auto& names = PrecisionNames();
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<Precision>(i);
  }
  std::string valid;
  for (const auto& n : names) valid += (valid.empty() ? "" : ", ") + n;
  ST_THROW(InvalidArgumentError, "unknown precision '", name, "'; valid: ", valid);
}

void CheckPrecision(const std::string& precision) { (void)ParsePrecision(precision); }

Strategy::~Strategy() = default;

void Strategy::set_sharded_construction(bool on) {
  ST_CHECK_ARG(!on, "strategy '", name(), "' holds the whole model on every rank: sharded_construction=true needs a ",
               "sharded strategy (fsdp, fsdp_native); leave it unset or false here");
}

void Strategy::Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) {
  ST_CHECK_ARG(!set_up_, name(), ": Setup called twice");
  world_ = std::move(world);
  cluster_ = cluster;
  if (world_) {
    cluster_.rank = world_->rank();
    cluster_.world_size = world_->size();
  }
  set_up_ = true;
}

void Strategy::SetPrecision(const std::string& precision) {
  const Precision parsed = ParsePrecision(precision);
  ST_CHECK_ARG(!wrapped(), name(), ": SetPrecision must be called before WrapModel");
  precision_ = parsed;
}

void Strategy::SetDevice(const c10::Device& device) {
  ST_CHECK_ARG(!wrapped(), name(), ": SetDevice must be called before WrapModel");
  device_ = device;
}

torch::nn::Module& Strategy::module() {
  CheckWrapped("module()");
  return *module_;
}

void Strategy::CheckSetUp(const char* what) const {
  ST_CHECK_ARG(set_up_, name(), ": call Setup before ", what);
}

void Strategy::CheckWrapped(const char* what) const {
  ST_CHECK_ARG(module_ != nullptr, name(), ": call WrapModel before ", what);
}

int Strategy::rank() const { return world_ ? world_->rank() : 0; }

std::map<std::string, std::vector<int64_t>> Strategy::ParameterShapes() const {
  CheckWrapped("ParameterShapes");
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& item : module_->named_parameters(true)) out[item.key()] = item.value().sizes().vec();
  return out;
}
int Strategy::world_size() const { return world_ ? world_->size() : 1; }

void Strategy::ClampGrads(double clip_value) {
  ST_CHECK_ARG(clip_value > 0, "gradient clip value must be > 0, got ", clip_value);
  at::NoGradGuard no_grad;
  for (auto& p : parameters()) {
    if (p.grad().defined()) p.grad().clamp_(-clip_value, clip_value);
  }
}

void Strategy::ClipGradValue(double clip_value) {
  // Gradients of parameters() are synchronized (and, for sharded strategies,
  // this rank's disjoint shard of the reduced gradient), so an elementwise
  // clamp equals the unsharded one.
  ClampGrads(clip_value);
}

at::Tensor Strategy::ClipGradNormOnDevice(double max_norm, double norm_type) {
  return at::scalar_tensor(ClipGradNorm(max_norm, norm_type), at::kDouble);
}

double Strategy::ClipGradients(double value, GradClipAlgorithm algorithm) {
  if (algorithm == GradClipAlgorithm::kNorm) return ClipGradNorm(value);
  ClipGradValue(value);
  return value;
}

at::Tensor Strategy::ForwardWithPrecision(const std::function<at::Tensor()>& fn) {
  if (precision_ != Precision::kBf16Mixed && precision_ != Precision::k16Mixed) return fn();
  // Autocast for CPU and CUDA tensors (a model on a CUDA device, accelerator=cuda).
  const auto dtype = precision_ == Precision::kBf16Mixed ? at::kBFloat16 : at::kHalf;
  struct Restore {
    bool enabled[2];
    at::ScalarType dtype[2];
    ~Restore() {
      const c10::DeviceType devs[2] = {at::kCPU, at::kCUDA};
      for (int i = 0; i < 2; ++i) {
        at::autocast::set_autocast_enabled(devs[i], enabled[i]);
        at::autocast::set_autocast_dtype(devs[i], dtype[i]);
      }
      if (!enabled[0] && !enabled[1]) at::autocast::clear_cache();
    }
  } restore{{at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA)},
            {at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)}};
  for (const c10::DeviceType dev : {at::kCPU, at::kCUDA}) {
    at::autocast::set_autocast_enabled(dev, true);
    at::autocast::set_autocast_dtype(dev, dtype);
  }
  return fn();
}

void Strategy::ApplyTruePrecision(torch::nn::Module& module) {
  if (precision_ != Precision::kBf16True) return;
  at::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (at::isFloatingType(p.scalar_type())) p.set_data(p.to(at::kBFloat16));
  }
  for (auto& b : module.buffers()) {
    if (at::isFloatingType(b.scalar_type())) b.set_data(b.to(at::kBFloat16));
  }
}

namespace {
// NCCL takes CUDA tensors only: metric collectives then run on the current CUDA device.
double Reduce(const comm::CommunicatorPtr& world, double v, comm::ReduceOp op) {
  if (!world || world->size() == 1) return v;
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(comm::CollectiveDevice(*world)));
  world->AllReduce(t, {op})->Wait();
  return t.item<double>();
}
}  // namespace

double Strategy::ReduceMean(double v) { return Reduce(world_, v, comm::ReduceOp::kAvg); }
double Strategy::ReduceSum(double v) { return Reduce(world_, v, comm::ReduceOp::kSum); }
double Strategy::ReduceMax(double v) { return Reduce(world_, v, comm::ReduceOp::kMax); }

void Strategy::Barrier() {
  if (world_ && world_->size() > 1) world_->Barrier()->Wait();
}

void Strategy::Broadcast(const at::Tensor& tensor, int root) {
  if (world_) comm::HostBroadcast(*world_, tensor, root);
}

at::Tensor ClipLocalGradNorm(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                             const comm::CommunicatorPtr& shard_group) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) grads.push_back(p.grad());
  return sharding::ClipGradNorm(grads, max_norm, norm_type, shard_group);
}

std::vector<std::pair<std::string, at::Tensor>> UniqueNamedParameters(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::vector<Strategy::UnitSummary> Strategy::UnitSummaries() const {
  CheckWrapped("UnitSummaries");
  std::vector<UnitSummary> rows;
  std::map<std::string, size_t> row_of;  // first name component -> row
  for (const auto& [name, p] : UniqueNamedParameters(*module_)) {
    const auto dot = name.find('.');
    const std::string unit = dot == std::string::npos ? "" : name.substr(0, dot);
    const auto [it, added] = row_of.emplace(unit, rows.size());
    if (added) {
      rows.emplace_back();
      rows.back().name = unit;
    }
    UnitSummary& r = rows[it->second];
    r.parameters += p.numel();
    if (p.requires_grad()) r.trainable += p.numel();
    r.shard_elements += p.numel();  // replicated: every rank stores the whole unit
    r.shard_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return rows;
}

std::vector<at::Tensor> UniqueParameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : UniqueNamedParameters(module)) out.push_back(t);
  return out;
}

std::map<std::string, at::Tensor> ModuleStateDict(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  auto add = [&](const std::string& k, const at::Tensor& v) {
    at::Tensor t = v.detach();
    if (at::isFloatingType(t.scalar_type())) t = t.to(at::kFloat);
    out[k] = t.cpu().clone();
  };
  for (const auto& item : module.named_parameters(true)) add(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) add(item.key(), item.value());
  return out;
}

void LoadModuleStateDict(torch::nn::Module& module, const std::map<std::string, at::Tensor>& state) {
  std::ostringstream problems;
  std::vector<std::pair<std::string, at::Tensor>> targets;
  for (const auto& item : module.named_parameters(true)) targets.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) targets.emplace_back(item.key(), item.value());
  std::set<std::string> expected;
  for (const auto& [k, t] : targets) {
    expected.insert(k);
    auto it = state.find(k);
    if (it == state.end()) {
      problems << "\n  missing: '" << k << "' " << t.sizes();
    } else if (it->second.sizes() != t.sizes()) {
      problems << "\n  shape mismatch: '" << k << "' is " << it->second.sizes() << " in the state dict, " << t.sizes()
               << " in the model";
    }
  }
  for (const auto& [k, v] : state) {
    if (!expected.count(k)) problems << "\n  unexpected: '" << k << "' " << v.sizes();
  }
  if (!problems.str().empty()) {
    ST_THROW(InvalidArgumentError, "state dict does not match the model (nothing was loaded):", problems.str());
  }
  at::NoGradGuard no_grad;
  for (auto& [k, t] : targets) t.copy_(state.at(k));
}

}  // namespace shardtrain::strategies
