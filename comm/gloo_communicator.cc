#include "comm/gloo_communicator.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <signal.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "comm/errors.h"
#include "comm/logging.h"
#include "comm/net_address.h"
#include "comm/peer_watch.h"
#include "comm/reduce_kernels.h"
#include "comm/shared_memory_mesh.h"

namespace shardtrain::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;

// Operation names as they appear in errors (the public API's method names).
const char* OpTitle(CommOp op) {
  static constexpr const char* kTitles[] = {"AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Barrier"};
  const int i = static_cast<int>(op);
  return i >= 0 && i < static_cast<int>(CommOp::kCount) ? kTitles[i] : "?";
}

// An exception's message without c10's C++ backtrace, first line only.
std::string ErrorText(const std::exception& e) {
  const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
  std::string text = ce ? ce->what_without_backtrace() : e.what();
  const size_t nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl);
}

int64_t WallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Seconds(int64_t ms) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << ms / 1000.0 << " s";
  return os.str();
}

// One rank's heartbeat as published in the store, one line of text:
//   "<wall ms> <collectives issued> <latest op or -> <pid> <host id> <up|closed>"
struct Heartbeat {
  int64_t wall_ms = 0;
  int64_t issued = 0;
  std::string op = "-";
  int64_t pid = 0;
  std::string host;
  bool closed = false;

  std::string Format() const {
    return internal::StrCat(wall_ms, " ", issued, " ", op, " ", pid, " ", host, " ", closed ? "closed" : "up");
  }
  static std::optional<Heartbeat> Parse(const std::vector<uint8_t>& bytes) {
    std::istringstream is(std::string(bytes.begin(), bytes.end()));
    Heartbeat h;
    std::string state;
    if (!(is >> h.wall_ms >> h.issued >> h.op >> h.pid >> h.host >> state)) return std::nullopt;
    h.closed = state == "closed";
    return h;
  }
  // "41 collectives issued, the latest AllGather"
  std::string Progress() const {
    return internal::StrCat(issued, issued == 1 ? " collective" : " collectives", " issued",
                            op == "-" ? "" : ", the latest " + op);
  }
};

}  // namespace

// What a pending Work needs to know about its group, shared with the
// communicator so that Works outlive it safely.
struct GlooGroupRef {
  std::string name;
  int rank;
  int size;
  std::shared_ptr<GlooPeerMonitor> monitor;  // null: no heartbeats
  std::shared_ptr<PeerWatch> watch;          // null: no heartbeats
};

// Publishes this rank's heartbeat to the store every `period` from a
// background thread, and explains failures from the peers' heartbeats.
//
// Failure diagnosis reads the peers' records through the same thread (so a
// dead or unresponsive store never blocks the failing collective for more than
// kReadWait) and names, per peer: a closed communicator, a dead process (pid
// check, same host only), a heartbeat older than 3 periods (dead or hung), or a
// live rank that has not issued the failed collective yet. The thread and its
// state are shared-owned, so a thread stuck in an unresponsive store can be
// left behind (detached) by Stop() without dangling references.
class GlooPeerMonitor : public std::enable_shared_from_this<GlooPeerMonitor> {
 public:
  GlooPeerMonitor(c10::intrusive_ptr<c10d::Store> store, std::string group, int rank, int size,
                  std::chrono::milliseconds period)
      : store_(std::move(store)),
        group_(std::move(group)),
        rank_(rank),
        size_(size),
        period_(period),
        pid_(getpid()),
        host_(local_host::Id()),
        known_(size) {}

  ~GlooPeerMonitor() {
    if (thread_.joinable()) thread_.detach();  // only if Stop() was never called
  }

  void Start() {
    thread_ = std::thread([self = shared_from_this()] { self->Run(); });
  }

  // Records that this rank issued collective #seq.
  void Note(int64_t seq, CommOp op) {
    last_op_.store(static_cast<int>(op), std::memory_order_relaxed);
    issued_.store(seq, std::memory_order_release);
  }

  // Publishes a last "closed" heartbeat and ends the thread. Waits at most
  // kStopWait (a thread stuck in an unresponsive store is detached).
  void Stop() {
    bool exited;
    {
      std::unique_lock<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
      exited = cv_.wait_for(lock, kStopWait, [&] { return exited_; });
    }
    if (!thread_.joinable()) return;
    if (exited) {
      thread_.join();
    } else {
      thread_.detach();
    }
  }

  // Explains why collective #seq (`op`, issued at wall time `issued_ms`)
  // failed, naming the peers at fault. Never blocks for much longer than
  // kReadWait (plus 1.5 periods when the first look finds no culprit after a
  // connection failure).
  std::string Diagnose(int64_t seq, int64_t issued_ms, const char* op, bool timed_out) {
    std::unique_lock<std::mutex> lock(mu_);
    Snapshot snap;
    const bool fresh = FreshRead(lock, &snap);
    std::vector<std::string> findings;
    std::vector<int> reached, alive;
    Judge(snap, fresh, seq, issued_ms, op, timed_out, &findings, &reached, &alive);
    if (findings.empty() && !timed_out && fresh && snap.ok) {
      // A connection failed, yet every peer looks alive: a peer that died a
      // moment ago still has a fresh heartbeat. Look again once it would have
      // published its next one.
      cv_.wait_for(lock, period_ * 3 / 2, [&] { return exited_; });
      Snapshot again;
      if (FreshRead(lock, &again) && again.ok) {
        for (int r = 0; r < size_; ++r) {
          const auto& a = snap.peers[r];
          const auto& b = again.peers[r];
          if (r == rank_ || !a || !b) continue;
          if (!b->closed && b->wall_ms == a->wall_ms) {
            findings.push_back(internal::StrCat(Rank(r), ": its heartbeat stopped (not renewed for ",
                                                Seconds(again.wall_ms - a->wall_ms), ": dead or hung; ",
                                                a->Progress(), ")"));
          } else if (b->closed) {
            findings.push_back(internal::StrCat(Rank(r), " has closed its communicator (", b->Progress(), ")"));
          } else {
            continue;
          }
          reached.erase(std::remove(reached.begin(), reached.end(), r), reached.end());
          alive.erase(std::remove(alive.begin(), alive.end(), r), alive.end());
        }
      }
    }
    std::string text;
    for (const auto& f : findings) text += (text.empty() ? "" : "; ") + f;
    auto summary = [&](const std::vector<int>& ranks, const char* one, const char* many) {
      if (ranks.empty()) return;
      std::string list;
      for (size_t i = 0; i < ranks.size() && i < 16; ++i) list += (i ? ", " : "") + std::to_string(ranks[i]);
      if (ranks.size() > 16) list += ", ...";
      const bool every = static_cast<int>(ranks.size()) == size_ - 1 && size_ > 2;
      text += internal::StrCat(text.empty() ? "" : "; ", every ? "every peer (" : ranks.size() == 1 ? "rank " : "ranks ",
                               list, every ? ")" : "", " of group '", group_, "' ", ranks.size() == 1 ? one : many);
    };
    summary(reached, "is alive and has issued this collective", "are alive and have issued this collective");
    summary(alive, "is alive", "are alive");
    return text;
  }

 private:
  static constexpr std::chrono::milliseconds kReadWait{2000};
  static constexpr std::chrono::milliseconds kStopWait{3000};
  static constexpr int kStalePeriods = 3;

  struct Snapshot {
    bool ok = false;
    std::string error;
    int64_t wall_ms = 0;  // when it was read
    std::vector<std::optional<Heartbeat>> peers;
  };

  std::string Key(int r) const { return "shardtrain/heartbeat/" + group_ + "/" + std::to_string(r); }
  std::string Rank(int r) const { return internal::StrCat("rank ", r, " of group '", group_, "'"); }

