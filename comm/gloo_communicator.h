// GlooCommunicator: collectives on CPU tensors over Gloo (LibTorch's c10d
// ProcessGroupGloo), for float32, float64, float16 and bfloat16 (and integers).
//
// Algorithms are chosen so every rank sends about (W-1)/W of the full buffer
// for all-gather and reduce-scatter: all-gather is Gloo's ring all-gather;
// reduce-scatter is an all-to-all of the W blocks followed by a local sum (in
// float32 for 16-bit inputs), never W all-reduces. At W=2, all-gather,
// reduce-scatter and small (<= 2 MiB) floating SUM/AVG all-reduces are direct
// exchanges with the peer (see comm/gloo/internal/pair_exchange.h); larger all-reduces are
// Gloo's ring.
//
// When every rank of a group runs on this host (and GlooOptions::shared_memory
// is on), all-gathers, reduce-scatters, floating SUM/AVG all-reduces and the
// per-call signature check move through ring buffers in shared memory
// (comm/gloo/shared_memory_mesh.h) instead of loopback TCP; other collectives, and
// groups that span hosts, use Gloo.
//
// Every rank publishes a heartbeat to the rendezvous store (see
// GlooOptions::heartbeat_period), so that a failed or timed-out collective
// names the peer that caused it: dead, hung, or behind in the sequence of
// collectives.
//
// The implementation is in comm/gloo/, one file per part (private headers in
// comm/gloo/internal/).
#ifndef SHARDTRAIN_COMM_GLOO_COMMUNICATOR_H_
#define SHARDTRAIN_COMM_GLOO_COMMUNICATOR_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace c10d {
class Backend;
class Work;
}

namespace shardtrain::comm {

// Gloo's options; timeout, stall_warning and stall_timeout come from CommLimits
// (comm/communicator.h). Destroying a communicator that failed by
// stall_timeout leaves Gloo's threads still waiting on the peer to the
// process's exit instead of joining them (which would block until `timeout`).
struct GlooOptions : CommLimits {
  std::string name = "world";
  // Address or hostname this rank listens on; empty = $GLOO_SOCKET_IFNAME's
  // interface if set, else the address the rendezvous gives: for a TCPStore
  // the local address that reaches its host (loopback for a single-host run,
  // like the store's own bind address), loopback for a HashStore, and the
  // machine's hostname for a FileStore.
  std::string hostname;
  int threads = 2;  // Gloo worker threads (ops in flight at once)
  // Before each collective, ranks exchange (operation, element count, dtype,
  // root) and all throw InvalidArgumentError if they disagree. Without it a
  // mismatched call aborts the process inside Gloo's transport thread. Costs
  // one small all-to-all (32 bytes to each rank) per collective: one round
  // trip, ~0.2 ms over loopback TCP, ~0.02 ms through shared memory
  // (bench/comm's tiny_all_reduce, on vs off).
  bool verify_calls = true;
  // How often a background thread publishes this rank's heartbeat (time, number
  // of collectives issued, the latest one) to the rendezvous store. When a
  // collective fails or times out, the failing rank reads its peers' heartbeats
  // and names the dead, hung or lagging rank in the error. Zero turns it off
  // (errors then name only the operation and the group).
  std::chrono::milliseconds heartbeat_period = std::chrono::seconds(1);
  // When all ranks of the group run on this host: move all-gathers,
  // reduce-scatters, floating SUM/AVG all-reduces and the signature check
  // through shared memory (a ring buffer of `shared_memory_ring_bytes` per pair
  // of ranks, in /dev/shm) rather than through loopback TCP. Falls back to
  // Gloo, with a log line saying why, when the ranks span hosts or /dev/shm
  // cannot hold the rings. The environment variable SHARDTRAIN_GLOO_SHM=0
  // turns it off without a rebuild.
  bool shared_memory = true;
  int64_t shared_memory_ring_bytes = int64_t{2} << 20;
};

class SharedMemoryMesh;  // comm/gloo/shared_memory_mesh.h
class GlooPeerMonitor;  // heartbeats and failure diagnosis (comm/gloo/internal/peer_monitor.h)
class GlooCallIssuer;   // starts collectives off the caller's thread (comm/gloo/internal/call_issuer.h)
class PeerWatch;        // stalled-peer reports while blocked (comm/peer_watch.h)
struct GlooGroupRef;    // what a pending Work needs to know about its group (comm/gloo/internal/common.h)

// A collective as this rank issued it: its number (1, 2, ...) and the wall
// time (ms since the epoch), to tell in errors whether a peer's heartbeat
// came after it.
struct IssuedCall {
  int64_t seq = 0;
  int64_t wall_ms = 0;
};

class GlooCommunicator : public Communicator {
 public:
  // Connects `size` ranks through `store`. Blocks until every rank joined or
  // the timeout passed (CommError then).
  static std::shared_ptr<GlooCommunicator> Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                  GlooOptions options = {});
  // Publishes a last "closed" heartbeat, stops the heartbeat thread, then
  // closes the connections (peers' pending collectives fail).
  ~GlooCommunicator() override;

