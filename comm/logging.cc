// glog-backed implementation of comm/logging.h. Includes no LibTorch header.
#include "comm/logging.h"

#include <glog/logging.h>

#include <atomic>
#include <mutex>

namespace shardtrain {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_world{0};
thread_local int t_rank = -1;
thread_local int t_world = 0;
std::once_flag g_init;

void EnsureGlog() {
  std::call_once(g_init, [] {
    if (!google::IsGoogleLoggingInitialized()) {
      FLAGS_logtostderr = true;
      google::InitGoogleLogging("shardtrain");
    }
  });
}
}  // namespace

void SetLogRank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
}

void SetThreadLogRank(int rank, int world_size) {
  t_rank = rank;
  t_world = world_size;
}

std::string LogRankPrefix() {
  int rank = t_rank >= 0 ? t_rank : g_rank.load();
  int world = t_rank >= 0 ? t_world : g_world.load();
  if (rank < 0) return "";
  return "[rank " + std::to_string(rank) + "/" + std::to_string(world) + "] ";
}

void LogMessage(LogSeverity severity, const char* file, int line, const std::string& message) {
  EnsureGlog();
  google::LogSeverity s = severity == LogSeverity::kError     ? google::GLOG_ERROR
                          : severity == LogSeverity::kWarning ? google::GLOG_WARNING
                                                              : google::GLOG_INFO;
  google::LogMessage(file, line, s).stream() << LogRankPrefix() << message;
}

}  // namespace shardtrain