  void Run() {
    auto next_publish = SteadyClock::now();
    int identity_reads = 10;  // reads until every peer's pid and host are known
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const bool read_wanted = reads_requested_ > reads_done_;
      const auto now = SteadyClock::now();
      if (!read_wanted && now < next_publish) {
        cv_.wait_until(lock, next_publish);
        continue;
      }
      const int64_t request = reads_requested_;
      lock.unlock();
      if (now >= next_publish) {
        Publish(false);
        next_publish = now + period_;
      }
      std::optional<Snapshot> snap;
      if (read_wanted || identity_reads > 0) snap = Read();
      lock.lock();
      if (!snap) continue;
      bool all_known = true;
      for (int r = 0; r < size_; ++r) {
        if (snap->peers[r]) known_[r] = snap->peers[r];
        all_known = all_known && (r == rank_ || known_[r]);
      }
      identity_reads = all_known ? 0 : identity_reads - 1;
      if (read_wanted) {
        latest_ = std::move(*snap);
        reads_done_ = request;
        cv_.notify_all();
      }
    }
    lock.unlock();
    Publish(true);
    lock.lock();
    exited_ = true;
    cv_.notify_all();
  }

  void Publish(bool closed) {
    Heartbeat h;
    h.wall_ms = WallMs();
    h.issued = issued_.load(std::memory_order_acquire);
    const int op = last_op_.load(std::memory_order_relaxed);
    if (op >= 0) h.op = OpTitle(static_cast<CommOp>(op));
    h.pid = pid_;
    h.host = host_;
    h.closed = closed;
    const std::string text = h.Format();
    try {
      store_->set(Key(rank_), std::vector<uint8_t>(text.begin(), text.end()));
    } catch (const std::exception&) {
      // The store is gone or unreachable; a failing collective says so when it reads.
    }
  }

  Snapshot Read() {
    Snapshot s;
    s.peers.resize(size_);
    try {
      std::vector<std::string> keys;
      std::vector<int> ranks;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        keys.push_back(Key(r));
        ranks.push_back(r);
      }
      if (store_->check(keys)) {  // the usual case: one round trip for all
        const auto values = store_->multiGet(keys);
        for (size_t i = 0; i < ranks.size() && i < values.size(); ++i) s.peers[ranks[i]] = Heartbeat::Parse(values[i]);
      } else {  // get() blocks on a missing key: check each first
        for (size_t i = 0; i < ranks.size(); ++i)
          if (store_->check({keys[i]})) s.peers[ranks[i]] = Heartbeat::Parse(store_->get(keys[i]));
      }
      s.ok = true;
    } catch (const std::exception& e) {
      s.error = ErrorText(e);
    }
    s.wall_ms = WallMs();
    return s;
  }

  // Asks the thread for a read that starts after this call and waits for it at
  // most kReadWait. False (and `out` untouched) if none came.
  bool FreshRead(std::unique_lock<std::mutex>& lock, Snapshot* out) {
    if (exited_) return false;
    const int64_t request = ++reads_requested_;
    cv_.notify_all();
    if (!cv_.wait_for(lock, kReadWait, [&] { return reads_done_ >= request || exited_; }) || reads_done_ < request) {
      return false;
    }
    *out = latest_;
    return true;
  }

  // Sorts the peers: `findings` explain the failure (closed, dead, silent,
  // behind); the others are listed in `reached` (issued #seq) or `alive`
  // (their latest heartbeat predates #seq, so their progress is unknown; or
  // behind in a failure that is no timeout: a peer that closed or died caused
  // it, and a rank a moment behind, or one that issued #seq since its
  // heartbeat, is not at fault).
  void Judge(const Snapshot& snap, bool fresh, int64_t seq, int64_t issued_ms, const char* op, bool timed_out,
             std::vector<std::string>* findings, std::vector<int>* reached, std::vector<int>* alive) const {
    const bool have = fresh && snap.ok;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const std::optional<Heartbeat>& h = have ? snap.peers[r] : known_[r];
      if (!h) {
        if (have)
          findings->push_back(Rank(r) + " has published no heartbeat (it died early, or runs without heartbeats)");
        continue;
      }
      const bool local = h->host == host_ && h->pid != pid_;
      if (h->closed) {
        findings->push_back(internal::StrCat(Rank(r), " has closed its communicator (", h->Progress(), ")"));
      } else if (local && local_host::ProcessGone(h->pid)) {
        findings->push_back(internal::StrCat(Rank(r), " (pid ", h->pid, " on this host) has died",
                                             have ? " (" + h->Progress() + ")" : ""));
      } else if (!have) {
        continue;  // nothing more can be said without the store
      } else if (const int64_t age = snap.wall_ms - h->wall_ms; age > kStalePeriods * period_.count()) {
        findings->push_back(internal::StrCat(Rank(r), ": no heartbeat for ", Seconds(age), " (dead or hung; ",
                                             h->Progress(), ")"));
      } else if (h->issued >= seq) {
        reached->push_back(r);
      } else if (h->wall_ms < issued_ms || !timed_out) {  // (hosts' wall clocks: NTP's skew is far below a period)
        alive->push_back(r);
      } else {
        findings->push_back(internal::StrCat(Rank(r), " is alive (heartbeat ", Seconds(std::max<int64_t>(age, 0)),
                                             " ago) but has issued ", h->issued, " collectives while this rank is at #",
                                             seq, " (", op, "): it has not reached this collective",
                                             h->op == "-" ? "" : " (its latest: " + h->op + ")"));
      }
    }
    if (!fresh) {
      findings->push_back(exited_ ? "no heartbeats read: the communicator was destroyed"
                                  : "the rendezvous store did not answer within " + Seconds(kReadWait.count()) +
                                        StoreNote());
    } else if (!snap.ok) {
      findings->push_back(internal::StrCat("the rendezvous store could not be read (", snap.error, ")", StoreNote()));
    }
  }

  // Which process serves the store, for when it cannot be read.
  std::string StoreNote() const {
    c10::intrusive_ptr<c10d::Store> base = store_;
    if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base.get())) base = prefixed->getUnderlyingNonPrefixStore();
    if (auto* tcp = dynamic_cast<c10d::TCPStore*>(base.get())) {
      return internal::StrCat(": the TCPStore at ", tcp->getHost(), ":", tcp->getPort(),
                              " is served by a single process (rank 0, or torchrun's agent), which has probably died");
    }
    return "";
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string group_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds period_;
  const int64_t pid_;
  const std::string host_;
  std::atomic<int64_t> issued_{0};
  std::atomic<int> last_op_{-1};

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stop_ = false;
  bool exited_ = false;
  int64_t reads_requested_ = 0;
  int64_t reads_done_ = 0;
  Snapshot latest_;                               // the latest requested read
  std::vector<std::optional<Heartbeat>> known_;  // each rank's latest record seen (pids when the store is gone)
  std::thread thread_;
};

namespace {

std::string Describe(const char* op, const GlooGroupRef& g) {
  return internal::StrCat(op, " on gloo group '", g.name, "' (rank ", g.rank, "/", g.size, ")");
}

// Copies what `peer` sends into output blocks: block p of `out` starts at
// byte `starts[p]`.
SharedMemoryMesh::Consumer CopyInto(uint8_t* out, std::vector<int64_t> starts) {
  return [out, starts = std::move(starts)](int peer, int64_t offset, const uint8_t* data, int64_t len) {
    std::memcpy(out + starts[peer] + offset, data, len);
    return len;
  };
}

// The error of collective `call` that failed (or timed out after `timeout`):
// the operation and group, the peers at fault (from heartbeats), then what the
// engine said.
std::string FailureText(const GlooGroupRef& g, CommOp op, IssuedCall call, bool timed_out,
                        std::chrono::milliseconds timeout, const char* engine, const std::string& detail) {
  std::string why = g.monitor ? g.monitor->Diagnose(call.seq, call.wall_ms, OpTitle(op), timed_out) : "";
  if (why.empty()) why = "a peer rank may have died or not reached this collective";
  return internal::StrCat(Describe(OpTitle(op), g),
                          timed_out ? " timed out after " + std::to_string(timeout.count()) + " ms" : " failed",
                          " (collective #", call.seq, " of this rank): ", why, ". ", engine, ": ",
                          detail.substr(0, 600));
}

// Wraps a c10d Work: turns engine errors into CommError naming the operation,
// the group and (from heartbeats) the peer at fault, and runs a local
// completion step (unpacking, local sums, scaling) exactly once after the
// collective finished.
class GlooWork : public Work {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::shared_ptr<const GlooGroupRef> group, CommOp op, IssuedCall call,
           std::chrono::milliseconds timeout, std::function<void()> finish)
      : work_(std::move(work)),
        group_(std::move(group)),
        op_(op),
        call_(call),
        timeout_(timeout),
        finish_(std::move(finish)) {}

