// Internal to //trainer: the process connector — the communicator a Trainer
// that makes its own processes uses (launched local ranks, the detected
// cluster, the rendezvous, Gloo on CPU or NCCL on CUDA; trainer/trainer.h,
// "Processes"), and the small host collectives the loops agree through.
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_PROCESS_CONNECTOR_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_PROCESS_CONNECTOR_H_

#include <string>
#include <vector>

namespace shardtrain::trainer {

class Trainer;

namespace internal {

class ProcessConnector {
 public:
  explicit ProcessConnector(Trainer& trainer) : t_(trainer) {}
  ProcessConnector(const ProcessConnector&) = delete;
  ProcessConnector& operator=(const ProcessConnector&) = delete;

  // Makes the Trainer's communicator unless it has one (injected or made before).
  void SetupProcesses();
  // This rank's index on its node.
  int LocalRank() const;
  // `values` summed over the ranks (one all-reduce; none at W=1).
  std::vector<double> AllReduceSum(std::vector<double> values);
  // Rank `root`'s `s` on every rank.
  std::string BroadcastString(const std::string& s, int root = 0);

 private:
  Trainer& t_;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_PROCESS_CONNECTOR_H_
