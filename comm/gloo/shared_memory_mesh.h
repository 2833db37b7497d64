// SharedMemoryMesh: byte streams between the ranks of a group that all run on
// one host, through ring buffers in POSIX shared memory, instead of loopback
// TCP. GlooCommunicator moves its same-host all-gathers, reduce-scatters and
// sum all-reduces (and the per-call signature check) through it.
//
// Each rank owns one segment holding a single-producer/single-consumer ring per
// peer (this rank writes, the peer reads), plus a doorbell word: whoever writes
// to a rank's incoming ring or frees space in a ring it writes to bumps that
// rank's doorbell, and a rank with nothing to do sleeps on its own doorbell
// (futex). Segments are unlinked as soon as every rank has mapped them, so
// nothing is left in /dev/shm when a process dies.
//
// Faults: a waiting rank notices a peer that closed its mesh (destructor) at
// once, and a peer process that died (pid check, every 50 ms of waiting). That
// is a failure only if the peer left owing this rank bytes (not all it sends
// is in the ring, or it did not read what this rank sends): a peer that
// finished its part and left is not, even while its bytes wait in the ring for
// this rank's consumer. Failures and the deadline end Exchange() with
// SharedMemoryError naming the peer.
//
// Thread-safety: one thread calls Exchange() at a time (GlooCommunicator's
// issuing thread). Plain C++: no torch headers.
#ifndef SHARDTRAIN_COMM_GLOO_SHARED_MEMORY_MESH_H_
#define SHARDTRAIN_COMM_GLOO_SHARED_MEMORY_MESH_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardtrain::comm {

// Why an Exchange() failed. `peer` is the rank at fault (-1: none known).
class SharedMemoryError : public std::runtime_error {
 public:
  enum class Kind { kTimeout, kPeerClosed, kPeerDied };
  SharedMemoryError(Kind kind, int peer, const std::string& what)
      : std::runtime_error(what), kind_(kind), peer_(peer) {}
  Kind kind() const { return kind_; }
  int peer() const { return peer_; }

 private:
  Kind kind_;
  int peer_;
};

// The key-value store the ranks meet through (the communicator's store).
struct MeshRendezvous {
  std::function<void(const std::string& key, const std::string& value)> set;
  // Blocks until `key` exists (throws after the store's timeout).
  std::function<std::string(const std::string& key)> get;
  // Adds `delta` to the counter at `key` (0 if absent) and returns the sum.
  std::function<int64_t(const std::string& key, int64_t delta)> add;
};

class SharedMemoryMesh {
 public:
  // Collective over the `size` ranks (each calls it, `wanted` or not).
  // Returns null, with the reason in `why_not`, on every rank when any rank
  // does not want it, the ranks are not all on this host (same
  // local_host::Id()) or ask for different ring sizes, or any rank could not
  // create or map its segment. `ring_bytes` (a multiple of 4096) is the
  // capacity of each ring.
  static std::unique_ptr<SharedMemoryMesh> Connect(const MeshRendezvous& store, int rank, int size, bool wanted,
                                                   int64_t ring_bytes, std::string* why_not);
  // Abort(), then unmaps.
  ~SharedMemoryMesh();

  // Marks this rank closed: peers waiting on it fail at once, and so does this
  // rank's Exchange() in progress, if any. Safe from any thread.
  void Abort();