  void Wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    if (!error_.empty()) {
      if (timed_out_) ST_THROW(CommTimeoutError, error_);
      ST_THROW(CommError, error_);
    }
    const auto t = timeout.count() > 0 ? timeout : timeout_;
    try {
      PeerWatch::Wait(group_->watch.get(), call_.seq, OpTitle(op_), t, [&](auto slice) { work_->wait(slice); },
                      [&] { return work_->isCompleted(); });
    } catch (const CommTimeoutError& e) {  // a stalled peer (GlooOptions::stall_timeout)
      error_ = e.what();
      timed_out_ = true;
      throw;
    } catch (const std::exception& e) {
      const std::string msg = ErrorText(e);
      timed_out_ = msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos;
      error_ = FailureText(*group_, op_, call_, timed_out_, t, "Gloo", msg);
      if (timed_out_) ST_THROW(CommTimeoutError, error_);
      ST_THROW(CommError, error_);
    }
    if (finish_) finish_();
    done_ = true;
  }

  bool IsCompleted() override { return done_ || work_->isCompleted(); }

 private:
  std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<const GlooGroupRef> group_;
  CommOp op_;
  IssuedCall call_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  std::atomic<bool> done_{false};
  bool timed_out_ = false;
  std::string error_;
};

// Where Gloo listens by default: the local address that reaches the TCPStore's
// host (loopback when that is loopback), as the store itself binds to it;
// loopback for a HashStore (threads of one process); "" (the hostname's
// address) for a FileStore, whose ranks may span hosts on a shared filesystem.
std::string ListenAddressFor(c10d::Store& store) {
  c10d::Store* base = &store;
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base)) base = prefixed->getUnderlyingNonPrefixStore().get();
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(base)) return LocalAddressToward(tcp->getHost());
  if (dynamic_cast<c10d::HashStore*>(base)) return "127.0.0.1";
  return "";
}

bool IsSupportedDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kChar: case at::kByte: case at::kBool:
      return true;
    default:
      return false;
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GlooOptions options)
    : Communicator(rank, size, options.name, options.timeout), store_(std::move(store)), options_(std::move(options)) {
  // c10d's process-wide flight recorder (a debugging trace of collectives)
  // corrupts its maps when several process groups in one process record at
  // once (threads-as-ranks, sub-groups used from autograd threads). It is off
  // unless the user asks for it with TORCH_FR_BUFFER_SIZE.
  static const bool fr_configured = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();
  (void)fr_configured;
  ST_CHECK_ARG(options_.threads >= 1, "GlooOptions.threads must be >= 1, got ", options_.threads);
  ST_CHECK_ARG(options_.heartbeat_period.count() >= 0, "GlooOptions.heartbeat_period must be >= 0 ms (0: off), got ",
               options_.heartbeat_period.count(), " ms");
  CheckStallOptions(options_.stall_warning, options_.stall_timeout);
  ST_CHECK_ARG(options_.shared_memory_ring_bytes >= 4096 && options_.shared_memory_ring_bytes % 4096 == 0,
               "GlooOptions.shared_memory_ring_bytes must be a positive multiple of 4096, got ",
               options_.shared_memory_ring_bytes);
  auto opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
  try {
    if (!options_.hostname.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options_.hostname));
    } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (const std::string addr = ListenAddressFor(*store_); !addr.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->threads = options_.threads;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, size, opts);
    ConnectSharedMemory();
    if (options_.verify_calls && size > 1 && !mesh_) {
      // The signature exchange gets its own connections and worker thread:
      // on pg_ it would queue behind the collectives still in flight, and the
      // caller would block until they finished (no overlap with compute).
      auto verify_opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
      verify_opts->devices = opts->devices;
      verify_opts->threads = 1;
      verify_pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("verify", store_), rank, size, verify_opts);
    }
  } catch (const std::exception& e) {
    ST_THROW(CommError, "connecting gloo group '", name_, "' (rank ", rank, "/", size, ") failed within ",
             options_.timeout.count(), " ms: ", e.what());
  }
  if (size_ > 1 && options_.heartbeat_period.count() > 0) {
    monitor_ = std::make_shared<GlooPeerMonitor>(store_, name_, rank_, size_, options_.heartbeat_period);
    monitor_->Start();
  }
  std::shared_ptr<PeerWatch> watch;
  if (monitor_ && (options_.stall_warning.count() > 0 || options_.stall_timeout.count() > 0)) {
    watch = std::make_shared<PeerWatch>(
        PeerWatchOptions{name_, rank_, size_, options_.heartbeat_period, options_.stall_warning,
                         options_.stall_timeout},
        [store = store_, name = name_, rank = rank_, size = size_] {
          std::vector<std::string> keys;  // GlooPeerMonitor's keys
          for (int r = 0; r < size; ++r)
            if (r != rank) keys.push_back("shardtrain/heartbeat/" + name + "/" + std::to_string(r));
          std::vector<std::optional<PeerBeat>> beats(size);
          if (!store->check(keys)) return beats;  // not every peer published yet
          const auto values = store->multiGet(keys);
          for (int r = 0, i = 0; r < size && i < static_cast<int>(values.size()); ++r) {
            if (r == rank) continue;
            if (auto h = Heartbeat::Parse(values[i++])) beats[r] = PeerBeat{h->wall_ms, h->issued, h->op, h->pid, h->host, h->closed};
          }
          return beats;
        });
    if (mesh_) watch->OnStallFailure([mesh = mesh_.get()] { mesh->Abort(); });
  }
  group_ = std::make_shared<const GlooGroupRef>(GlooGroupRef{name_, rank_, size_, monitor_, watch});
  if (verify_pg_ || mesh_) issuer_ = std::make_unique<GlooCallIssuer>();
}

void GlooCommunicator::ConnectSharedMemory() {
  if (size_ < 2) return;
  const char* env = std::getenv("SHARDTRAIN_GLOO_SHM");
  const bool wanted = options_.shared_memory && !(env && std::string(env) == "0");
  MeshRendezvous rendezvous;
  rendezvous.set = [this](const std::string& key, const std::string& value) {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  };
  rendezvous.get = [this](const std::string& key) {
    const std::vector<uint8_t> v = store_->get(key);
    return std::string(v.begin(), v.end());
  };
  rendezvous.add = [this](const std::string& key, int64_t delta) { return store_->add(key, delta); };
  // Every rank takes part, wanted or not, so that all agree on the outcome.
  std::string why_not;
  mesh_ = SharedMemoryMesh::Connect(rendezvous, rank_, size_, wanted, options_.shared_memory_ring_bytes, &why_not);
  if (!mesh_ && wanted) {
    ST_LOG(WARNING) << "gloo group '" << name_ << "' (rank " << rank_ << "/" << size_
                    << "): not using shared memory (" << why_not << "); collectives go through Gloo's TCP connections";
  }
}

