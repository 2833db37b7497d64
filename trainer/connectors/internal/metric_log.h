// Internal to //trainer: what TrainingModule::Log collects, agreed over the
// ranks (Lightning's logger connector, small).
//
// Per batch the Trainer folds the module's logged values in (AddBatch): step
// values are kept for the step, epoch values are accumulated (sum, count,
// max, min). At the end of an optimizer step, SyncStep appends to the
// Trainer's header of scalars (loss, flags) one slot per rank with a
// fingerprint of the names that rank logged in the step, and the step values
// of every rank (rank r's value of name j at j*W + r), laid out by the names
// of the previous step: one all-reduce (sum) for all of it. Only when the
// names change (the first step that logs) a second all-reduce carries the
// values in the new layout; when the ranks' names differ, every rank sees it
// in the fingerprints and throws, naming the names that differ. Each rank's
// value being in the sum, sync_dist reduces with reduce_fx and without it
// rank 0's value is taken. ReduceEpoch does the same for the aggregates at
// the end of an epoch or validation run (a fingerprint all-reduce, then the
// values).
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_METRIC_LOG_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_METRIC_LOG_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "trainer/training_module.h"

namespace shardtrain::comm {
class Communicator;
}

namespace shardtrain::trainer::internal {

// How the collector talks to the other ranks.
struct LogComm {
  comm::Communicator* world = nullptr;  // for the error path's name gathering
  int rank = 0;
  int world_size = 1;
  std::function<std::vector<double>(std::vector<double>)> all_reduce_sum;
};

// Checks `reduce_fx` (InvalidArgumentError listing the valid ones).
void CheckReduceFx(const std::string& reduce_fx);

class MetricCollector {
 public:
  MetricCollector() = default;
  explicit MetricCollector(LogComm comm) : comm_(std::move(comm)) {}

  // Takes what `module` logged since the last call (and clears it). Epoch
  // "mean"s weight the batch by `weight` (Test: its real samples; 0 for a
  // batch of padding only, which then adds nothing to any reduce_fx but
  // keeps the names equal on every rank).
  void AddBatch(TrainingModule& module, double weight = 1.0);
  // Appends this step's names and values to `header`, all-reduces it (sum)
  // and returns the summed header; the agreed step values are then in
  // step_metrics(). Collective.
  std::vector<double> SyncStep(std::vector<double> header);
  // The step values of the last SyncStep, by logged name (<name> or <name>_step).
  const std::map<std::string, double>& step_metrics() const { return step_metrics_; }
  // Reduces the accumulated epoch values over the ranks (collective; every
  // rank calls it), returns them by logged name (<name> or <name>_epoch) and
  // starts a new epoch: one all-reduce that checks the names (`what` names
  // the run in the error, "validation"), then one for the values (none
  // without values). `names_agreed`: the names are known to agree (in
  // training the step fingerprints covered them): no check.
  std::map<std::string, double> ReduceEpoch(const std::string& what, bool names_agreed = false);
  // Whether any epoch value was accumulated; in training the same on every
  // rank (the step fingerprints cover the epoch names).
  bool has_epoch_values() const { return !epoch_.empty(); }
  // Latest values logged with prog_bar, by logged name.
  const std::map<std::string, double>& prog_bar() const { return prog_bar_; }

 private:
  struct Accumulated {
    LogOptions options;
    double sum = 0;
    double max = 0;
    double min = 0;
    int64_t count = 0;     // batches with weight > 0
    double wsum = 0;       // sum of weight * value ("mean")
    double weight = 0;
  };
  // Throws on every rank when the fingerprints in `slots` differ.
  void CheckSameNames(const double* slots, const std::vector<std::string>& mine, const std::string& what);
  double Reduce(const std::vector<double>& per_rank, const LogOptions& o) const;

  LogComm comm_;
  std::map<std::string, std::pair<double, LogOptions>> step_;  // this step's values
  std::set<std::string> step_names_;                            // this step's names, step and epoch ("s:x", "e:y")
  std::vector<std::string> layout_;                             // step names of the last step
  std::map<std::string, Accumulated> epoch_;
  std::map<std::string, double> step_metrics_;
  std::map<std::string, double> prog_bar_;
};

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_METRIC_LOG_H_
