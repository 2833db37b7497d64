// What the example programs (examples/gpt, examples/fashion_mnist) share on
// top of the Trainer: process planning under launchers, thread counts, flag
// parsing, paths under `bazel run`, and printing next to the progress bar.
#ifndef SHARDTRAIN_EXAMPLES_COMMON_EXAMPLE_UTIL_H_
#define SHARDTRAIN_EXAMPLES_COMMON_EXAMPLE_UTIL_H_

#include <map>
#include <string>

namespace shardtrain::examples {

// Where this process sits, known before the Trainer starts any rank.
struct ProcessPlan {
  int devices = 1;    // ranks per node, for TrainerOptions::devices
  int num_nodes = 1;  // for TrainerOptions::num_nodes
  int rank = 0;       // this process's global rank (0 in a process that will launch the others)
  bool external = false;  // started by torchrun / srun / mpirun (not by ShardTrain's own launcher)
  std::string source = "single";
};

// Under an external launcher (torchrun --no-python, srun, mpirun) the job's
// shape comes from its variables and `devices_flag` is ignored (a note is
// printed on rank 0 when it was given and disagrees); otherwise `devices_flag`
// ranks are launched on this machine by the Trainer.
ProcessPlan PlanProcesses(int devices_flag, bool devices_flag_given);

// Gives this process an intra-op thread pool of cores / local ranks when
// OMP_NUM_THREADS is unset — what the launcher gives the ranks it starts
// (rank 0's OpenMP runtime read the environment before the launch).
void SetThreadsPerRank(int local_ranks);

// "a=1,b=two" -> {a: 1, b: two}. Empty entries are skipped; an entry without
// '=' or with an empty key throws InvalidArgumentError naming `flag`.
std::map<std::string, std::string> ParseKeyValueList(const std::string& list, const std::string& flag);

// A path as the user meant it, made absolute: under `bazel run` relative to
// the directory the command was typed in (BUILD_WORKING_DIRECTORY), else to
// the current directory. "" stays "".
std::string UserPath(const std::string& path);

// --ckpt_path: "" (none), a file or sharded-checkpoint directory, or "last":
// the newest complete checkpoint of the newest run under <root>
// (trainer/checkpoint_io/resume.h FindLatestCheckpoint; InvalidArgumentError when none).
std::string ResolveCheckpointPath(const std::string& flag, const std::string& root_dir,
                                  const std::string& logger_name = "lightning_logs");

// Prints one line on stdout and flushes; when stdout is a terminal it first
// clears the live progress bar's line (the bar redraws on its next update).
void PrintLine(const std::string& line);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_COMMON_EXAMPLE_UTIL_H_
