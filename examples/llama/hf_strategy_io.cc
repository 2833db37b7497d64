#include "examples/llama/hf_strategy_io.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "sharding/source_release.h"
#include "strategies/strategy.h"
#include "trainer/checkpoint_io/archive.h"

namespace shardtrain::examples::llama {

void LoadHfWeightsInto(strategies::Strategy& s, const LlamaConfig& config, const HfWeights& weights) {
  CheckHfWeights(s.module(), config, weights);
  if (!s.has_sharded_state()) {
    LoadHfWeights(s.module(), config, weights);
    return;
  }
  std::map<std::string, int64_t> numel;
  for (const auto& p : s.module().named_parameters(/*recurse=*/true)) numel[p.key()] = p.value().numel();
  const sharding::ShardedStateDict sd = s.ShardedState();
  sharding::SourceReleaseScope release(&trainer::ReleaseMappedPages);
  at::NoGradGuard no_grad;
  s.LoadShardsWith(
      [&](size_t u, at::Tensor& shard) {
        const sharding::UnitInfo& unit = sd.units[u];
        const int64_t lo = sd.shard_rank * unit.shard_numel, hi = lo + unit.shard_numel;
        int64_t at = 0;  // where the parameter starts in the unit's flat layout
        for (const std::string& name : unit.param_names) {
          const int64_t n = numel.at(name), b = std::max(lo, at), e = std::min(hi, at + n);
          if (b < e) {
            const at::Tensor run = weights.Range(name, b - at, e - b);
            shard.narrow(0, b - lo, e - b).copy_(run);
            sharding::SourceReleaseScope::Release(run);
          }
          at += n;
        }
      },
      /*buffers=*/{});
}

void SaveHfModel(strategies::Strategy& s, const std::string& dir, const LlamaConfig& config,
                 const HfSaveOptions& options) {
  std::unique_ptr<HfModelWriter> writer;
  if (s.rank() == 0) {
    std::vector<HfTensorSpec> specs;
    for (const auto& p : s.module().named_parameters(/*recurse=*/true)) {
      specs.push_back({p.key(), p.value().sizes().vec()});
    }
    writer = std::make_unique<HfModelWriter>(dir, config, specs, options);
  }
  strategies::Strategy::FullStateSink sink;
  sink.add = [](const at::Tensor& full) { return full; };  // written at once by name(), while it is valid
  sink.name = [&](const std::string& name, const at::Tensor& full) {
    if (writer != nullptr && writer->Has(name)) writer->Write(name, full);
  };
  s.ForEachFullStateTensor(/*root=*/0, sink);
  if (writer != nullptr) writer->Commit();
}

}  // namespace shardtrain::examples::llama