  SharedMemoryMesh(const SharedMemoryMesh&) = delete;
  SharedMemoryMesh& operator=(const SharedMemoryMesh&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // This rank's progress, kept in its segment so that a waiting peer reads it
  // exactly even when this process is stopped (SIGSTOP), hung or dead, where
  // its heartbeat in the store may be up to a heartbeat period old. One
  // atomic store: called at every collective issued (`op`: 0..254).
  void NoteProgress(int64_t issued, int op);
  struct Progress {
    int64_t issued = 0;  // collectives `peer` had issued
    int op = -1;         // the latest one's `op` as given to NoteProgress
  };
  // `peer`'s latest NoteProgress (nullopt: none yet, or not mapped). Any thread.
  std::optional<Progress> PeerProgress(int peer) const;
  int64_t ring_bytes() const { return ring_bytes_; }

  // What this rank sends to one peer (the pieces in order, one stream) and how
  // many bytes it receives from it. Pointers must stay valid during Exchange().
  struct PeerTraffic {
    std::vector<std::pair<const void*, int64_t>> send;
    int64_t recv_bytes = 0;
  };
  // Received bytes of `peer`'s stream starting at `offset`: returns how many
  // of the `len` bytes at `data` it used (0..len; the rest is offered again,
  // after more arrived or after other peers' bytes were consumed). Peers are
  // offered their bytes in rank order on every pass.
  using Consumer = std::function<int64_t(int peer, int64_t offset, const uint8_t* data, int64_t len)>;

  // Sends and receives traffic[p] with every peer p != rank() at once, until
  // all is sent and received. Throws SharedMemoryError at `deadline`, or when a
  // peer closed its mesh or died owing this rank bytes (see Faults above).
  void Exchange(const std::vector<PeerTraffic>& traffic, const Consumer& consume,
                std::chrono::steady_clock::time_point deadline);

 private:
  struct Segment;
  SharedMemoryMesh(int rank, int size, int64_t ring_bytes);
  void Ring(int peer);  // bumps `peer`'s doorbell, waking it if it sleeps
  // What this rank still has to receive from one peer (`recv`: padding
  // included; `recv_payload` of the `recv_total` bytes it wants) and to send
  // it (`send`, padding included) in the Exchange() in progress.
  struct Outstanding {
    int64_t recv = 0;
    int64_t recv_payload = 0;
    int64_t recv_total = 0;
    int64_t send = 0;
  };
  // This rank aborted, or a peer left (closed, or died: pid check only with
  // `check_pids`) while this rank still needs bytes from it that are not in
  // the ring or has bytes for it that the ring cannot take.
  std::optional<SharedMemoryError> CheckPeers(const std::vector<Outstanding>& owed, bool check_pids);

  // Connect()'s steps: this rank's segment, created and mapped, and the
  // peers' segments, mapped and checked; each returns "ok" or what failed.
  std::string CreateSegment(uint64_t token);
  std::string MapPeerSegments(uint64_t token);
  // Exchange()'s steps. Stream: what is sent to and received from one peer
  // so far. SendTo and ReceiveFrom move what the rings allow now and return
  // whether anything moved; SleepOnDoorbell throws the timeout at `deadline`,
  // else sleeps until the doorbell changes from `bell` (or a slice passes).
  struct Stream;
  bool SendTo(int peer, const std::vector<std::pair<const void*, int64_t>>& pieces, Stream& stream, int64_t chunk);
  bool ReceiveFrom(int peer, const Consumer& consume, Stream& stream, int64_t chunk);
  void SleepOnDoorbell(uint32_t bell, std::chrono::steady_clock::time_point now,
                       std::chrono::steady_clock::time_point deadline, const std::vector<bool>& pending);

  const int rank_;
  const int size_;
  const int64_t ring_bytes_;
  size_t segment_bytes_ = 0;
  std::vector<void*> maps_;  // maps_[r]: rank r's segment as mapped here
  std::vector<int64_t> pids_;
  std::string name_;  // this rank's segment name (until unlinked)
  std::atomic<bool> aborted_{false};
};

namespace local_host {
// Identifies this host: its host name, the kernel's boot id and the network,
// pid and IPC namespaces of this process. Processes with the same id run on one
// machine in one network (not in two namespace hosts or containers of it), can
// check each other's pid and share POSIX shared memory.
std::string Id();
// True when process `pid` of this host no longer runs (or is a zombie).
bool ProcessGone(int64_t pid);
}  // namespace local_host

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_GLOO_SHARED_MEMORY_MESH_H_
