// glog-backed implementation of base/logging.h. Includes no LibTorch header.
//
// Built with -DSHARDTRAIN_NO_GLOG (the CMake build in bench/gpu, for machines
// without glog), it writes the same rank-stamped line to stderr itself, in
// glog's layout: "I0102 15:04:05.123456 12345 file.cc:42] [rank 0/1] message".
#include "base/logging.h"

#ifndef SHARDTRAIN_NO_GLOG
#include <glog/logging.h>
#else
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#endif

#include <atomic>
#include <mutex>

namespace shardtrain {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_world{0};
thread_local int t_rank = -1;
thread_local int t_world = 0;

#ifndef SHARDTRAIN_NO_GLOG
std::once_flag g_init;

void EnsureGlog() {
  std::call_once(g_init, [] {
    if (!google::IsGoogleLoggingInitialized()) {
      FLAGS_logtostderr = true;
      google::InitGoogleLogging("shardtrain");
    }
  });
}
#endif
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

#ifdef SHARDTRAIN_NO_GLOG
void LogMessage(LogSeverity severity, const char* file, int line, const std::string& message) {
  static std::mutex mu;
  const char sev = severity == LogSeverity::kError ? 'E' : severity == LogSeverity::kWarning ? 'W' : 'I';
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const long micros = static_cast<long>(
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000);
  std::tm tm{};
  localtime_r(&secs, &tm);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  char head[96];
  std::snprintf(head, sizeof(head), "%c%02d%02d %02d:%02d:%02d.%06ld %ld ", sev, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, micros, static_cast<long>(::syscall(SYS_gettid)));
  const std::string text =
      head + std::string(base) + ":" + std::to_string(line) + "] " + LogRankPrefix() + message + "\n";
  std::lock_guard<std::mutex> lock(mu);
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}
#else
void LogMessage(LogSeverity severity, const char* file, int line, const std::string& message) {
  EnsureGlog();
  google::LogSeverity s = severity == LogSeverity::kError     ? google::GLOG_ERROR
                          : severity == LogSeverity::kWarning ? google::GLOG_WARNING
                                                              : google::GLOG_INFO;
  google::LogMessage(file, line, s).stream() << LogRankPrefix() << message;
}
#endif

}  // namespace shardtrain
