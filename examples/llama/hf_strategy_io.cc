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

namespace {

// Whether some parameter's stored shape is not its global one (a
// tensor-parallel piece).
bool HoldsPieces(strategies::Strategy& s, const std::map<std::string, std::vector<int64_t>>& global) {
  for (const auto& p : s.module().named_parameters(/*recurse=*/true)) {
    if (p.value().sizes().vec() != global.at(p.key())) return true;
  }
  return false;
}

}  // namespace

void LoadHfWeightsInto(strategies::Strategy& s, const LlamaConfig& config, const HfWeights& weights) {
  const std::map<std::string, std::vector<int64_t>> shapes = s.ParameterShapes();
  CheckHfWeights(shapes, config, weights);
  if (HoldsPieces(s, shapes)) {
    // Tensor parallel: the strategy cuts each global (mapped) tensor to this
    // rank's piece before sharding it; the load holds those pieces.
    std::map<std::string, at::Tensor> state;
    for (const auto& [name, shape] : shapes) state[name] = weights.Tensor(name);
    s.LoadFullStateDict(state);
    return;
  }
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
    const std::map<std::string, std::vector<int64_t>> shapes = s.ParameterShapes();  // global
    for (const auto& p : s.module().named_parameters(/*recurse=*/true)) specs.push_back({p.key(), shapes.at(p.key())});
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
