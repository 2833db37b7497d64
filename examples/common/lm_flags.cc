#include "examples/common/lm_flags.h"

#include <gflags/gflags.h>

#include <cmath>
#include <limits>

#include "examples/common/example_util.h"
#include "examples/common/flag_checks.h"
#include "examples/common/trainer_flags.h"
#include "trainer/data/data_loader.h"
#include "trainer/trainer.h"

DEFINE_string(data, "", "text file to train on (default: Debian's fortunes corpus)");
DEFINE_int64(max_steps, 300, "optimizer steps to train (counted from the start of training, also when resuming)");
DEFINE_int64(batch_size, 16, "sequences per rank per step");
DEFINE_int32(block_size, 64, "context length: tokens per training sequence");
DEFINE_double(lr, 3e-3, "AdamW learning rate");
DEFINE_double(weight_decay, 0.01, "AdamW weight decay");
DEFINE_string(lr_scheduler, "cosine",
              "none (constant lr), cosine (to lr/10 at --max_steps) or onecycle (up to --lr, then down to "
              "lr/25e4; AdamW beta1 cycled 0.95-0.85); stepped every optimizer step");
DEFINE_int64(warmup_steps, -1,
             "linear warmup steps before the cosine (from lr/warmup_steps), or the rising part of onecycle "
             "(-1, the default: 10% of --max_steps for cosine, 30% for onecycle; 0: none for cosine, 30% for "
             "onecycle)");
DEFINE_double(grad_clip, 1.0, "clip the global gradient norm to this (0 = off)");
DEFINE_int64(eval_every, 100,
             "validate every N training batches, counted within each epoch (the Trainer's val_check_interval; "
             "without gradient accumulation, as here, a batch is an optimizer step); >= 2");
DEFINE_int64(val_samples, 512, "validation windows, spread evenly over the validation text");
DEFINE_int64(log_every_n_steps, 10, "progress and CSV log interval in steps");
DEFINE_string(default_root_dir, "",
              "logs and checkpoints go to DIR/lightning_logs/version_N (default: the current directory)");
DEFINE_string(ckpt_path, "", "resume from this checkpoint (.../checkpoints/last.ckpt), or 'last' for the newest run's");
DEFINE_int64(checkpoint_every_n_steps, 0, "also write checkpoints/step=N.ckpt every N steps (0: only last.ckpt)");
DEFINE_bool(async_checkpoint, false,
            "write sharded checkpoints in the background while training goes on (full ones stay synchronous)");
DEFINE_double(async_checkpoint_max_extra_memory, 0.2,
              "with --async_checkpoint: the most a rank holds aside for the writer, as a fraction of what it "
              "writes, in [0, 1] (0: the optimizer waits for the writer instead)");
DEFINE_int32(sample_tokens, 300, "tokens to generate at the end (0: none)");
DEFINE_double(temperature, 0.8, "sampling temperature");
DEFINE_int32(top_k, 0, "sample from the k most likely tokens (0: all)");
DEFINE_int32(num_workers, 2,
             "background threads per rank preparing the next batches (the Trainer's num_workers; 0: on the "
             "training thread); the batches, hence the losses, are the same at any value");
DEFINE_uint64(seed, 1337, "random seed (initial weights, shuffling, sampling)");

namespace shardtrain::examples {

void CheckLmFlags() {
  CheckIntFlag("max_steps", FLAGS_max_steps, 1);
  CheckChoiceFlag("lr_scheduler", FLAGS_lr_scheduler, {"none", "cosine", "onecycle"});
  CheckIntFlag("warmup_steps", FLAGS_warmup_steps, -1, FLAGS_max_steps - 1);
  CheckIntFlag("batch_size", FLAGS_batch_size, 1, 1 << 20);
  CheckIntFlag("block_size", FLAGS_block_size, 1, 1 << 16);
  CheckDoubleFlag("lr", FLAGS_lr, 0, kNoMax, /*min_open=*/true);
  CheckDoubleFlag("weight_decay", FLAGS_weight_decay, 0);
  CheckDoubleFlag("grad_clip", FLAGS_grad_clip, 0);
  CheckIntFlag("eval_every", FLAGS_eval_every, 2);
  CheckIntFlag("val_samples", FLAGS_val_samples, 1);
  CheckIntFlag("log_every_n_steps", FLAGS_log_every_n_steps, 1);
  CheckIntFlag("checkpoint_every_n_steps", FLAGS_checkpoint_every_n_steps, 0);
  CheckIntFlag("sample_tokens", FLAGS_sample_tokens, 0, 1 << 20);
  CheckDoubleFlag("temperature", FLAGS_temperature, 0, kNoMax, /*min_open=*/true);
  CheckIntFlag("top_k", FLAGS_top_k, 0, std::numeric_limits<int32_t>::max());
  CheckIntFlag("num_workers", FLAGS_num_workers, 0, trainer::kMaxDataLoaderWorkers);
}

void ApplyLmFlags(trainer::TrainerOptions& o) {
  o.max_epochs = -1;
  o.max_steps = FLAGS_max_steps;
  o.batch_size = FLAGS_batch_size;
  o.val_check_interval = static_cast<double>(FLAGS_eval_every);
  o.gradient_clip_val = FLAGS_grad_clip;
  o.log_every_n_steps = FLAGS_log_every_n_steps;
  o.checkpoint_every_n_steps = FLAGS_checkpoint_every_n_steps;
  o.async_checkpoint = FLAGS_async_checkpoint;
  o.async_checkpoint_max_extra_memory = FLAGS_async_checkpoint_max_extra_memory;
  o.default_root_dir = FLAGS_default_root_dir.empty() ? UserPath(".") : UserPath(FLAGS_default_root_dir);
  o.seed = FLAGS_seed;
  o.num_workers = FLAGS_num_workers;
}

LmOptimizerOptions LmOptimizerFromFlags() {
  return {FLAGS_lr, FLAGS_weight_decay, FLAGS_lr_scheduler, FLAGS_warmup_steps, FLAGS_max_steps};
}

LmRunResult FitWithValidation(trainer::Trainer& trainer, trainer::TrainingModule& module, const trainer::Dataset& train,
                              const trainer::Dataset& val, const std::string& ckpt, const ValLossPrinter& printer) {
  LmRunResult r;
  r.first_val = std::numeric_limits<double>::quiet_NaN();
  if (ckpt.empty()) {
    r.first_val = trainer.Validate(module, val);
    // trainer.rank() once the Trainer has joined the job (Validate does).
    if (trainer.rank() == 0) PrintLine("step 0 | val loss " + Fmt("%.4f", r.first_val));
  }
  r.fit_secs = TimedFit(trainer, module, train, &val, ckpt);
  r.last_val = trainer.val_losses().empty() ? r.first_val : trainer.val_losses().back();
  if (printer.last_step() != trainer.global_step()) {
    r.last_val = trainer.Validate(module, val);
    if (trainer.rank() == 0) {
      PrintLine("step " + std::to_string(trainer.global_step()) + " | val loss " + Fmt("%.4f", r.last_val));
    }
  }
  if (std::isnan(r.first_val) && !trainer.val_losses().empty()) r.first_val = trainer.val_losses().front();
  return r;
}

}  // namespace shardtrain::examples
