#include "strategies/ddp/ddp_strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>

#include "comm/errors.h"

namespace shardtrain::strategies {

using option_parsing::ParseBool;
using option_parsing::ParseDouble;

std::vector<std::string> DdpOptions::ValidKeys() {
  return {"bucket_cap_mb", "broadcast_buffers", "find_unused_parameters"};
}

DdpOptions DdpOptions::FromStrings(const StrategyOptions& in) {
  DdpOptions o;
  for (const auto& [k, v] : in) {
    if (k == "bucket_cap_mb") o.bucket_cap_mb = ParseDouble("ddp", k, v);
    else if (k == "broadcast_buffers") o.broadcast_buffers = ParseBool("ddp", k, v);
    else if (k == "find_unused_parameters") o.find_unused_parameters = ParseBool("ddp", k, v);
    else ST_THROW(InvalidArgumentError, "strategy 'ddp': unknown option ", k,
                  "; valid options: bucket_cap_mb, broadcast_buffers, find_unused_parameters");
  }
  return o;
}

DdpStrategy::DdpStrategy(DdpOptions options) : options_(options) {
  ST_CHECK_ARG(options_.bucket_cap_mb > 0, "strategy 'ddp': bucket_cap_mb must be > 0, got ", options_.bucket_cap_mb);
}

void DdpStrategy::WrapModel(std::shared_ptr<torch::nn::Module> module) {
  CheckSetUp("WrapModel");
  ST_CHECK_ARG(module != nullptr, "ddp: WrapModel needs a module");
  ST_CHECK_ARG(!module_, "ddp: WrapModel called twice");
  ApplyTruePrecision(*module);
  if (world_size() > 1) {
    at::NoGradGuard no_grad;
    std::vector<comm::WorkPtr> works;
    for (auto& p : module->parameters()) works.push_back(world_->Broadcast(p.detach(), 0));
    for (auto& b : module->buffers()) works.push_back(world_->Broadcast(b, 0));
    for (auto& w : works) w->Wait();
  }
  module_ = std::move(module);
}

c10::ScalarType DdpStrategy::compute_dtype() const {
  return precision_ == "bf16-true" ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
}

at::Tensor DdpStrategy::Forward(const std::function<at::Tensor()>& fn) {
  CheckWrapped("Forward");
  if (options_.broadcast_buffers && world_size() > 1 && at::GradMode::is_enabled()) {
    at::NoGradGuard no_grad;
    std::vector<comm::WorkPtr> works;
    for (auto& b : module_->buffers()) works.push_back(world_->Broadcast(b, 0));
    for (auto& w : works) w->Wait();
  }
  return ForwardWithPrecision(fn);
}

std::vector<at::Tensor> DdpStrategy::parameters() const {
  CheckWrapped("parameters()");
  return module_->parameters();
}

std::vector<std::pair<std::string, at::Tensor>> DdpStrategy::named_parameters() const {
  CheckWrapped("named_parameters()");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module_->named_parameters(true)) out.emplace_back(item.key(), item.value());
  return out;
}

void DdpStrategy::Backward(const at::Tensor& loss, bool sync_gradients) {
  CheckWrapped("Backward");
  torch::autograd::backward({loss});
  if (sync_gradients) SyncGradients();
}

void DdpStrategy::SyncGradients() {
  if (world_size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> params;
  for (auto& p : module_->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  // Buckets in reverse registration order (the order gradients become ready).
  const int64_t cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  struct Bucket {
    std::vector<at::Tensor> params;
    at::Tensor flat;
    comm::WorkPtr work;
  };
  std::vector<Bucket> buckets;
  int64_t bytes = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const int64_t b = it->numel() * it->element_size();
    if (buckets.empty() || (bytes + b > cap && !buckets.back().params.empty()) ||
        buckets.back().params.front().scalar_type() != it->scalar_type()) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().params.push_back(*it);
    bytes += b;
  }
  for (auto& bucket : buckets) {
    std::vector<at::Tensor> pieces;
    for (auto& p : bucket.params) {
      pieces.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, p.options()));
    }
    bucket.flat = at::cat(pieces);
    bucket.work = world_->AllReduce(bucket.flat, {comm::ReduceOp::kAvg});
  }
  for (auto& bucket : buckets) {
    bucket.work->Wait();
    int64_t off = 0;
    for (auto& p : bucket.params) {
      at::Tensor avg = bucket.flat.narrow(0, off, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(avg);
      } else {
        p.mutable_grad() = avg.clone();
      }
      off += p.numel();
    }
  }
  last_num_buckets_ = static_cast<int>(buckets.size());
}

double DdpStrategy::ClipGradNorm(double max_norm, double norm_type) {
  CheckWrapped("ClipGradNorm");
  return ClipLocalGradNorm(parameters(), max_norm, norm_type);
}

std::map<std::string, at::Tensor> DdpStrategy::FullStateDict() {
  CheckWrapped("FullStateDict");
  return ModuleStateDict(*module_);
}

void DdpStrategy::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  CheckWrapped("LoadFullStateDict");
  LoadModuleStateDict(*module_, state);
}

namespace {
const bool kRegistered = RegisterStrategy(
    "ddp", DdpOptions::ValidKeys(),
    [](const StrategyOptions& o) { return std::make_shared<DdpStrategy>(DdpOptions::FromStrings(o)); },
    "replicated data parallel: gradients all-reduced in buckets after backward");
}  // namespace

}  // namespace shardtrain::strategies
