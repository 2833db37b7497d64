#include "trainer/profilers/profiler.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "base/errors.h"
#include "base/file_util.h"
#include "base/logging.h"
#include "comm/wait_time.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// "wait:active" -> {wait, active}; false when malformed.
bool ParseSteps(const std::string& s, int64_t* wait, int64_t* active) {
  const auto colon = s.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  try {
    size_t a = 0, b = 0;
    *wait = std::stoll(s.substr(0, colon), &a);
    *active = std::stoll(s.substr(colon + 1), &b);
    return a == colon && b == s.size() - colon - 1 && *wait >= 0 && *active >= 1;
  } catch (const std::exception&) {
    return false;
  }
}

// profiler="simple": wall time per action, and the fit thread's communication wait.
class SimpleProfiler : public Profiler {
 public:
  SimpleProfiler(std::string dir, int rank) : dir_(std::move(dir)), rank_(rank), start_ns_(NowNs()) {
    sink_.emplace(&wait_);
  }
  ~SimpleProfiler() override = default;

  int64_t Begin(const char*) override { return NowNs(); }
  void End(const char* action, int64_t begin) override {
    const int64_t ns = NowNs() - begin;
    auto it = stats_.find(std::string_view(action));
    if (it == stats_.end()) it = stats_.emplace(action, Stat{}).first;
    ++it->second.calls;
    it->second.ns += ns;
  }

  void Report() override {
    if (end_ns_ == 0) end_ns_ = NowNs();
    Close();
    if (rank_ != 0) return;
    const std::string table = Table();
    ST_LOG(INFO) << "\n" << table;
    if (dir_.empty()) return;
    const std::string path = (fs::path(dir_) / "profiler-fit.txt").string();
    std::error_code ec;
    fs::create_directories(dir_, ec);
    WriteFileAtomically(path, table);
    written_.push_back(path);
  }

  void Close() override {
    if (end_ns_ == 0) end_ns_ = NowNs();
    sink_.reset();
  }

  std::vector<ProfiledAction> Summary() const override {
    std::vector<ProfiledAction> rows;
    for (const auto& [action, s] : stats_) rows.push_back({action, s.calls, static_cast<double>(s.ns) * 1e-9});
    rows.push_back({kActionCommunicationWait, wait_.calls, static_cast<double>(wait_.nanoseconds) * 1e-9});
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.total_s > b.total_s; });
    const int64_t end = end_ns_ != 0 ? end_ns_ : NowNs();
    rows.insert(rows.begin(), {"fit", 1, static_cast<double>(end - start_ns_) * 1e-9});
    return rows;
  }

  std::vector<std::string> written() const override { return written_; }

 private:
  struct Stat {
    int64_t calls = 0;
    int64_t ns = 0;
  };

  // Lightning's SimpleProfiler layout: action, mean, calls, total, share of the fit.
  std::string Table() const {
    const auto rows = Summary();
    const double fit = std::max(rows.front().total_s, 1e-12);
    size_t width = 6;
    for (const auto& r : rows) width = std::max(width, r.action.size());
    std::ostringstream os;
    char line[512];
    std::snprintf(line, sizeof line, "| %-*s | %10s | %17s | %14s | %12s |", static_cast<int>(width), "Action",
                  "Num calls", "Mean duration (s)", "Total time (s)", "Percentage %");
    const std::string rule(std::strlen(line), '-');
    os << "FIT Profiler Report (rank " << rank_ << "; communication_wait overlaps the phases it occurs in)\n"
       << rule << "\n" << line << "\n" << rule << "\n";
    for (const auto& r : rows) {
      std::snprintf(line, sizeof line, "| %-*s | %10lld | %17.6g | %14.6g | %12.3f |", static_cast<int>(width),
                    r.action.c_str(), static_cast<long long>(r.calls), r.mean_s(), r.total_s,
                    100.0 * r.total_s / fit);
      os << line << "\n";
    }
    os << rule << "\n";
    return os.str();
  }

  std::string dir_;
  int rank_;
  int64_t start_ns_;
  int64_t end_ns_ = 0;
  std::map<std::string, Stat, std::less<>> stats_;
  comm::WaitTime wait_;
  std::optional<comm::WaitTimeSink> sink_;
  std::vector<std::string> written_;
};

// profiler="pytorch": LibTorch's Kineto profiler over training batches [wait, wait + active).
class TorchProfiler : public Profiler {
 public:
  TorchProfiler(std::string dir, int rank, bool cuda, int64_t wait, int64_t active)
      : dir_(std::move(dir)), rank_(rank), cuda_(cuda), wait_(wait), active_(active) {}
  ~TorchProfiler() override { Close(); }

