// Wall-clock readings and durations as text, for heartbeats and the messages
// that name how long a peer has been silent (comm/peer_watch,
// comm/gloo/peer_monitor). Plain C++.
#ifndef SHARDTRAIN_BASE_TIME_TEXT_H_
#define SHARDTRAIN_BASE_TIME_TEXT_H_

#include <cstdint>
#include <string>

namespace shardtrain {

// Wall time (system clock), milliseconds since the epoch: comparable across
// the processes of one host and, clock skew aside, across hosts.
int64_t WallClockMs();

// `ms` milliseconds as seconds with one decimal: "2.5 s".
std::string FormatSeconds(int64_t ms);

}  // namespace shardtrain

#endif  // SHARDTRAIN_BASE_TIME_TEXT_H_
