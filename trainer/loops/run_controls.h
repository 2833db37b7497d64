// Run controls: Lightning's Trainer arguments that change what Fit runs
// (TrainerOptions::fast_dev_run, num_sanity_val_steps,
// check_val_every_n_epoch, overfit_batches, limit_*_batches, seed,
// deterministic; ckpt_path="best"), and Lightning's seed_everything.
//
//   SeedEverything(42);                 // before building the Trainer
//   TrainerOptions o;
//   o.fast_dev_run = 2;                 // 2 training + 2 validation batches, nothing written
//   Trainer trainer(o);
//   trainer.Fit(module, train, &val);
//   trainer.Fit(module, train, &val, "best");  // resume from ModelCheckpoint's best
//
// The Trainer applies these through the functions below (Fit's loop calls
// them at a few points); Test/Predict loops use LimitBatches.
#ifndef SHARDTRAIN_TRAINER_LOOPS_RUN_CONTROLS_H_
#define SHARDTRAIN_TRAINER_LOOPS_RUN_CONTROLS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainer/data_module.h"  // Stage

namespace shardtrain::trainer {

struct TrainerOptions;
class Dataset;
class Callback;

// Lightning's seed_everything: seeds torch's CPU generator and, where CUDA is
// present, every CUDA device's (at::manual_seed), and std::rand; a Trainer
// built afterwards whose TrainerOptions::seed is 0 (not given) uses `seed`
// for sampler shuffling and the RNG before configure_model. `workers`: data
// loader workers should derive their seeds with WorkerSeed (SeedWorkers()
// tells them). Call it in main() on every rank (re-executed ranks run main()
// again, so they call it too).
void SeedEverything(uint64_t seed, bool workers = false);
// The seed of the last SeedEverything (nullopt: never called).
std::optional<uint64_t> GlobalSeed();
// Whether the last SeedEverything asked for seeded data loader workers.
bool SeedWorkers();
// A distinct, reproducible seed for worker `worker` of rank `rank` from `base`
// (Lightning's pl_worker_init_function: base, rank and worker mixed).
uint64_t WorkerSeed(uint64_t base, int rank, int worker);

// The number of batches (per rank) `stage` (kFit: training) runs out of `available`:
// fast_dev_run N: min(N, available); overfit_batches (train and validate):
// its count or fraction; else limit_<stage>_batches (<= 1.0: a fraction,
// floored; > 1: a count).
int64_t LimitBatches(const TrainerOptions& options, Stage stage, int64_t available);

// The path ckpt_path="best" means: the best_model_path of the (first)
// ModelCheckpoint in `callbacks`. InvalidArgumentError when there is no
// ModelCheckpoint, it has no monitor, or it has saved no best checkpoint yet.
std::string BestCheckpointPath(const std::vector<std::shared_ptr<Callback>>& callbacks);

namespace internal {

// Forgets SeedEverything's seed (for tests, and programs that train several
// models with their own seeds).
void ClearGlobalSeed();
// Checks the run-control options (InvalidArgumentError naming the field and
// its valid values) and returns the options a Trainer runs with: fast_dev_run
// and overfit_batches applied, the global seed taken when seed is 0.
TrainerOptions ApplyRunControls(TrainerOptions options);
// Whether Fit validates in (0-based) `epoch` (check_val_every_n_epoch).
bool ValidatesInEpoch(const TrainerOptions& options, int64_t epoch);
// The data Fit validates on: the training set with overfit_batches (when a
// validation set is given), else `val`.
const Dataset* FitValidationSet(const TrainerOptions& options, const Dataset& train, const Dataset* val);
// deterministic: turns on at::globalContext's deterministic algorithms (and
// cuDNN's), sets CUBLAS_WORKSPACE_CONFIG when unset. false: leaves them.
void ApplyDeterminism(bool deterministic);
// Runs `fn`; with `deterministic`, an operation that has no deterministic
// implementation becomes an InvalidArgumentError naming it and the option.
void RunExplainingNondeterminism(bool deterministic, const std::function<void()>& fn);

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOOPS_RUN_CONTROLS_H_
