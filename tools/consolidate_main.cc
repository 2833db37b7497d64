// consolidate: turns a sharded checkpoint directory (PyTorch DCP as
// Lightning writes it, trainer/checkpoint_io/dcp_checkpoint.h, or the
// format of earlier releases, sharded_checkpoint.h) into one full checkpoint file, the format the
// Trainer writes for full checkpoints (trainer/checkpoint_io/checkpoint.h): the model's full
// state dict (a plain {name: tensor} dict for Python's torch.load), the
// optimizer state by parameter name, loop state, RNG state, hyperparameters
// and callback states. The result resumes at any world size.
//
//   bazel run //tools:consolidate -- DIR OUT
//
// Relative paths are taken from the directory bazel run was started in.
// Exit status: 0 done, 1 the checkpoint could not be read or written, 2 usage.
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>

#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace {
std::string FromUserDir(const std::string& p) {
  const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");  // set by bazel run
  if (wd == nullptr || p.empty() || std::filesystem::path(p).is_absolute()) return p;
  return (std::filesystem::path(wd) / p).string();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cerr << "usage: consolidate DIR OUT\n"
              << "  DIR  a sharded checkpoint directory (fsdp_native state_dict_type=sharded)\n"
              << "  OUT  the full checkpoint file to write\n";
    return 2;
  }
  const std::string dir = FromUserDir(argv[1]);
  const std::string out = FromUserDir(argv[2]);
  try {
    using namespace shardtrain::trainer;
    CheckpointData data;
    if (IsDcpCheckpoint(dir)) {
      data = ConsolidateDcpCheckpoint(OpenDcpCheckpoint(dir));
    } else {
      data = ConsolidateShardedCheckpoint(LoadShardedCheckpoint(dir));
    }
    SaveCheckpoint(out, data);
    int64_t numel = 0;
    for (const auto& [k, v] : data.state_dict) numel += v.numel();
    std::cout << "consolidated " << dir << " (" << data.world_size << " ranks, strategy " << data.strategy
              << ", epoch " << data.epoch << ", step " << data.global_step << ") into " << out << ": "
              << data.state_dict.size() << " tensors, " << numel << " elements"
              << (data.optimizer_full.empty() ? ", no reshardable optimizer state"
                                              : ", " + data.optimizer_full.kind + " optimizer state")
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "consolidate: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