GlooCommunicator::~GlooCommunicator() {
  if (group_ && group_->watch) {
    group_->watch->Stop();  // before mesh_ goes (its stall callback)
    if (!group_->watch->Failure().empty()) {
      // A stalled peer failed the group (GlooOptions::stall_timeout): Gloo's
      // worker threads may wait on it until `timeout`, and destroying the
      // process groups would join them. Leave them to the process's exit.
      (void)pg_.release();
      (void)verify_pg_.release();
    }
  }
  if (mesh_) {
    // Peers waiting on this rank fail at once (and can read why from the
    // "closed" heartbeat); so does a transfer of this rank in progress.
    if (monitor_) monitor_->Stop();
    mesh_->Abort();
  }
  issuer_.reset();  // calls not started yet fail; one being started finishes first
  // The "closed" heartbeat goes out before pg_ (destroyed after this body)
  // closes the connections, so peers that fail on them can tell why.
  if (monitor_) monitor_->Stop();
}

std::shared_ptr<GlooCommunicator> GlooCommunicator::Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                           GlooOptions options) {
  ST_CHECK_ARG(store, "GlooCommunicator::Create needs a rendezvous store");
  return std::shared_ptr<GlooCommunicator>(new GlooCommunicator(std::move(store), rank, size, std::move(options)));
}

void GlooCommunicator::CheckCpu(const char* op, const at::Tensor& t) const {
  ST_CHECK_ARG(t.defined(), op, " on group '", name_, "': tensor must be defined");
  ST_CHECK_ARG(t.device().is_cpu(), op, " on gloo group '", name_, "': tensors must be on the CPU, got ", t.device(),
               " (use the nccl backend for CUDA tensors)");
  ST_CHECK_ARG(IsSupportedDtype(t.scalar_type()), op, " on gloo group '", name_, "': unsupported dtype ",
               t.scalar_type(), "; valid: float32, float64, float16, bfloat16, int8/uint8/int32/int64, bool");
  ST_CHECK_ARG(t.is_contiguous(), op, " on group '", name_, "': tensor must be contiguous");
}

IssuedCall GlooCommunicator::Issue(CommOp op) {
  IssuedCall call{++issued_, monitor_ ? WallMs() : 0};
  if (monitor_) monitor_->Note(call.seq, op);
  return call;
}

// ---------------------------------------------------------------------------
// Issuing collectives off the caller's thread (GlooOptions::verify_calls).
//
// The signature check is a round trip with every peer, which ends only when
// the slowest rank reaches the same call. Done on the caller's thread it would
// stall compute at every collective by the ranks' momentary skew (a prefetch
// could not run ahead of the peer). So with verify_calls each collective's
// check and start run, in call order, on one issuing thread per communicator;
// the caller gets a DeferredWork at once, whose Wait() first waits for the
// start (and rethrows a mismatch or a failed exchange), then for the
// collective itself.

namespace {

// A collective handed to the issuing thread: done_ once started (inner_) or failed (error_).
class DeferredWork : public Work {
 public:
  explicit DeferredWork(std::string what) : what_(std::move(what)) {}

  void Started(WorkPtr inner) { Finish(std::move(inner), nullptr); }
  void Failed(std::exception_ptr error) { Finish(nullptr, std::move(error)); }

  void Wait(std::chrono::milliseconds timeout) override {
    WorkPtr inner;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (timeout.count() > 0) {
        if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
          ST_THROW(CommTimeoutError, what_, " timed out after ", timeout.count(),
                   " ms on the issuing thread: the ranks' signature exchange or the shared memory transfer did not "
                   "complete (a peer rank may have died or not reached this collective)");
        }
      } else {
        // The signature exchange is bounded by the communicator's timeout and
        // then fails with a diagnosis of the peers; wait for that.
        cv_.wait(lock, [&] { return done_; });
      }
      if (error_) std::rethrow_exception(error_);
      inner = inner_;
    }
    inner->Wait(timeout);
  }

  bool IsCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ && (error_ != nullptr || inner_->IsCompleted());
  }

 private:
  void Finish(WorkPtr inner, std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inner_ = std::move(inner);
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }

  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  WorkPtr inner_;
  std::exception_ptr error_;
};

}  // namespace

// One thread that starts a communicator's collectives in call order.
class GlooCallIssuer {
 public:
  struct Call {
    std::function<WorkPtr()> start;  // signature check, then the collective
    std::shared_ptr<DeferredWork> work;
  };

  GlooCallIssuer() : thread_([this] { Loop(); }) {}
  ~GlooCallIssuer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void Push(Call call) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(call));
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    at::NoGradGuard no_grad;
    std::exception_ptr broken;  // a failed exchange: the group's connections are unusable
    for (;;) {
      Call call;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        call = std::move(queue_.front());
        queue_.pop_front();
        if (stop_ && !broken) {
          broken = std::make_exception_ptr(
              CommError("the communicator was destroyed before this collective could start"));
        }
      }
      if (broken) {
        call.work->Failed(broken);
        continue;
      }
      try {
        call.work->Started(call.start());
      } catch (const InvalidArgumentError&) {
        call.work->Failed(std::current_exception());  // a mismatched call; the group stays usable
      } catch (...) {
        broken = std::current_exception();
        call.work->Failed(broken);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Call> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

WorkPtr GlooCommunicator::Submit(CommOp op, const at::Tensor& t, int64_t root, IssuedCall call,
                                 std::function<WorkPtr()> start) {
  if (!issuer_) return start();  // verify_calls off, no shared memory: start here
  auto work = std::make_shared<DeferredWork>(Describe(OpTitle(op), *group_));
  issuer_->Push({[this, op, t, root, call, start = std::move(start)] {
                   if (options_.verify_calls) VerifySameCall(op, t, root, call);
                   return start();
                 },
                 work});
  return work;
}

WorkPtr GlooCommunicator::RunOnMesh(CommOp op, IssuedCall call,
                                    const std::function<void(SteadyClock::time_point deadline)>& transfer) {
  try {
    PeerWatch::Waiting waiting(group_->watch.get(), call.seq, OpTitle(op));
    transfer(SteadyClock::now() + timeout_);
  } catch (const SharedMemoryError& e) {
    if (std::string f = group_->watch ? group_->watch->Failure() : ""; !f.empty()) throw CommTimeoutError(f);
    const bool timed_out = e.kind() == SharedMemoryError::Kind::kTimeout;
    const std::string text = FailureText(*group_, op, call, timed_out, timeout_, "Shared memory", e.what());
    if (timed_out) ST_THROW(CommTimeoutError, text);
    ST_THROW(CommError, text);
  }
  return CompletedWork();
}

WorkPtr GlooCommunicator::Wrap(c10::intrusive_ptr<c10d::Work> work, CommOp op, IssuedCall call,
                               std::function<void()> finish) {
  return std::make_shared<GlooWork>(std::move(work), group_, op, call, timeout_, std::move(finish));
}

void GlooCommunicator::VerifySameCall(CommOp op, const at::Tensor& t, int64_t root, IssuedCall call) {
  // Cheap on purpose (it precedes every collective): the signature is written
  // through a raw pointer into buffers allocated once per communicator, and
  // exchanged through shared memory, or with an equal-split Gloo all-to-all
  // (every rank sends its signature to every rank), which measured about half
  // the latency of c10d's _allgather_base (that one gathers into a fresh flat
  // buffer and copies out).
  const int64_t mine[4] = {static_cast<int64_t>(op), t.defined() ? t.numel() : 0,
                           t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1, root};
  if (!signatures_.defined()) signatures_ = at::empty({4 * size_}, at::kLong);  // rank r's at [4r, 4r + 4)
  int64_t* all = signatures_.data_ptr<int64_t>();
  std::memcpy(all + 4 * rank_, mine, sizeof(mine));
  if (mesh_) {
    RunOnMesh(op, call, [&](SteadyClock::time_point deadline) {
      std::vector<SharedMemoryMesh::PeerTraffic> traffic(size_);
      std::vector<int64_t> starts(size_);
      for (int r = 0; r < size_; ++r) {
        traffic[r] = {{{mine, sizeof(mine)}}, sizeof(mine)};
        starts[r] = r * static_cast<int64_t>(sizeof(mine));
      }
      mesh_->Exchange(traffic, CopyInto(reinterpret_cast<uint8_t*>(all), std::move(starts)), deadline);
    });
  } else {
    if (!signature_.defined()) signature_ = at::empty({4 * size_}, at::kLong);  // mine, once per destination rank
    int64_t* out = signature_.data_ptr<int64_t>();
    for (int r = 0; r < size_; ++r) std::memcpy(out + 4 * r, mine, sizeof(mine));
    try {
      std::vector<int64_t> equal_splits;
      GlooWork(verify_pg_->alltoall_base(signatures_, signature_, equal_splits, equal_splits), group_, op, call,
               timeout_, nullptr)
          .Wait(std::chrono::milliseconds(0));
    } catch (...) {
      // Gloo may still write into the buffers of a failed exchange: never reuse them.
      signature_.reset();
      signatures_.reset();
      throw;
    }
  }
  const int64_t* a = signatures_.data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < size_ && same; ++r) same = std::memcmp(a + 4 * r, a, 4 * sizeof(int64_t)) == 0;
  if (same) return;
  std::ostringstream os;
  for (int r = 0; r < size_; ++r) {
    os << (r ? "; " : "") << "rank " << r << ": " << CommOpName(static_cast<CommOp>(a[4 * r])) << " of " << a[4 * r + 1]
       << " x " << (a[4 * r + 2] >= 0 ? c10::toString(static_cast<at::ScalarType>(a[4 * r + 2])) : "none");
    if (a[4 * r] == static_cast<int64_t>(CommOp::kBroadcast)) os << " from root " << a[4 * r + 3];
  }
  ST_THROW(InvalidArgumentError, "ranks of gloo group '", name_,
           "' issued different collectives (every rank must make the same call with the same size and dtype): ",
           os.str());
}


