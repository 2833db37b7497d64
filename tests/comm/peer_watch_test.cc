// PeerWatch (comm/peer_watch.h) with a scripted heartbeat reader: a blocked
// wait names the peer whose heartbeat stopped, or that is alive but never
// issues the awaited collective, within the configured stall time; with
// stall_timeout the wait fails with CommTimeoutError; nothing is reported
// while peers make progress; bad options name the field. The real-process
// SIGSTOP tests are in process_test.sh. Also WaitWithDeadline
// (comm/deadline_wait.h), the polling loop of the NCCL backend's bounded waits.
#include "comm/peer_watch.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "base/errors.h"
#include "comm/deadline_wait.h"
#include "comm/heartbeat_store.h"
#include "comm/stall_watch.h"

namespace shardtrain::comm {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

int64_t WallMs() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Heartbeats of 2 ranks; rank 1's are produced by `beat1` on each read.
struct Script {
  std::mutex mu;
  std::function<PeerBeat()> beat1;
  PeerWatch::Reader Reader() {
    return [this] {
      std::lock_guard<std::mutex> lock(mu);
      std::vector<std::optional<PeerBeat>> b(2);
      b[1] = beat1();
      return b;
    };
  }
};

PeerWatchOptions Options(int warning_ms, int timeout_ms) {
  return PeerWatchOptions{"world", 0, 2, milliseconds(50), milliseconds(warning_ms), milliseconds(timeout_ms)};
}

// A wait that never completes on its own: throws after each slice.
void BlockForever(milliseconds slice) {
  std::this_thread::sleep_for(slice);
  throw std::runtime_error("Operation timed out!");
}

TEST(PeerWatchTest, StoppedHeartbeatFailsTheWaitNamingThePeer) {
  Script s;
  const int64_t stopped_at = WallMs();
  s.beat1 = [&] { return PeerBeat{stopped_at, 7, "AllGather", 4242, "hostA/boot:x", false}; };
  PeerWatch watch(Options(300, 600), s.Reader());
  const auto start = Clock::now();
  try {
    PeerWatch::Wait(&watch, 8, "AllReduce", milliseconds(20000), BlockForever, [] { return false; });
    FAIL() << "expected CommTimeoutError";
  } catch (const CommTimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1 of group 'world' (pid 4242, host hostA) has made no progress for"), std::string::npos)
        << what;
    EXPECT_NE(what.find("its heartbeat stopped"), std::string::npos) << what;
    EXPECT_NE(what.find("its last heartbeat says collective #7 (AllGather); this rank (0) waits in collective #8 "
                        "(AllReduce)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("giving up after GlooOptions::stall_timeout = 0.6 s"), std::string::npos) << what;
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  EXPECT_GE(ms, 550);
  EXPECT_LT(ms, 3000);
  // The group stays failed: the next wait throws at once.
  EXPECT_THROW(PeerWatch::Wait(&watch, 9, "Barrier", milliseconds(20000), BlockForever, [] { return false; }),
               CommTimeoutError);
}

TEST(PeerWatchTest, AlivePeerThatNeverIssuesTheCollectiveIsNamed) {
  Script s;
  s.beat1 = [] { return PeerBeat{WallMs(), 3, "Broadcast", 77, "hostB", false}; };  // fresh, stuck at #3
  PeerWatch watch(Options(0, 500), s.Reader());
  try {
    PeerWatch::Wait(&watch, 4, "AllGather", milliseconds(20000), BlockForever, [] { return false; });
    FAIL() << "expected CommTimeoutError";
  } catch (const CommTimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 of group 'world' (pid 77, host hostB) has made no progress for"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("it is alive"), std::string::npos) << e.what();
  }
}

TEST(PeerWatchTest, ProgressingPeerIsNeverReportedAndTheWaitCompletes) {
  Script s;
  std::atomic<int64_t> issued{10};
  s.beat1 = [&] { return PeerBeat{WallMs(), issued++, "AllGather", 5, "h", false}; };  // moves on every read
  PeerWatch watch(Options(100, 200), s.Reader());
  const auto until = Clock::now() + milliseconds(800);
  std::atomic<bool> done{false};
  // Blocks 0.8 s in collective #100 (ahead of the peer, which keeps issuing).
  PeerWatch::Wait(
      &watch, 100, "AllGather", milliseconds(20000),
      [&](milliseconds slice) {
        std::this_thread::sleep_for(slice);
        if (Clock::now() < until) throw std::runtime_error("Operation timed out!");
        done = true;
      },
      [&] { return done.load(); });
  EXPECT_TRUE(watch.Failure().empty()) << watch.Failure();
}

TEST(PeerWatchTest, WithoutStallTimeoutTheCollectiveTimeoutApplies) {
  Script s;
  s.beat1 = [] { return PeerBeat{1, 1, "-", 1, "h", false}; };  // long dead
  PeerWatch watch(Options(100, 0), s.Reader());
  int calls = 0;
  EXPECT_THROW(PeerWatch::Wait(
                   &watch, 2, "Barrier", milliseconds(400),
                   [&](milliseconds t) {
                     ++calls;
                     EXPECT_EQ(t.count(), 400);  // one plain wait with the collective's timeout
                     BlockForever(t);
                   },
                   [] { return false; }),
               std::runtime_error);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(watch.Failure().empty());
}

TEST(PeerWatchTest, NegativeStallOptionsAreRefusedNamingTheField) {
  try {
    CheckStallOptions(milliseconds(-1), milliseconds(0));
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("GlooOptions.stall_warning must be >= 0 ms (0: no warning), got -1 ms"),
              std::string::npos);
  }
  EXPECT_THROW(CheckStallOptions(milliseconds(0), milliseconds(-5)), InvalidArgumentError);
}

TEST(PeerWatchTest, ExactCountFromSharedMemoryIsReportedAsTheLatestCollective) {
  Script s;
  const int64_t stopped_at = WallMs();
  PeerBeat beat{stopped_at, 52, "ReduceScatter", 4242, "hostA/boot:x", false};
  beat.exact = true;
  s.beat1 = [&] { return beat; };
  PeerWatch watch(Options(0, 300), s.Reader());
  try {
    PeerWatch::Wait(&watch, 53, "AllGather", milliseconds(20000), BlockForever, [] { return false; });
    FAIL() << "expected CommTimeoutError";
  } catch (const CommTimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("; its latest collective is #52 (ReduceScatter); this rank (0) waits in collective #53 "
                        "(AllGather)"),
              std::string::npos)
        << what;
    EXPECT_EQ(what.find("its last heartbeat says"), std::string::npos) << what;
  }
}

// WaitWithDeadline: returns true as soon as the poll says done, without
// calling on_timeout.
TEST(WaitWithDeadlineTest, CompletionEndsTheWaitWithoutTimeout) {
  int polls = 0;
  bool timed_out = false;
  const auto start = Clock::now();
  EXPECT_TRUE(WaitWithDeadline([&] { return ++polls == 5; }, Clock::now() + milliseconds(5000),
                               [&] { timed_out = true; }));
  EXPECT_EQ(polls, 5);
  EXPECT_FALSE(timed_out);
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(), 1000);
}

// Never done: on_timeout runs once, after the deadline (not before, and not
// much after: the sleep between polls is capped), and its exception propagates.
TEST(WaitWithDeadlineTest, ExpiryCallsOnTimeoutOnceAfterTheDeadline) {
  int calls = 0;
  const auto start = Clock::now();
  try {
    WaitWithDeadline([] { return false; }, start + milliseconds(300), [&] {
      ++calls;
      throw CommTimeoutError("AllReduce timed out");
    });
    FAIL() << "expected CommTimeoutError";
  } catch (const CommTimeoutError& e) {
    EXPECT_STREQ(e.what(), "AllReduce timed out");
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  EXPECT_EQ(calls, 1);
  EXPECT_GE(ms, 300);
  EXPECT_LT(ms, 1500);
  // An on_timeout that does not throw: false.
  calls = 0;
  EXPECT_FALSE(WaitWithDeadline([] { return false; }, Clock::now() + milliseconds(20), [&] { ++calls; }));
  EXPECT_EQ(calls, 1);
}

// Done by the poll after the deadline passed: done, not a timeout; an error
// from the poll propagates.
TEST(WaitWithDeadlineTest, DoneAtTheLastPollWinsAndPollErrorsPropagate) {
  const auto deadline = Clock::now() + milliseconds(50);
  bool timed_out = false;
  EXPECT_TRUE(WaitWithDeadline([&] { return Clock::now() > deadline; }, deadline,
                               [&] { timed_out = true; }));
  EXPECT_FALSE(timed_out);
  EXPECT_THROW(WaitWithDeadline([]() -> bool { throw CommError("NCCL error 6"); }, Clock::now() + milliseconds(50),
                                [] {}),
               CommError);
}

// ---- StallWatch (comm/stall_watch.h): the NCCL backend's stall watch, with
// real heartbeats between threads through a c10d HashStore. The NCCL
// backend's poll (its watchdog, a host-blocking Wait) is stood in for by
// WaitWithDeadline polling a collective that never completes and checking
// Failure(), as NcclState::PollLocked does.

PeerWatchOptions NcclStyle(int rank, int warning_ms, int timeout_ms) {
  return PeerWatchOptions{"g", rank, 2, milliseconds(100), milliseconds(warning_ms), milliseconds(timeout_ms),
                          "NcclOptions"};
}

// Polls a pending collective that never completes until `until()` or the
// watch's failure (thrown as CommTimeoutError, as the NCCL backend does
// after aborting); fails the test after 10 s. Returns the time it took.
int64_t PollPending(const StallWatch& watch, const std::function<bool()>& until) {
  const auto start = Clock::now();
  WaitWithDeadline(
      [&] {
        if (std::string f = watch.Failure(); !f.empty()) throw CommTimeoutError(f);
        return until();
      },
      start + milliseconds(10000), [] { FAIL() << "no stall report within 10 s"; },
      std::chrono::microseconds(20000));
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

// Rank 1 (alive: its heartbeat thread runs) issued collectives #1-#3 and no
// more; rank 0 waits in #4: the warning names rank 1, its last collective
// and rank 0's, after stall_warning (0.5 s) and once.
TEST(StallWatchTest, PendingCollectiveWarnsNamingAnAlivePeerThatNeverIssuesIt) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  StallWatch rank1(MakeHeartbeatStore(store), NcclStyle(1, 500, 0));
  for (int64_t seq = 1; seq <= 3; ++seq) rank1.Issue(seq, "AllReduce");  // completed at once
  StallWatch rank0(MakeHeartbeatStore(store), NcclStyle(0, 500, 0));
  for (int64_t seq = 1; seq <= 3; ++seq) rank0.Issue(seq, "AllReduce");
  std::this_thread::sleep_for(milliseconds(250));  // both heartbeats published with #3
  const auto pending = rank0.Issue(4, "AllGather");
  const int64_t ms = PollPending(rank0, [&] { return rank0.Warnings() > 0; });
  const std::string w = rank0.LastWarning();
  EXPECT_NE(w.find("stalled peer: rank 1 of group 'g' (pid " + std::to_string(getpid()) + ", host "),
            std::string::npos)
      << w;
  EXPECT_NE(w.find("it is alive (heartbeat"), std::string::npos) << w;
  EXPECT_NE(w.find("its last heartbeat says collective #3 (AllReduce); this rank (0) waits in collective #4 "
                   "(AllGather)"),
            std::string::npos)
      << w;
  EXPECT_NE(w.find("(warning after NcclOptions::stall_warning = 0.5 s"), std::string::npos) << w;
  EXPECT_GE(ms, 500);
  EXPECT_LT(ms, 2500);
  std::printf("stall -> warning: %lld ms (stall_warning 500 ms, heartbeat period 100 ms)\n",
              static_cast<long long>(ms));
  std::this_thread::sleep_for(milliseconds(400));
  EXPECT_EQ(rank0.Warnings(), 1);  // once per stall
  EXPECT_TRUE(rank0.Failure().empty());  // no stall_timeout
  EXPECT_TRUE(rank1.LastWarning().empty());  // rank 1 waits in nothing
}

// Rank 1's heartbeats (written by a thread, as a real rank's) stop after it
// issued #5, the collective rank 0 waits in (a rank stopped inside it):
// after stall_timeout (0.8 s) the polling wait fails naming rank 1 and its
// stopped heartbeat. A peer that reached the collective is not at fault
// while its heartbeat is fresh.
TEST(StallWatchTest, StoppedHeartbeatFailsThePollingWaitAtStallTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto beats = MakeHeartbeatStore(store);
  std::atomic<bool> stopped{false};
  std::thread rank1([&] {
    gloo_internal::Heartbeat h;
    h.issued = 5;
    h.op = "AllReduce";
    h.pid = 4242;
    h.host = "hostB/boot:y";
    while (!stopped) {
      h.wall_ms = WallMs();
      beats.set("shardtrain/heartbeat/g/1", h.Format());
      std::this_thread::sleep_for(milliseconds(50));
    }
  });
  StallWatch rank0(beats, NcclStyle(0, 0, 800));
  for (int64_t seq = 1; seq <= 4; ++seq) rank0.Issue(seq, "AllReduce");
  const auto pending = rank0.Issue(5, "AllReduce");
  std::this_thread::sleep_for(milliseconds(1000));
  EXPECT_TRUE(rank0.Failure().empty()) << rank0.Failure();  // rank 1 is alive in #5: no stall
  stopped = true;
  rank1.join();
  const auto start = Clock::now();
  try {
    PollPending(rank0, [] { return false; });
    FAIL() << "expected CommTimeoutError";
  } catch (const CommTimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("stalled peer: rank 1 of group 'g' (pid 4242, host hostB) has made no progress for"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("its heartbeat stopped"), std::string::npos) << what;
    EXPECT_NE(what.find("giving up after NcclOptions::stall_timeout = 0.8 s"), std::string::npos) << what;
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  EXPECT_GE(ms, 700);  // counted from the last heartbeat (up to 50 ms before the stop)
  EXPECT_LT(ms, 3000);
}

}  // namespace
}  // namespace shardtrain::comm
