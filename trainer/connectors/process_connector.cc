// The process connector: the communicator a Trainer that makes its own
// processes uses — launched local ranks, the detected cluster, the rendezvous,
// Gloo on CPU or NCCL on CUDA (trainer/trainer.h, "Processes").
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>

#include "base/errors.h"
#include "base/logging.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"
#include "launch/launcher.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

void Trainer::SetupProcesses() {
  if (world_) return;
  const int W = devices_ * options_.num_nodes;
  const bool cuda = accelerator_ == "cuda";
  comm::CommLimits limits;  // TrainerOptions' fields of the same names
  limits.timeout = options_.timeout;
  limits.stall_warning = options_.stall_warning;
  limits.stall_timeout = options_.stall_timeout;
  if (W == 1) {
    if (cuda) {
      SetCurrentDevice(RankDevice(accelerator_, 0));
      world_ = CreateNcclCommunicator(comm::CreateHashStore(), 0, 1, 0, limits);
      return;
    }
    comm::GlooOptions go;
    go.hostname = "127.0.0.1";
    go.timeout = limits.timeout;
    world_ = comm::GlooCommunicator::Create(comm::CreateHashStore(), 0, 1, go);
    return;
  }
  ClusterInfo info = DetectClusterEnvironment();
  if (info.source == "single" && std::getenv(kLaunchedEnvVar) == nullptr) {
    ST_CHECK_ARG(options_.num_nodes == 1, "num_nodes=", options_.num_nodes,
                 " needs an external launcher (torchrun, srun, mpirun); none was detected");
    LaunchOptions lo;
    lo.num_ranks = devices_;
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
  ro.timeout = options_.timeout;
  cluster_ = info;
  if (cuda) {
    SetCurrentDevice(RankDevice(accelerator_, info.local_rank));
    world_ = CreateNcclCommunicator(comm::CreateStore(ro), info.rank, info.world_size, info.local_rank, limits);
  } else {
    comm::GlooOptions go;
    static_cast<comm::CommLimits&>(go) = limits;
    world_ = comm::GlooCommunicator::Create(comm::CreateStore(ro), info.rank, info.world_size, go);
  }
}

}  // namespace shardtrain::trainer
