// Project logging: rank-stamped messages (`[rank 1/4] ...`) for every layer.
//
// Backed by glog in logging.cc, which includes no LibTorch header: a pip-built
// LibTorch (without glog) defines its own LOG/CHECK macros, so glog must never
// be visible in a header that may meet torch headers. Use ST_LOG(INFO) << ...;
#ifndef SHARDTRAIN_BASE_LOGGING_H_
#define SHARDTRAIN_BASE_LOGGING_H_

#include <sstream>
#include <string>

namespace shardtrain {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2 };

// Sets the rank stamp for messages from this process (threads-as-ranks tests
// can override it per thread with SetThreadLogRank).
void SetLogRank(int rank, int world_size);
void SetThreadLogRank(int rank, int world_size);

// The current stamp, e.g. "[rank 1/4] ", or "" before any rank is known.
std::string LogRankPrefix();

// Writes one message through glog with the rank stamp.
void LogMessage(LogSeverity severity, const char* file, int line, const std::string& message);

namespace internal {
// Collects a message and writes it on destruction.
class LogLine {
 public:
  LogLine(LogSeverity severity, const char* file, int line) : severity_(severity), file_(file), line_(line) {}
  ~LogLine() { LogMessage(severity_, file_, line_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};
}  // namespace internal
}  // namespace shardtrain

#define ST_LOG_SEVERITY_INFO ::shardtrain::LogSeverity::kInfo
#define ST_LOG_SEVERITY_WARNING ::shardtrain::LogSeverity::kWarning
#define ST_LOG_SEVERITY_ERROR ::shardtrain::LogSeverity::kError
#define ST_LOG(severity) ::shardtrain::internal::LogLine(ST_LOG_SEVERITY_##severity, __FILE__, __LINE__).stream()

#endif  // SHARDTRAIN_BASE_LOGGING_H_
