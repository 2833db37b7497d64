// EarlyStopping: stops Fit when a metric stops improving (trainer/callbacks/callback.h).
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_EARLY_STOPPING_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_EARLY_STOPPING_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "trainer/callbacks/callback.h"

namespace shardtrain::trainer {

struct EarlyStoppingOptions {
  std::string monitor = "val_loss";
  double min_delta = 0.0;  // an improvement must exceed this
  int64_t patience = 3;    // checks without improvement before stopping
  std::string mode = "min";
  // A missing monitor metric is an error (else the check is skipped).
  bool strict = true;
  // Stop when the metric becomes NaN or infinite.
  bool check_finite = true;
  // Stop as soon as the metric is better than this / worse than this.
  std::optional<double> stopping_threshold;
  std::optional<double> divergence_threshold;
  // Check at the end of each training epoch instead of after each validation.
  bool check_on_train_epoch_end = false;
};

// Lightning's EarlyStopping. The decision is taken on rank 0 and broadcast;
// Fit then ends on every rank after the same optimizer step. Validation
// outside Fit (Trainer::Validate) is not checked.
class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options = {});
  void on_validation_end(Trainer& trainer, TrainingModule& module) override;
  void on_train_epoch_end(Trainer& trainer, TrainingModule& module, int64_t epoch) override;
  // Lightning's key and state ("best_score" a tensor), so each side resumes the other's.
  std::string state_key() const override;
  std::string legacy_state_key() const override;
  std::map<std::string, std::string> state_dict() const override;
  StateDict checkpoint_state() const override;
  void load_state_dict(const std::map<std::string, std::string>& state) override;

  int64_t wait_count() const { return wait_count_; }
  double best_score() const { return best_score_; }
  // Epoch in which it stopped Fit (-1: it did not).
  int64_t stopped_epoch() const { return stopped_epoch_; }
  const std::string& stop_reason() const { return reason_; }

 private:
  void Check(Trainer& trainer);
  EarlyStoppingOptions options_;
  int64_t wait_count_ = 0;
  double best_score_;
  int64_t stopped_epoch_ = -1;
  std::string reason_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_EARLY_STOPPING_H_
