// DdpStrategy ("ddp"): replicated data parallelism. Every rank holds the whole
// model; WrapModel broadcasts rank 0's parameters and buffers and groups the
// trainable parameters into buckets of at most bucket_cap_mb, in reverse
// registration order (the order gradients become ready, as PyTorch DDP).
// Each bucket is one flat buffer and the parameters' .grad are views into it,
// so gradients accumulate straight into the buffer and need no copies. In a
// syncing Backward an AccumulateGrad post-hook counts each bucket's ready
// gradients; a complete bucket's all-reduce (average) is launched right away,
// overlapping the rest of backward. Buckets launch strictly in index order, so
// every rank issues the same collectives in the same order; buckets whose
// parameters got no gradient (unused in this forward) launch when backward
// ends, and with find_unused_parameters=false (the default, as PyTorch DDP)
// Backward then throws naming them. Backward returns once every bucket's
// average is in place.
//
// String options: DdpOptions::Table() (ddp_strategy.cc), listed in
// docs/strategy_options.md.
#ifndef SHARDTRAIN_STRATEGIES_DDP_DDP_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_DDP_DDP_STRATEGY_H_

#include <memory>
#include <string>
#include <vector>

#include "strategies/registry.h"
#include "strategies/replicated_strategy_base.h"

namespace shardtrain::strategies {

struct DdpOptions {
  double bucket_cap_mb = 25;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;

  // The string options: key, values, doc, and which field each sets.
  static const OptionTable<DdpOptions>& Table();
  static DdpOptions FromStrings(const StrategyOptions& options);
};

class DdpStrategy : public ReplicatedStrategyBase {
 public:
  explicit DdpStrategy(DdpOptions options = {});
  std::string name() const override { return "ddp"; }
  void WrapModel(std::shared_ptr<torch::nn::Module> module) override;
  at::Tensor Forward(const std::function<at::Tensor()>& fn) override;
  void Backward(const at::Tensor& loss, bool sync_gradients = true) override;

  ~DdpStrategy() override;

  // Number of gradient buckets (each one all-reduce per syncing Backward).
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // How many buckets the last syncing Backward launched while backward was
  // still running (the rest launched when it ended).
  int last_launched_during_backward() const { return launched_during_backward_; }

 private:
  struct Bucket;
  void OnGradReady(size_t bucket, size_t index);
  void BuildBuckets();
  void ArmGradViews();
  void FillBucket(Bucket& b);
  void LaunchInOrder(bool flush);
  std::vector<std::string> Unused() const;
  [[noreturn]] static void ThrowUnused(const std::vector<std::string>& unused);
  DdpOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // hooks outliving this strategy do nothing
  bool syncing_ = false;     // inside a syncing Backward at W > 1 (buckets launch)
  bool counting_ = false;    // inside a syncing Backward (which gradients arrive is counted)
  bool in_backward_ = false;
  size_t next_launch_ = 0;
  int launched_during_backward_ = 0;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_DDP_DDP_STRATEGY_H_
