// Cluster environments: who am I (rank, world size, node) and where is the
// master, read from explicit options or from the variables an external launcher
// sets. Precedence: explicit options > torchrun > SLURM srun > Open MPI > PMI >
// single process. Pure C++ (no torch header); errors are InvalidArgumentError
// naming the variable and its value.
#ifndef SHARDTRAIN_LAUNCH_CLUSTER_ENVIRONMENT_H_
#define SHARDTRAIN_LAUNCH_CLUSTER_ENVIRONMENT_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain {

// Where this process sits in the job and how to reach the rendezvous master.
struct ClusterInfo {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int world_size = 1;        // number of ranks in the job
  int local_rank = 0;        // rank on this node
  int local_world_size = 1;  // ranks on this node
  int node_rank = 0;         // index of this node
  int num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;  // torchrun TORCHELASTIC_USE_AGENT_STORE=True
  int restart_count = 0;     // torchrun TORCHELASTIC_RESTART_COUNT
  std::string source = "single";  // "explicit", "torchrun", "slurm", "mpi", "pmi", "single"
};

// Options given by the program (flags, config). If any field is set they win
// over every environment; unset fields take defaults (rank 0, world size 1,
// local_rank = rank, local_world_size = world_size, one node, 127.0.0.1:29500).
struct ExplicitClusterOptions {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<int> node_rank;
  std::optional<int> num_nodes;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;

  bool any_set() const;
};

// Reads one environment variable; std::nullopt when unset.
using GetEnvFn = std::function<std::optional<std::string>(const std::string&)>;

// Detects the cluster environment from `getenv` (a synthetic map in tests).
// Throws InvalidArgumentError for a malformed or inconsistent value.
ClusterInfo DetectClusterEnvironment(const ExplicitClusterOptions& explicit_opts, const GetEnvFn& getenv);

// Same, from the process environment.
ClusterInfo DetectClusterEnvironment(const ExplicitClusterOptions& explicit_opts = {});

// Expands a SLURM node list: "node[01-03,7],gpu5" -> node01 node02 node03 node7
// gpu5. Zero padding of a range is kept; several bracket groups in one name
// expand to their product; names may also be separated by spaces.
std::vector<std::string> ExpandSlurmNodeList(const std::string& nodelist);

// The master port SLURM jobs use (as PyTorch Lightning's SLURMEnvironment):
// MASTER_PORT if set, else the last 4 digits of SLURM_JOB_ID + 15000, else 12910.
int SlurmMasterPort(const GetEnvFn& getenv);

// Human-readable one-line summary, for logs.
std::string ToString(const ClusterInfo& info);

}  // namespace shardtrain

#endif  // SHARDTRAIN_LAUNCH_CLUSTER_ENVIRONMENT_H_
