// The process connector (trainer/connectors/internal/process_connector.h):
// the communicator a Trainer that makes its own processes uses — launched
// local ranks, the detected cluster, the rendezvous, Gloo on CPU or NCCL on
// CUDA (trainer/trainer.h, "Processes") — and the loops' host collectives.
#include "trainer/connectors/internal/process_connector.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/errors.h"
#include "base/logging.h"
#include "comm/gloo_communicator.h"
#include "comm/host_collectives.h"
#include "comm/rendezvous.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"
#include "launch/launcher.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

void internal::ProcessConnector::SetupProcesses() {
  if (t_.world_) return;
  const int W = t_.devices_ * t_.options_.num_nodes;
  const bool cuda = t_.accelerator_ == "cuda";
  comm::CommLimits limits;  // TrainerOptions' fields of the same names
  limits.timeout = t_.options_.timeout;
  limits.stall_warning = t_.options_.stall_warning;
  limits.stall_timeout = t_.options_.stall_timeout;
  if (W == 1) {
    if (cuda) {
      SetCurrentDevice(RankDevice(t_.accelerator_, 0));
      t_.world_ = CreateNcclCommunicator(comm::CreateHashStore(), 0, 1, 0, limits);
      return;
    }
    comm::GlooOptions go;
    go.hostname = "127.0.0.1";
    go.timeout = limits.timeout;
    t_.world_ = comm::GlooCommunicator::Create(comm::CreateHashStore(), 0, 1, go);
    return;
  }
  ClusterInfo info = DetectClusterEnvironment();
  if (info.source == "single" && std::getenv(kLaunchedEnvVar) == nullptr) {
    ST_CHECK_ARG(t_.options_.num_nodes == 1, "num_nodes=", t_.options_.num_nodes,
                 " needs an external launcher (torchrun, srun, mpirun); none was detected");
    LaunchOptions lo;
    lo.num_ranks = t_.devices_;
    LaunchLocalRanks(lo);
    info = DetectClusterEnvironment();
  }
  // The launcher gives the ranks it starts OMP_NUM_THREADS (cores split
  // between local ranks); this process's OpenMP read the environment before.
  if (const char* t = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::max(1, std::atoi(t)));
  ST_CHECK_ARG(info.world_size == W, "the job has ", info.world_size, " ranks (", info.source,
               ") but devices * num_nodes = ", W);
  SetLogRank(info.rank, info.world_size);
  comm::RendezvousOptions ro = RendezvousOptionsFor(info);
  ro.timeout = t_.options_.timeout;
  t_.cluster_ = info;
  if (cuda) {
    SetCurrentDevice(RankDevice(t_.accelerator_, info.local_rank));
    t_.world_ = CreateNcclCommunicator(comm::CreateStore(ro), info.rank, info.world_size, info.local_rank, limits);
  } else {
    comm::GlooOptions go;
    static_cast<comm::CommLimits&>(go) = limits;
    t_.world_ = comm::GlooCommunicator::Create(comm::CreateStore(ro), info.rank, info.world_size, go);
  }
}

int internal::ProcessConnector::LocalRank() const {
  if (t_.cluster_) return t_.cluster_->local_rank;
  // An injected communicator: ranks fill nodes in order (as SetupModel assumes).
  return t_.options_.num_nodes == 1 ? t_.rank() : t_.rank() % t_.devices_;
}

std::vector<double> internal::ProcessConnector::AllReduceSum(std::vector<double> values) {
  if (t_.world_size() == 1 || values.empty()) return values;
  // On the communicator's device (NCCL takes CUDA tensors only).
  at::Tensor t = at::tensor(values, at::kDouble).to(comm::CollectiveDevice(*t_.world_));
  t_.world_->AllReduce(t, {comm::ReduceOp::kSum})->Wait();
  t = t.cpu();
  std::memcpy(values.data(), t.data_ptr<double>(), values.size() * sizeof(double));
  return values;
}

// Rank 0's `s` on every rank.
std::string internal::ProcessConnector::BroadcastString(const std::string& s, int root) {
  if (t_.world_size() == 1) return s;
  at::Tensor len = at::full({1}, static_cast<int64_t>(s.size()), at::kLong);
  t_.strategy_->Broadcast(len, root);
  at::Tensor buf = at::zeros({len.item<int64_t>()}, at::kByte);
  if (t_.rank() == root && !s.empty()) std::memcpy(buf.data_ptr<uint8_t>(), s.data(), s.size());
  t_.strategy_->Broadcast(buf, root);
  return std::string(reinterpret_cast<const char*>(buf.data_ptr<uint8_t>()), buf.numel());
}

}  // namespace shardtrain::trainer
