// The model summary Fit prints at its start (TrainerOptions::
// enable_model_summary; Lightning's ModelSummary): one row per unit of the
// wrapped model, from the strategy (Strategy::UnitSummaries) — parameters,
// trainable parameters, the elements this rank stores, and an estimate of
// this rank's bytes for parameters + gradients + optimizer state — and totals.
//
//   ModelSummary s = SummarizeModel(trainer.strategy(), trainer.optimizer());
//   std::cout << FormatModelSummary(s);
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_MODEL_SUMMARY_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_MODEL_SUMMARY_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}
namespace shardtrain::strategies {
class Strategy;
}

namespace shardtrain::trainer {

struct ModelSummaryRow {
  std::string name;            // unit's module path; "(root)" for the root unit
  int64_t parameters = 0;      // elements of the whole unit (all ranks together)
  int64_t trainable = 0;       // of those, requiring grad
  int64_t shard_elements = 0;  // elements this rank stores (a shard, or everything when replicated)
  int64_t param_bytes = 0;     // bytes of those
  // Estimate of this rank's bytes for the unit: parameters, gradients of
  // the trainable part of the stored elements, and optimizer state
  // (optimizer_states per trainable stored element, in the parameters' dtype).
  int64_t bytes_per_rank = 0;
};

struct ModelSummary {
  std::string strategy;
  int world_size = 1;
  std::string optimizer;     // "Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "" (unknown or none)
  int optimizer_states = 0;  // state tensors per parameter (Adam 2, SGD with momentum 1, ...)
  std::vector<ModelSummaryRow> rows;
  ModelSummaryRow total;     // sums (name "Total")
};

// The summary of `strategy`'s wrapped model (after WrapModel) with
// `optimizer`'s state (null: none). No communication.
ModelSummary SummarizeModel(const strategies::Strategy& strategy, const torch::optim::Optimizer* optimizer);
// A table: a header line, one line per unit, the totals.
std::string FormatModelSummary(const ModelSummary& summary);
// "1.5 KB", "12.3 MB" (powers of 1024).
std::string FormatBytes(int64_t bytes);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_MODEL_SUMMARY_H_
