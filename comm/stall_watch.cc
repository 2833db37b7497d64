#include "comm/stall_watch.h"

#include <utility>

#include "base/errors.h"

namespace shardtrain::comm {

StallWatch::StallWatch(gloo_internal::HeartbeatStore store, PeerWatchOptions options) {
  ST_CHECK_ARG(options.size > 1 && options.period.count() > 0, "StallWatch of group '", options.group,
               "' needs W > 1 and a heartbeat period > 0, got W=", options.size, ", period ",
               options.period.count(), " ms");
  CheckStallOptions(options.stall_warning, options.stall_timeout, options.options_name.c_str());
  monitor_ = std::make_shared<GlooPeerMonitor>(std::move(store), options.group, options.rank, options.size,
                                               options.period);
  monitor_->Start();
  if (options.stall_warning.count() > 0 || options.stall_timeout.count() > 0) {
    watch_ = std::make_unique<PeerWatch>(std::move(options), BeatReader(monitor_));
  }
}

StallWatch::~StallWatch() { Stop(); }

void StallWatch::Stop() {
  if (watch_) watch_->Stop();
  monitor_->Stop();
}

std::unique_ptr<PeerWatch::Waiting> StallWatch::Issue(int64_t seq, const char* op) {
  monitor_->Note(seq, op);
  return BlockedIn(seq, op);
}

std::unique_ptr<PeerWatch::Waiting> StallWatch::BlockedIn(int64_t seq, const char* op) {
  if (!watch_) return nullptr;
  return std::make_unique<PeerWatch::Waiting>(watch_.get(), seq, op);
}

std::string StallWatch::Failure() const { return watch_ ? watch_->Failure() : std::string(); }
std::string StallWatch::LastWarning() const { return watch_ ? watch_->LastWarning() : std::string(); }
int64_t StallWatch::Warnings() const { return watch_ ? watch_->Warnings() : 0; }

}  // namespace shardtrain::comm