// ---------------------------------------------------------------------------
// W=2 fast paths for AllGather, ReduceScatter and AllReduce (measured in
// bench/comm, see docs/comm_benchmark.md). At W=2 all-gather and reduce-scatter
// are one exchange of n elements each way, and a small all-reduce (up to
// kDirectAllReduceMaxBytes) one exchange of the whole tensor each way. The
// general paths below pay for c10d internals that
// dominate on large buffers: _allgather_base gathers into a freshly allocated
// full-size tensor and copies it into `output`; the all-to-all reduce-scatter
// receives into a fresh full-size tensor and reduces with blocks.sum(0) (very
// slow for 16-bit types); fresh buffers above glibc's mmap threshold are
// page-faulted in on every call. The fast paths instead exchange with c10d
// alltoall_base and split sizes {0, n} / {n, 0}: each rank sends n elements
// straight from the user's tensor and receives n straight into the user's
// output (all-reduce: into a receive buffer), on Gloo's worker threads like
// every other op. All-gather is one such exchange; reduce-scatter and
// all-reduce are one per 4 MiB piece (PipelinedExchange), and their Wait()
// combines (adds and scales) piece k while later pieces are still moving. The
// local steps (own shard copy; add and scale) run on the calling thread in
// pieces of at most GRAIN_SIZE elements, so they never wake the OpenMP pool,
// whose spinning threads otherwise steal the cores Gloo's I/O needs on small
// machines.
namespace {

bool IsFloating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

bool Is16Bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Largest all-reduce (bytes) that takes the W=2 exchange. Every rank then adds
// all n elements, where Gloo's ring (c10d allreduce: reduce-scatter, then
// all-gather of the sums) adds n/2 per rank and moves as many bytes, in two
// dependent steps. Measured on 2 cores over loopback (bench/comm, A/B in one
// binary): the exchange is ~1.5x faster at 1 MiB (one round trip fewer), even
// at ~2 MiB, and 6-25% slower from 4 MiB on, where the extra additions compete
// with the copies for the cores; the ring is then already at loopback speed.
constexpr int64_t kDirectAllReduceMaxBytes = int64_t{2} << 20;

// Sends `send` (n elements) to the other rank of a 2-rank group and receives
// its n elements into `recv`.
c10::intrusive_ptr<c10d::Work> ExchangeWithPeer(c10d::Backend& pg, int rank, const at::Tensor& send,
                                                const at::Tensor& recv, std::chrono::milliseconds timeout) {
  const int64_t n = send.numel();
  // Separate vectors: c10d may move from its split-size arguments.
  std::vector<int64_t> send_splits = rank == 0 ? std::vector<int64_t>{0, n} : std::vector<int64_t>{n, 0};
  std::vector<int64_t> recv_splits = send_splits;
  at::Tensor in = send, out = recv;
  c10d::AllToAllOptions o;
  o.timeout = timeout;
  return pg.alltoall_base(out, in, recv_splits, send_splits, o);
}

// An exchange in pieces: wait() runs the local step of piece k on the calling
// thread while Gloo's worker threads still move pieces k+1, ...
class PipelinedWork : public c10d::Work {
 public:
  PipelinedWork(std::vector<c10::intrusive_ptr<c10d::Work>> pieces, std::function<void(size_t)> on_piece)
      : pieces_(std::move(pieces)), on_piece_(std::move(on_piece)) {}
  bool isCompleted() override {
    return std::all_of(pieces_.begin(), pieces_.end(), [](const auto& w) { return w->isCompleted(); });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (; next_ < pieces_.size(); ++next_) {
      if (timeout == ::kNoTimeout) {
        pieces_[next_]->wait(timeout);
      } else {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pieces_[next_]->wait(std::max(left, std::chrono::milliseconds(1)));
      }
      on_piece_(next_);
    }
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> pieces_;
  std::function<void(size_t)> on_piece_;
  size_t next_ = 0;
};

// W=2: sends `send` to the peer and receives the peer's send.numel() elements
// into `recv` (which must not overlap `send`), in pieces of 4 MiB, each its own
// alltoall_base. The returned work's wait() calls on_piece(begin, count) on the
// waiting thread for each piece, in order, once it has arrived (and left),
// while later pieces are still moving.
c10::intrusive_ptr<c10d::Work> PipelinedExchange(c10d::Backend& pg, int rank, const at::Tensor& send,
                                                 const at::Tensor& recv, std::chrono::milliseconds timeout,
                                                 std::function<void(int64_t, int64_t)> on_piece) {
  constexpr int64_t kPieceBytes = int64_t{4} << 20;
  const int64_t n = send.numel();
  const int64_t piece = std::max<int64_t>(1, kPieceBytes / send.element_size());
  std::vector<c10::intrusive_ptr<c10d::Work>> pieces;
  for (int64_t i = 0; i < n; i += piece) {
    const int64_t len = std::min(piece, n - i);
    pieces.push_back(ExchangeWithPeer(pg, rank, send.narrow(0, i, len), recv.narrow(0, i, len), timeout));
  }
  return c10::make_intrusive<PipelinedWork>(std::move(pieces), [on_piece = std::move(on_piece), piece, n](size_t k) {
    const int64_t begin = static_cast<int64_t>(k) * piece;
    on_piece(begin, std::min(piece, n - begin));
  });
}

// Runs f(offset, length) over [0, n) in pieces small enough for ATen to run
// each on the calling thread.
template <typename F>
void Serially(int64_t n, F&& f) {
  for (int64_t i = 0; i < n; i += at::internal::GRAIN_SIZE) f(i, std::min<int64_t>(at::internal::GRAIN_SIZE, n - i));
}

// ---------------------------------------------------------------------------
// Collectives through shared memory (GlooOptions::shared_memory): every rank
// streams to every peer at once (comm/shared_memory_mesh.h); sends are
// (W-1)/W of the full buffer for all-gather and reduce-scatter and 2(W-1)/W
// for all-reduce, as counted. They run on the issuing thread.

// Start of block b when n elements are cut into w blocks, the first n % w of
// them one element longer.
int64_t BlockBegin(int64_t n, int w, int b) { return n / w * b + std::min<int64_t>(b, n % w); }

// The sum of the W ranks' contributions to one block of n elements, taken in
// rank order (c_0 + c_1 + ... + c_{W-1}, deterministic whatever order the
// bytes arrive in), piece by piece as they arrive; then multiplied by `scale`,
// stored into `out` and divided by `divide` there. 16-bit types are summed in
// float32 and rounded once, before the division. With `from_zero` the sum
// starts from +0 (as the general reduce-scatter's sum over blocks: -0 + -0
// gives +0), else from c_0 (as Gloo's all-reduce). At W=2 this is bit for bit
// the TCP paths' arithmetic.
//
// float32 and bfloat16 run comm/reduce_kernels' loops; at W=2 each arriving
// piece is added to this rank's and stored in one pass (in place when `out`
// is `mine`). Otherwise the sum runs in a buffer of its own (float32 for
// 16-bit types, or when `out` is `mine`) and is stored when the last rank's
// piece is in. Other dtypes use ATen.
class OrderedSum {
 public:
  OrderedSum(int world, int rank, at::Tensor mine, at::Tensor out, double scale, double divide, bool from_zero)
      : world_(world), rank_(rank), n_(out.numel()), dtype_(out.scalar_type()), es_(out.element_size()),
        mine_(std::move(mine)), out_(std::move(out)), scale_(scale), divide_(divide), from_zero_(from_zero),
        done_(world, 0) {
    pair_ = world == 2 && (dtype_ == at::kFloat || dtype_ == at::kBFloat16);
    if (pair_) return;
    const bool aliased = at::get_overlap_status(mine_, out_) != at::MemOverlapStatus::No;
    acc_ = Is16Bit(dtype_) ? at::empty({n_}, out_.options().dtype(at::kFloat)) : aliased ? at::empty_like(out_) : out_;
    zero_ = at::zeros({}, acc_.options());
  }

