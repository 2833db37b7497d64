#include "examples/common/example_util.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "base/errors.h"
#include "launch/cluster_environment.h"
#include "trainer/checkpoint_io/resume.h"

namespace shardtrain::examples {
namespace fs = std::filesystem;

ProcessPlan PlanProcesses(int devices_flag, bool devices_flag_given) {
  ST_CHECK_ARG(devices_flag >= 1, "--devices must be >= 1, got ", devices_flag);
  const ClusterInfo info = DetectClusterEnvironment();
  ProcessPlan p;
  p.rank = info.rank;
  p.source = info.source;
  // Ranks started by ShardTrain's own launcher look like torchrun ranks.
  p.external = info.source != "single" && std::getenv("SHARDTRAIN_LAUNCHED") == nullptr;
  if (info.source == "single") {
    p.devices = devices_flag;
    return p;
  }
  p.devices = info.local_world_size;
  p.num_nodes = info.num_nodes;
  if (p.external && devices_flag_given && devices_flag != info.local_world_size && info.rank == 0) {
    std::fprintf(stderr, "note: --devices=%d ignored: %s started %d ranks per node (%d in all)\n", devices_flag,
                 info.source.c_str(), info.local_world_size, info.world_size);
  }
  return p;
}

void SetThreadsPerRank(int local_ranks) {
  if (std::getenv("OMP_NUM_THREADS") != nullptr || local_ranks <= 1) return;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(std::max(1u, cores / static_cast<unsigned>(local_ranks))));
}

std::map<std::string, std::string> ParseKeyValueList(const std::string& list, const std::string& flag) {
  std::map<std::string, std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    const auto trim = [](std::string s) {
      s.erase(0, s.find_first_not_of(" \t"));
      s.erase(s.find_last_not_of(" \t") + 1);
      return s;
    };
    item = trim(item);
    if (!item.empty()) {
      const size_t eq = item.find('=');
      ST_CHECK_ARG(eq != std::string::npos && eq > 0, flag, ": '", item,
                   "' is not key=value (give a comma-separated list like key=value,key2=value2)");
      out[trim(item.substr(0, eq))] = trim(item.substr(eq + 1));
    }
    start = end + 1;
  }
  return out;
}

std::string UserPath(const std::string& path) {
  if (path.empty()) return path;
  fs::path p(path);
  if (p.is_relative()) {
    const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");
    std::error_code ec;
    p = (wd != nullptr && *wd != '\0') ? fs::path(wd) / p : fs::absolute(p, ec);
  }
  std::string out = p.lexically_normal().string();
  if (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

std::string ResolveCheckpointPath(const std::string& flag, const std::string& root_dir,
                                  const std::string& logger_name) {
  if (flag != "last") {
    if (flag.empty()) return flag;
    const std::string p = UserPath(flag);
    std::error_code ec;
    ST_CHECK_ARG(fs::exists(p, ec), "--ckpt_path=", flag, ": no such checkpoint (", p, ")");
    return p;
  }
  // The newest complete checkpoint of the newest run (periodic, preemption or end): trainer/checkpoint_io/resume.h.
  const std::string found = trainer::FindLatestCheckpoint(root_dir, logger_name);
  ST_CHECK_ARG(!found.empty(), "--ckpt_path=last: no complete checkpoint under ",
               (fs::path(root_dir) / logger_name / "version_N" / "checkpoints").string(),
               " found; run once without --ckpt_path first, or pass a checkpoint file");
  return found;
}

void PrintLine(const std::string& line) {
  static const bool tty = ::isatty(STDOUT_FILENO) != 0;
  std::fprintf(stdout, tty ? "\r\033[K%s\n" : "%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace shardtrain::examples