  int64_t Begin(const char* action) override {
    if (std::strcmp(action, kActionGetTrainBatch) == 0) {  // a training batch starts
      if (on_ && batches_ == wait_ + active_) Stop();
      if (!on_ && !done_ && batches_ == wait_) Start();
      ++batches_;
    }
    if (!on_) return 0;
    auto range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (range->isActive()) range->before(action);
    ranges_.push_back(std::move(range));
    return 1;
  }
  void End(const char*, int64_t begin) override {
    if (begin == 1 && !ranges_.empty()) ranges_.pop_back();  // ends the range
  }

  void Report() override {
    if (on_) {
      Stop();
    } else if (!done_) {
      ST_LOG(WARNING) << "profiler=pytorch: no trace written: the fit ran " << batches_
                      << " training batches, profiler_steps starts tracing at batch " << wait_
                      << " (profiler_steps \"wait:active\"; lower wait)";
    }
  }

  void Close() override {
    if (!on_) return;
    ranges_.clear();
    torch::autograd::profiler::disableProfiler();
    on_ = false;
  }

  std::vector<std::string> written() const override { return written_; }

 private:
  std::set<torch::profiler::impl::ActivityType> Activities() const {
    std::set<torch::profiler::impl::ActivityType> a = {torch::profiler::impl::ActivityType::CPU};
    if (cuda_) a.insert(torch::profiler::impl::ActivityType::CUDA);
    return a;
  }

  void Start() {
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    try {
      torch::autograd::profiler::prepareProfiler(config, Activities());
      torch::autograd::profiler::enableProfiler(config, Activities());
    } catch (const std::exception& e) {
      ST_THROW(InvalidArgumentError,
               "profiler=pytorch: LibTorch's Kineto profiler could not start (", e.what(),
               "); it needs a LibTorch built with Kineto (USE_KINETO, as PyPI's torch) and one profiled Fit per "
               "process (threads-as-ranks cannot trace concurrently); use profiler=simple otherwise");
    }
    on_ = true;
  }

  void Stop() {
    ranges_.clear();
    auto result = torch::autograd::profiler::disableProfiler();
    on_ = false;
    done_ = true;
    std::error_code ec;
    fs::create_directories(dir_.empty() ? "." : dir_, ec);
    const std::string path =
        (fs::path(dir_.empty() ? "." : dir_) / ("profiler-fit-rank" + std::to_string(rank_) + ".pt.trace.json"))
            .string();
    result->save(path);
    written_.push_back(path);
    ST_LOG(INFO) << "profiler=pytorch: Chrome trace of training batches [" << wait_ << ", " << wait_ + active_
                 << ") written to " << path;
  }

  std::string dir_;
  int rank_;
  bool cuda_;
  int64_t wait_, active_;
  int64_t batches_ = 0;
  bool on_ = false;
  bool done_ = false;
  std::vector<std::unique_ptr<at::RecordFunction>> ranges_;
  std::vector<std::string> written_;
};

}  // namespace

const std::vector<std::string>& ProfilerNames() {
  static const std::vector<std::string> names = {"", "simple", "pytorch"};
  return names;
}

void CheckProfilerOptions(const std::string& profiler, const std::string& profiler_steps) {
  const auto& names = ProfilerNames();
  ST_CHECK_ARG(std::find(names.begin(), names.end(), profiler) != names.end(), "unknown profiler '", profiler,
               "'; valid: \"\" (off), \"simple\", \"pytorch\"");
  int64_t wait = 0, active = 0;
  ST_CHECK_ARG(ParseSteps(profiler_steps, &wait, &active), "profiler_steps must be \"wait:active\" (wait >= 0 ",
               "training batches skipped, then active >= 1 traced, e.g. \"5:3\"), got \"", profiler_steps, "\"");
}

std::unique_ptr<Profiler> MakeProfiler(const std::string& kind, const std::string& profiler_steps,
                                       const std::string& dir, int rank, bool cuda) {
  CheckProfilerOptions(kind, profiler_steps);
  if (kind == "simple") return std::make_unique<SimpleProfiler>(dir, rank);
  if (kind == "pytorch") {
    int64_t wait = 0, active = 0;
    ParseSteps(profiler_steps, &wait, &active);
    return std::make_unique<TorchProfiler>(dir, rank, cuda, wait, active);
  }
  return nullptr;
}

}  // namespace shardtrain::trainer