  // SharedMemoryMesh::Consumer: adds what it may of `peer`'s bytes.
  int64_t Consume(int peer, int64_t offset, const uint8_t* data, int64_t len) {
    if (pair_) {
      const int64_t k = std::min(len / es_, n_ - done_[peer]);
      StorePair(done_[peer], k, data);
      done_[peer] += k;
      return k * es_;
    }
    AdvanceMine();
    const int64_t k = std::min(len / es_, Limit(peer) - done_[peer]);
    if (k <= 0) return 0;
    Add(peer, data, k);
    AdvanceMine();
    return k * es_;
  }

  // Consume() as the mesh's consumer (the sum must outlive the exchange).
  SharedMemoryMesh::Consumer AsConsumer() {
    return [this](int peer, int64_t offset, const uint8_t* data, int64_t len) {
      return Consume(peer, offset, data, len);
    };
  }

  // After the exchange: adds the rest of this rank's contribution, finishes.
  void Finish() {
    if (!pair_)
      while (done_[rank_] < n_) AdvanceMine();
    TORCH_INTERNAL_ASSERT(finished_ == n_, "OrderedSum finished ", finished_, " of ", n_, " elements");
  }

 private:
  // Source s may add up to where the source before it has added.
  int64_t Limit(int s) const { return s == 0 ? n_ : done_[s - 1]; }

  // W=2: out[b, b+k) = finish(mine + peer's piece) in one pass.
  void StorePair(int64_t begin, int64_t k, const uint8_t* data) {
    const kernels::Finish f{from_zero_, static_cast<float>(scale_)};
    uint8_t* out = static_cast<uint8_t*>(out_.data_ptr()) + begin * es_;
    const uint8_t* mine = static_cast<const uint8_t*>(mine_.data_ptr()) + begin * es_;
    if (dtype_ == at::kFloat) {
      kernels::AddF32(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(mine),
                      reinterpret_cast<const float*>(data), k, f);
    } else {
      kernels::AddBF16(reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(mine),
                       reinterpret_cast<const uint16_t*>(data), k, f);
    }
    Divide(begin, k);
    finished_ += k;
  }

  // Adds the next k elements of source s (at `data`) to the sum; stores what
  // every source has added.
  void Add(int s, const void* data, int64_t k) {
    const int64_t begin = done_[s];
    const bool first = s == 0;
    if (dtype_ == at::kFloat || dtype_ == at::kBFloat16) {
      float* acc = acc_.data_ptr<float>() + begin;
      if (dtype_ == at::kFloat) {
        const auto* src = static_cast<const float*>(data);
        first ? kernels::LoadF32(acc, src, k, from_zero_) : kernels::AccumulateF32(acc, src, k);
      } else {
        const auto* src = static_cast<const uint16_t*>(data);
        first ? kernels::LoadBF16(acc, src, k, from_zero_) : kernels::AccumulateBF16(acc, src, k);
      }
    } else {
      const at::Tensor src = at::from_blob(const_cast<void*>(data), {k}, out_.options());
      Serially(k, [&](int64_t i, int64_t len) {
        at::Tensor a = acc_.narrow(0, begin + i, len);
        if (!first || from_zero_) {
          at::add_out(a, first ? zero_ : a, src.narrow(0, i, len));
        } else {
          a.copy_(src.narrow(0, i, len));
        }
      });
    }
    done_[s] += k;
    if (s == world_ - 1) Store(begin, k);
  }

  // Adds this rank's contribution up to its limit, a bounded piece at a time
  // (so sends and receives are serviced in between).
  void AdvanceMine() {
    constexpr int64_t kPiece = int64_t{1} << 17;
    const int64_t k = std::min(kPiece, Limit(rank_) - done_[rank_]);
    if (k > 0) Add(rank_, static_cast<const uint8_t*>(mine_.data_ptr()) + done_[rank_] * es_, k);
  }

  void Store(int64_t begin, int64_t count) {
    if (dtype_ == at::kBFloat16) {
      kernels::StoreBF16(static_cast<uint16_t*>(out_.data_ptr()) + begin, acc_.data_ptr<float>() + begin, count,
                         static_cast<float>(scale_));
    } else if (dtype_ == at::kFloat) {
      float* acc = acc_.data_ptr<float>() + begin;
      if (scale_ != 1.0) kernels::ScaleF32(acc, count, static_cast<float>(scale_));
      if (!acc_.is_same(out_)) std::memcpy(out_.data_ptr<float>() + begin, acc, count * sizeof(float));
    } else {
      Serially(count, [&](int64_t i, int64_t len) {
        at::Tensor a = acc_.narrow(0, begin + i, len);
        if (scale_ != 1.0) a.mul_(scale_);
        if (!acc_.is_same(out_)) out_.narrow(0, begin + i, len).copy_(a);
      });
    }
    Divide(begin, count);
    finished_ += count;
  }

  // out[b, b+k) /= divide, in the output dtype (as the TCP paths' div_).
  void Divide(int64_t begin, int64_t k) {
    if (divide_ == 1.0) return;
    Serially(k, [&](int64_t i, int64_t len) { out_.narrow(0, begin + i, len).div_(divide_); });
  }

