#include "trainer/checkpoint_io/resume.h"

#include <filesystem>

#include "base/file_util.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

std::vector<std::string> RunCheckpointDirs(const std::string& root_dir, const std::string& logger_name) {
  std::vector<std::string> dirs;
  std::error_code ec;
  const fs::path runs = fs::path(root_dir) / logger_name;
  if (fs::is_directory(runs, ec)) {
    for (const auto& e : fs::directory_iterator(runs, ec)) {
      const fs::path d = e.path() / "checkpoints";
      if (e.path().filename().string().rfind("version_", 0) == 0 && fs::is_directory(d, ec)) dirs.push_back(d.string());
    }
  }
  const fs::path plain = fs::path(root_dir) / "checkpoints";
  if (fs::is_directory(plain, ec)) dirs.push_back(plain.string());
  return dirs;
}

const std::vector<std::string>& ResumeModes() {
  static const std::vector<std::string> modes = {"never", "auto"};
  return modes;
}

std::string FindLatestCheckpoint(const std::string& root_dir, const std::string& logger_name) {
  std::string best;
  fs::file_time_type best_time;
  for (const auto& dir : RunCheckpointDirs(root_dir, logger_name)) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.empty() || name[0] == '.' || e.path().extension() != ".ckpt") continue;
      std::error_code st;
      const bool complete = fs::is_regular_file(e.path(), st) ||
                            (fs::is_directory(e.path(), st) && (fs::exists(e.path() / kCompleteMarkerName, st) ||
                                                                fs::exists(e.path() / kDcpMetadataName, st)));
      if (!complete) continue;
      const auto t = fs::last_write_time(e.path(), st);
      if (st) continue;
      // Ties (last.ckpt is a hard link to step=N.ckpt when both hold the same step): prefer last.ckpt.
      if (best.empty() || t > best_time || (t == best_time && name == "last.ckpt")) {
        best = e.path().string();
        best_time = t;
      }
    }
  }
  return best;
}

std::vector<std::string> RemoveCheckpointLitter(const std::string& root_dir, const std::string& logger_name) {
  std::vector<std::string> removed;
  for (const auto& dir : RunCheckpointDirs(root_dir, logger_name)) {
    for (auto& r : RemoveStaleTemporaries(dir)) removed.push_back(std::move(r));
  }
  return removed;
}

}  // namespace shardtrain::trainer
