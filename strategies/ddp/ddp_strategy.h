// DdpStrategy ("ddp"): replicated data parallelism. Every rank holds the whole
// model; WrapModel broadcasts rank 0's parameters and buffers; a syncing
// Backward runs loss.backward() and then averages gradients across ranks:
// gradients are flattened into buckets of at most bucket_cap_mb (in reverse
// parameter order, like PyTorch DDP), all buckets' all-reduces are launched
// asynchronously and then waited on, and the averages are copied back.
// (Bucketing after backward rather than from AccumulateGrad hooks: simpler,
// without overlap of communication and backward compute.)
//
// String options: bucket_cap_mb (default 25), broadcast_buffers (true: rank
// 0's buffers are broadcast before every forward, as PyTorch DDP),
// find_unused_parameters (accepted; a parameter without a gradient
// contributes zeros, so ranks always issue the same collectives).
#ifndef SHARDTRAIN_STRATEGIES_DDP_DDP_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_DDP_DDP_STRATEGY_H_

#include <string>
#include <vector>

#include "strategies/registry.h"
#include "strategies/strategy.h"

namespace shardtrain::strategies {

struct DdpOptions {
  double bucket_cap_mb = 25;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;

  static DdpOptions FromStrings(const StrategyOptions& options);
  static std::vector<std::string> ValidKeys();
};

class DdpStrategy : public Strategy {
 public:
  explicit DdpStrategy(DdpOptions options = {});
  std::string name() const override { return "ddp"; }
  void WrapModel(std::shared_ptr<torch::nn::Module> module) override;
  c10::ScalarType compute_dtype() const override;
  at::Tensor Forward(const std::function<at::Tensor()>& fn) override;
  std::vector<at::Tensor> parameters() const override;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const override;
  void Backward(const at::Tensor& loss, bool sync_gradients = true) override;
  double ClipGradNorm(double max_norm, double norm_type = 2.0) override;
  std::map<std::string, at::Tensor> FullStateDict() override;
  void LoadFullStateDict(const std::map<std::string, at::Tensor>& state) override;

  // Number of buckets of the last gradient synchronization.
  int last_num_buckets() const { return last_num_buckets_; }

 private:
  void SyncGradients();
  DdpOptions options_;
  int last_num_buckets_ = 0;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_DDP_DDP_STRATEGY_H_