  const int world_, rank_;
  const int64_t n_;
  const at::ScalarType dtype_;
  const int64_t es_;
  at::Tensor mine_, out_, acc_, zero_;
  const double scale_, divide_;
  const bool from_zero_;
  bool pair_ = false;          // W=2 with a kernel dtype: one pass per piece, no accumulator
  std::vector<int64_t> done_;  // elements each source has added
  int64_t finished_ = 0;
};

void MeshAllGather(SharedMemoryMesh& mesh, const at::Tensor& input, const at::Tensor& output,
                   SteadyClock::time_point deadline) {
  const int world = mesh.size(), rank = mesh.rank();
  at::Tensor in = input.reshape(-1);
  const at::Tensor out = output.reshape(-1);
  const int64_t bytes = in.numel() * in.element_size();
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  const bool in_place = in.data_ptr() == base + rank * bytes;
  if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
  if (!in_place) std::memcpy(base + rank * bytes, in.data_ptr(), bytes);
  std::vector<SharedMemoryMesh::PeerTraffic> traffic(world);
  std::vector<int64_t> starts(world);
  for (int p = 0; p < world; ++p) {
    traffic[p] = {{{base + rank * bytes, bytes}}, bytes};
    starts[p] = p * bytes;
  }
  mesh.Exchange(traffic, CopyInto(base, std::move(starts)), deadline);
}

void MeshReduceScatter(SharedMemoryMesh& mesh, const at::Tensor& input, const at::Tensor& output, double scale,
                       SteadyClock::time_point deadline) {
  const int world = mesh.size(), rank = mesh.rank();
  at::Tensor in = input.reshape(-1);
  const at::Tensor out = output.reshape(-1);
  const int64_t n = out.numel();
  // In place (`output` is this rank's block of `input`), OrderedSum sums into
  // scratch; any other overlap sends from a copy.
  const bool in_place = out.data_ptr() == in.narrow(0, rank * n, n).data_ptr();
  if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
  OrderedSum sum(world, rank, in.narrow(0, rank * n, n), out, scale, 1.0, /*from_zero=*/true);
  std::vector<SharedMemoryMesh::PeerTraffic> traffic(world);
  const int64_t bytes = n * in.element_size();
  for (int p = 0; p < world; ++p) traffic[p] = {{{in.narrow(0, p * n, n).data_ptr(), bytes}}, bytes};
  mesh.Exchange(traffic, sum.AsConsumer(), deadline);
  sum.Finish();
}

// Reduce-scatter of the W blocks (each rank sums its own block, in rank
// order), then all-gather of the sums: every rank ends with the same bits.
void MeshAllReduce(SharedMemoryMesh& mesh, const at::Tensor& tensor, double divide, SteadyClock::time_point deadline) {
  const int world = mesh.size(), rank = mesh.rank();
  const at::Tensor t = tensor.reshape(-1);
  const int64_t n = t.numel(), es = t.element_size();
  auto block = [&](int b) {
    return t.narrow(0, BlockBegin(n, world, b), BlockBegin(n, world, b + 1) - BlockBegin(n, world, b));
  };
  const at::Tensor mine = block(rank);
  std::vector<SharedMemoryMesh::PeerTraffic> traffic(world);
  {
    OrderedSum sum(world, rank, mine, mine, 1.0, divide, /*from_zero=*/false);
    for (int p = 0; p < world; ++p) traffic[p] = {{{block(p).data_ptr(), block(p).numel() * es}}, mine.numel() * es};
    mesh.Exchange(traffic, sum.AsConsumer(), deadline);
    sum.Finish();
  }
  std::vector<int64_t> starts(world);
  for (int p = 0; p < world; ++p) {
    traffic[p] = {{{mine.data_ptr(), mine.numel() * es}}, block(p).numel() * es};
    starts[p] = BlockBegin(n, world, p) * es;
  }
  mesh.Exchange(traffic, CopyInto(static_cast<uint8_t*>(t.data_ptr()), std::move(starts)), deadline);
}

}  // namespace
// ---------------------------------------------------------------------------

WorkPtr GlooCommunicator::AllGather(const at::Tensor& input, const at::Tensor& output) {
  CheckCpu("AllGather", input);
  CheckCpu("AllGather", output);
  CheckGatherScatter("AllGather", input, output);
  const IssuedCall call = Issue(CommOp::kAllGather);
  Count(CommOp::kAllGather, (size_ - 1) * input.numel() * input.element_size());
  if (size_ == 1) {
    output.copy_(input);
    return CompletedWork();
  }
  return Submit(CommOp::kAllGather, input, 0, call,
                [this, input, output, call] { return StartAllGather(input, output, call); });
}

WorkPtr GlooCommunicator::StartAllGather(const at::Tensor& input, const at::Tensor& output, IssuedCall call) {
  if (mesh_) {
    return RunOnMesh(CommOp::kAllGather, call,
                     [&](SteadyClock::time_point deadline) { MeshAllGather(*mesh_, input, output, deadline); });
  }
  if (size_ == 2 && input.numel() > 0) {  // W=2 fast path (see above); taken on both ranks alike
    at::Tensor in = input.reshape(-1);
    const at::Tensor out = output.reshape(-1);
    const int64_t n = in.numel();
    const at::Tensor mine = out.narrow(0, rank_ * n, n), theirs = out.narrow(0, (1 - rank_) * n, n);
    // In place (`input` is this rank's block of `output`) needs no copy; any
    // other overlap sends from a copy.
    const bool in_place = in.data_ptr() == mine.data_ptr();
    if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
    auto work = ExchangeWithPeer(*pg_, rank_, in, theirs, timeout_);
    if (!in_place) std::memcpy(mine.data_ptr(), in.data_ptr(), n * in.element_size());  // overlaps the exchange
    return Wrap(std::move(work), CommOp::kAllGather, call);
  }
  at::Tensor in = input, out = output;
  return Wrap(pg_->_allgather_base(out, in), CommOp::kAllGather, call);
}

WorkPtr GlooCommunicator::ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                                        const ReduceOptions& options) {
  CheckCpu("ReduceScatter", input);
  CheckCpu("ReduceScatter", output);
  CheckGatherScatter("ReduceScatter", output, input);
  ST_CHECK_ARG(options.op == ReduceOp::kSum || options.op == ReduceOp::kAvg, "ReduceScatter on group '", name_,
               "': unsupported op ", ReduceOpName(options.op), "; valid: SUM, AVG");
  ST_CHECK_ARG(options.pre_divide > 0 && options.post_divide > 0, "ReduceScatter: divide factors must be > 0");
  const IssuedCall call = Issue(CommOp::kReduceScatter);
  Count(CommOp::kReduceScatter, (size_ - 1) * output.numel() * output.element_size());
  const double scale =
      1.0 / (options.pre_divide * options.post_divide * (options.op == ReduceOp::kAvg ? size_ : 1));
  if (size_ == 1) {  // the general path's arithmetic (a sum over one block, from +0)
    const at::Tensor blocks = input.reshape({1, -1});
    at::Tensor sum = Is16Bit(output.scalar_type()) ? blocks.sum(0, false, at::kFloat) : blocks.sum(0);
    if (scale != 1.0) sum.mul_(scale);
    output.copy_(sum.view_as(output));
    return CompletedWork();
  }
  return Submit(CommOp::kReduceScatter, output, static_cast<int64_t>(options.op), call,
                [this, input, output, scale, call] { return StartReduceScatter(input, output, scale, call); });
}

