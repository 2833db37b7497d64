// Hugging Face directories in and out of a model that a strategy has
// wrapped. Loading: Under a sharded strategy each rank reads only the element
// ranges of the parameters its shards own, straight from the mapped
// safetensors files into its shards (a parameter's range in a unit's flat
// shard is a contiguous run of its row-major elements), and drops each run's
// pages from the process once copied: the peak per rank is its own shards
// plus the few pages in flight, never the whole model. Under model_parallel
// (tensor parallel) each rank cuts its tensor-parallel pieces from the mapped
// tensors and the strategy shards them (the load holds those pieces: 1/tp of
// the model). Other strategies copy every parameter. Names and shapes are
// the global ones. Saving gathers the full parameters one unit at a time
// (ForEachFullStateTensor) and rank 0 writes each into its place in the
// files as it arrives: no rank ever holds the whole model.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_HF_STRATEGY_IO_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_HF_STRATEGY_IO_H_

#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/llama_config.h"

namespace shardtrain::strategies {
class Strategy;
}

namespace shardtrain::examples::llama {

// Names and shapes are checked first (CheckHfWeights: every problem listed,
// nothing changed); then every rank loads its part. Call on every rank after
// WrapModel (it communicates as the strategy's LoadShardsWith does).
void LoadHfWeightsInto(strategies::Strategy& strategy, const LlamaConfig& config, const HfWeights& weights);

// Writes the wrapped model as a Hugging Face directory at `dir` (HfModelWriter
// on rank 0). Collective: every rank calls it.
void SaveHfModel(strategies::Strategy& strategy, const std::string& dir, const LlamaConfig& config,
                 const HfSaveOptions& options);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_HF_STRATEGY_IO_H_