  std::string backend() const override { return "gloo"; }
  WorkPtr AllGather(const at::Tensor& input, const at::Tensor& output) override;
  WorkPtr ReduceScatter(const at::Tensor& input, const at::Tensor& output, const ReduceOptions& options = {}) override;
  // Through shared memory the pieces are sent and summed where they lie;
  // otherwise concatenated first (Communicator's default).
  WorkPtr ReduceScatterPieces(const std::vector<at::Tensor>& pieces, const at::Tensor& output,
                              const ReduceOptions& options = {}) override;
  bool ReadsPiecesInPlace() const override { return mesh_ != nullptr; }
  WorkPtr AllReduce(const at::Tensor& tensor, const ReduceOptions& options = {}) override;
  WorkPtr Broadcast(const at::Tensor& tensor, int root) override;
  WorkPtr Barrier() override;
  CommunicatorPtr NewGroup(const std::vector<int>& ranks, const std::string& name) override;

  // True when this group moves its bytes through shared memory (see GlooOptions::shared_memory).
  bool uses_shared_memory() const { return mesh_ != nullptr; }

 private:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GlooOptions options);
  void CheckCpu(const char* op, const at::Tensor& t) const;
  // Sets up mesh_ when shared memory is wanted and every rank is on this host.
  void ConnectSharedMemory();
  // Numbers the collective this rank now issues (for heartbeats and errors).
  IssuedCall Issue(CommOp op);
  // Exchanges the call's signature with all ranks (see GlooOptions::verify_calls).
  // Runs only on the issuing thread.
  void VerifySameCall(CommOp op, const at::Tensor& t, int64_t root, IssuedCall call);
  // Starts a collective: runs `start`, which launches it and returns its
  // Work. With verify_calls or shared memory (and W > 1) the signature check
  // (VerifySameCall, if verify_calls) and `start` run on the issuing thread, in
  // call order, and the caller gets a Work at once; otherwise `start` runs here.
  WorkPtr Submit(CommOp op, const at::Tensor& t, int64_t root, IssuedCall call, std::function<WorkPtr()> start);
  // The collectives' starts (after the signature check), for Submit.
  WorkPtr StartAllGather(const at::Tensor& input, const at::Tensor& output, IssuedCall call);
  WorkPtr StartReduceScatter(const at::Tensor& input, const at::Tensor& output, double scale, IssuedCall call);
  // Checks a reduce-scatter's options and returns the factor the sum is scaled by.
  double ReduceScatterScale(const ReduceOptions& options) const;
  WorkPtr StartAllReduce(const at::Tensor& tensor, ReduceOp op, double post, IssuedCall call);
  // Runs `transfer` (a collective through mesh_, on the issuing thread) with
  // the communicator's timeout; turns its failure into CommError naming the peer.
  WorkPtr RunOnMesh(CommOp op, IssuedCall call,
                    const std::function<void(std::chrono::steady_clock::time_point deadline)>& transfer);
  // Wraps a c10d work of collective `call` into the Work returned to the caller.
  WorkPtr Wrap(c10::intrusive_ptr<c10d::Work> work, CommOp op, IssuedCall call,
               std::function<void()> finish = nullptr);

  c10::intrusive_ptr<c10d::Store> store_;
  GlooOptions options_;
  c10::intrusive_ptr<c10d::Backend> pg_;
  c10::intrusive_ptr<c10d::Backend> verify_pg_;  // signature exchanges only (verify_calls)
  std::shared_ptr<GlooPeerMonitor> monitor_;  // null at W=1 or with heartbeat_period 0
  std::shared_ptr<const GlooGroupRef> group_;
  std::atomic<int64_t> issued_{0};  // collectives issued so far
  // VerifySameCall's signature buffers, reused by every call (only the
  // issuing thread touches them).
  at::Tensor signature_, signatures_;
  std::unique_ptr<SharedMemoryMesh> mesh_;   // null unless shared memory is in use
  std::unique_ptr<GlooCallIssuer> issuer_;  // with verify_calls or mesh_ at W>1; destroyed first
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_GLOO_COMMUNICATOR_H_