WorkPtr GlooCommunicator::StartReduceScatter(const at::Tensor& input, const at::Tensor& output, double scale,
                                             IssuedCall call) {
  const int64_t n = output.numel();
  const int world = size_;
  if (mesh_ && IsFloating(output.scalar_type())) {
    return RunOnMesh(CommOp::kReduceScatter, call, [&](SteadyClock::time_point deadline) {
      MeshReduceScatter(*mesh_, input, output, scale, deadline);
    });
  }
  if (size_ == 2 && n > 0 && IsFloating(output.scalar_type())) {  // W=2 fast path (see above); both ranks alike
    // Send the peer's block of `input`, receive the peer's contribution to ours
    // (straight into `output` unless it aliases `input`), then add ours. Same
    // arithmetic as the general path, bit for bit (checked by comm_bench's
    // self-check): the sum of the two blocks, then the scale, in the dtype for
    // float32/float64; in float32 with one rounding at the end for 16-bit
    // types; the trailing add of +0 turns -0 into +0 and changes nothing else,
    // as the general path's sum (which starts from +0) does.
    at::Tensor in = input.reshape(-1);
    const at::Tensor out = output.reshape(-1);
    at::Tensor recv = out;
    if (at::get_overlap_status(in, out) != at::MemOverlapStatus::No) {
      if (out.data_ptr() == in.narrow(0, rank_ * n, n).data_ptr()) {
        recv = at::empty_like(out);  // in place: `output` is this rank's block of `input`
      } else {
        in = in.clone();
      }
    }
    const at::Tensor mine = in.narrow(0, rank_ * n, n), to_peer = in.narrow(0, (1 - rank_) * n, n);
    const bool low = Is16Bit(out.scalar_type());
    // +0 as a 0-dim tensor: adding it is markedly faster than adding the Scalar 0.0.
    const at::Tensor zero = at::zeros({}, out.options().dtype(low && scale != 1.0 ? at::kFloat : out.scalar_type()));
    auto reduce = [out, recv, mine, scale, low, zero](int64_t begin, int64_t count) {
      Serially(count, [&](int64_t i, int64_t len) {
        at::Tensor o = out.narrow(0, begin + i, len), got = recv.narrow(0, begin + i, len);
        const at::Tensor m = mine.narrow(0, begin + i, len);
        if (!low || scale == 1.0) {
          at::add_out(o, got, m).add_(zero);
          if (scale != 1.0) o.mul_(scale);
        } else {
          at::Tensor acc = got.to(at::kFloat);
          acc.add_(m).add_(zero);
          acc.mul_(scale);
          o.copy_(acc);
        }
      });
    };
    return Wrap(PipelinedExchange(*pg_, rank_, to_peer, recv, timeout_, std::move(reduce)), CommOp::kReduceScatter,
                call);
  }
  // Every rank sends block j of its input to rank j, then sums what it got.
  at::Tensor recv = at::empty_like(input);
  auto finish = [recv, output, n, world, scale]() mutable {
    at::Tensor blocks = recv.view({world, n});
    at::Tensor sum = Is16Bit(output.scalar_type()) ? blocks.sum(0, false, at::kFloat) : blocks.sum(0);
    if (scale != 1.0) sum.mul_(scale);
    output.copy_(sum);
  };
  at::Tensor in = input;
  std::vector<int64_t> counts;  // empty: equal splits
  return Wrap(pg_->alltoall_base(recv, in, counts, counts), CommOp::kReduceScatter, call, std::move(finish));
}

WorkPtr GlooCommunicator::AllReduce(const at::Tensor& tensor, const ReduceOptions& options) {
  CheckCpu("AllReduce", tensor);
  ST_CHECK_ARG(options.pre_divide > 0 && options.post_divide > 0, "AllReduce: divide factors must be > 0");
  const IssuedCall call = Issue(CommOp::kAllReduce);
  Count(CommOp::kAllReduce, size_ == 1 ? 0 : 2 * (size_ - 1) * tensor.numel() * tensor.element_size() / size_);
  const bool is_sum = options.op == ReduceOp::kSum || options.op == ReduceOp::kAvg;
  if (is_sum && options.pre_divide != 1.0) tensor.div_(options.pre_divide);
  const double post = is_sum ? options.post_divide * (options.op == ReduceOp::kAvg ? size_ : 1) : 1.0;
  auto finish = [tensor, post]() {
    if (post != 1.0) tensor.div_(post);
  };
  if (size_ == 1) {
    finish();
    return CompletedWork();
  }
  return Submit(CommOp::kAllReduce, tensor, static_cast<int64_t>(options.op), call,
                [this, tensor, op = options.op, post, call] { return StartAllReduce(tensor, op, post, call); });
}

WorkPtr GlooCommunicator::StartAllReduce(const at::Tensor& tensor, ReduceOp op, double post, IssuedCall call) {
  const bool is_sum = op == ReduceOp::kSum || op == ReduceOp::kAvg;
  auto finish = [tensor, post]() {
    if (post != 1.0) tensor.div_(post);
  };
  if (mesh_ && is_sum && IsFloating(tensor.scalar_type())) {
    return RunOnMesh(CommOp::kAllReduce, call,
                     [&](SteadyClock::time_point deadline) { MeshAllReduce(*mesh_, tensor, post, deadline); });
  }
  const int64_t bytes = tensor.numel() * tensor.element_size();
  if (size_ == 2 && is_sum && bytes > 0 && bytes <= kDirectAllReduceMaxBytes && IsFloating(tensor.scalar_type())) {
    // W=2 fast path for small tensors (see above and kDirectAllReduceMaxBytes);
    // both ranks alike. Each rank sends its whole tensor (= 2(W-1)/W of it, as
    // counted) and receives the peer's into a separate buffer (the tensor is
    // still being sent from), then Wait() adds piece by piece into the tensor
    // and divides by `post`. Same arithmetic as
    // Gloo's sum, bit for bit (comm_bench's self-check): one add per element,
    // in the dtype (for 16-bit types in float32, rounded once), then the same
    // div_(post); both ranks add rank 0's value to rank 1's, so even NaN
    // payloads agree across ranks.
    const at::Tensor t = tensor.reshape(-1);
    const at::Tensor recv = at::empty_like(t);
    const at::Tensor first = rank_ == 0 ? t : recv, second = rank_ == 0 ? recv : t;
    auto combine = [t, first, second, post](int64_t begin, int64_t count) {
      Serially(count, [&](int64_t i, int64_t len) {
        at::Tensor o = t.narrow(0, begin + i, len);
        at::add_out(o, first.narrow(0, begin + i, len), second.narrow(0, begin + i, len));
        if (post != 1.0) o.div_(post);
      });
    };
    return Wrap(PipelinedExchange(*pg_, rank_, t, recv, timeout_, std::move(combine)), CommOp::kAllReduce, call);
  }
  c10d::AllreduceOptions o;
  o.reduceOp = op == ReduceOp::kMax   ? c10d::ReduceOp(c10d::ReduceOp::MAX)
               : op == ReduceOp::kMin ? c10d::ReduceOp(c10d::ReduceOp::MIN)
                                              : c10d::ReduceOp(c10d::ReduceOp::SUM);
  o.timeout = timeout_;
  std::vector<at::Tensor> tensors{tensor};
  return Wrap(pg_->allreduce(tensors, o), CommOp::kAllReduce, call, std::move(finish));
}

WorkPtr GlooCommunicator::Broadcast(const at::Tensor& tensor, int root) {
  CheckCpu("Broadcast", tensor);
  ST_CHECK_ARG(root >= 0 && root < size_, "Broadcast on group '", name_, "': root must be in [0, ", size_, "), got ",
               root);
  const IssuedCall call = Issue(CommOp::kBroadcast);
  Count(CommOp::kBroadcast, rank_ == root ? (size_ - 1) * tensor.numel() * tensor.element_size() : 0);
  if (size_ == 1) return CompletedWork();
  return Submit(CommOp::kBroadcast, tensor, root, call, [this, tensor, root, call] {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    std::vector<at::Tensor> tensors{tensor};
    return Wrap(pg_->broadcast(tensors, o), CommOp::kBroadcast, call);
  });
}

WorkPtr GlooCommunicator::Barrier() {
  const IssuedCall call = Issue(CommOp::kBarrier);
  Count(CommOp::kBarrier, 0);
  if (size_ == 1) return CompletedWork();
  return Submit(CommOp::kBarrier, at::Tensor(), 0, call, [this, call] {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    return Wrap(pg_->barrier(o), CommOp::kBarrier, call);
  });
}

CommunicatorPtr GlooCommunicator::NewGroup(const std::vector<int>& ranks, const std::string& name) {
  int id = 0;
  const int index = PrepareNewGroup(ranks, name, &id);
  if (index < 0) return nullptr;
  GlooOptions o = options_;
  o.name = name_ + "/" + name;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("group" + std::to_string(id) + "/" + name, store_);
  return Create(prefixed, index, static_cast<int>(ranks.size()), o);
}

}  // namespace shardtrain::comm
