// The flags both language-model examples (examples/gpt, examples/llama) take,
// their range checks, how they fill TrainerOptions and the optimizer, and
// the run both programs make of them: validation before training (unless
// resuming), Fit, and validation after it.
#ifndef SHARDTRAIN_EXAMPLES_COMMON_LM_FLAGS_H_
#define SHARDTRAIN_EXAMPLES_COMMON_LM_FLAGS_H_

#include <gflags/gflags_declare.h>

#include <string>

#include "examples/common/lm_common.h"
#include "trainer/trainer_options.h"

DECLARE_string(data);
DECLARE_int64(max_steps);
DECLARE_int64(batch_size);
DECLARE_int32(block_size);
DECLARE_double(lr);
DECLARE_double(weight_decay);
DECLARE_string(lr_scheduler);
DECLARE_int64(warmup_steps);
DECLARE_double(grad_clip);
DECLARE_int64(eval_every);
DECLARE_int64(val_samples);
DECLARE_int64(log_every_n_steps);
DECLARE_string(default_root_dir);
DECLARE_string(ckpt_path);
DECLARE_int64(checkpoint_every_n_steps);
DECLARE_bool(async_checkpoint);
DECLARE_double(async_checkpoint_max_extra_memory);
DECLARE_int32(sample_tokens);
DECLARE_double(temperature);
DECLARE_int32(top_k);
DECLARE_int32(num_workers);
DECLARE_uint64(seed);

namespace shardtrain::trainer {
class Trainer;
}

namespace shardtrain::examples {

// The flags above in their ranges (examples/README.md); throws FlagError.
void CheckLmFlags();
// The run's options from the flags above (the common ones are ApplyTrainerFlags').
void ApplyLmFlags(trainer::TrainerOptions& options);
LmOptimizerOptions LmOptimizerFromFlags();

struct LmRunResult {
  double first_val = 0;  // before training, or the first validation after a resume
  double last_val = 0;
  double fit_secs = 0;
};
// Validates before training (when not resuming from `ckpt`), fits with
// validation, and validates again unless the last step just did; prints
// each loss on rank 0 as "step N | val loss X".
LmRunResult FitWithValidation(trainer::Trainer& trainer, trainer::TrainingModule& module, const trainer::Dataset& train,
                              const trainer::Dataset& val, const std::string& ckpt, const ValLossPrinter& printer);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_COMMON_LM_FLAGS_H_
