#include "comm/gloo/shared_memory_mesh.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

namespace shardtrain::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x53545348'4d455348ULL;  // "STSHMESH"
constexpr size_t kHeaderBytes = 4096;                // SegmentHeader, padded to a page
constexpr size_t kRingHeaderBytes = 4096;            // RingHeader, padded to a page
// A ring is filled and drained in chunks of at most 128 KiB (and a quarter of
// the ring), so the reader starts on the first chunk while the writer fills
// the next, and a chunk just written is still in the cache when it is read.
constexpr int64_t kMaxChunk = 128 << 10;
constexpr int64_t kChunkDivisor = 4;
// Streams are padded to this many bytes per Exchange(), so every element of
// every dtype stays aligned in the ring (and never straddles its end).
constexpr int64_t kStreamAlign = 8;
constexpr auto kSpin = std::chrono::microseconds(30);    // busy-wait before sleeping
constexpr auto kSleepSlice = std::chrono::milliseconds(20);
constexpr auto kPidCheckPeriod = std::chrono::milliseconds(50);

struct SegmentHeader {
  uint64_t magic;
  uint64_t token;
  int64_t pid;
  int32_t rank;
  int32_t size;
  int64_t ring_bytes;
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped by anyone who has news for this rank
  std::atomic<uint32_t> sleepers;              // > 0 while this rank sleeps on the doorbell
  alignas(64) std::atomic<uint32_t> closed;    // this rank has left the mesh
  // (collectives issued << 8) | (latest op + 1), written at each issue; 0: none yet.
  alignas(64) std::atomic<uint64_t> progress;
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

// One single-producer/single-consumer byte ring; `ring_bytes` of data follow
// its (page-sized) header.
struct RingHeader {
  alignas(64) std::atomic<uint64_t> head;  // bytes written so far (the writer's)
  alignas(64) std::atomic<uint64_t> tail;  // bytes read so far (the reader's)
};
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string SegmentName(uint64_t token, int rank) {
  std::ostringstream os;
  os << "/shardtrain-" << std::hex << token << std::dec << "-" << rank;
  return os.str();
}

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

namespace local_host {

std::string Id() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown");
  std::string id = host;
  // The kernel's boot id tells machines apart where host names collide (cloned
  // images, "localhost") and namespace inode numbers do (the initial
  // namespaces have the same numbers on every machine). The network namespace
  // tells apart hosts that share one kernel but not a network (namespace hosts,
  // containers): ranks there talk over TCP as on separate machines.
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (!boot || !std::getline(boot, boot_id) || boot_id.empty()) boot_id = "?";
  id += "/boot:" + boot_id;
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/pid", "/proc/self/ns/ipc"}) {
    char link[128] = {0};
    const ssize_t len = readlink(ns, link, sizeof(link) - 1);
    id += "/" + (len > 0 ? std::string(link, len) : std::string("?"));
  }
  for (char& c : id)
    if (c == ' ') c = '_';
  return id;
}

bool ProcessGone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

}  // namespace local_host

struct SharedMemoryMesh::Segment {
  static SegmentHeader* Header(void* base) { return static_cast<SegmentHeader*>(base); }
  // The ring `owner` writes and `reader` reads, inside the owner's segment.
  static RingHeader* Ring(void* base, int owner, int reader, int64_t ring_bytes) {
    const int slot = reader < owner ? reader : reader - 1;
    return reinterpret_cast<RingHeader*>(static_cast<char*>(base) + kHeaderBytes +
                                         slot * (kRingHeaderBytes + static_cast<size_t>(ring_bytes)));
  }
  static uint8_t* Data(RingHeader* ring) { return reinterpret_cast<uint8_t*>(ring) + kRingHeaderBytes; }
};

SharedMemoryMesh::SharedMemoryMesh(int rank, int size, int64_t ring_bytes)
    : rank_(rank), size_(size), ring_bytes_(ring_bytes), maps_(size, nullptr), pids_(size, 0) {
  segment_bytes_ = kHeaderBytes + static_cast<size_t>(size - 1) * (kRingHeaderBytes + ring_bytes);
}

namespace {

// One agreement round of Connect(): publishes this rank's `mine` under `what`
// and reads every rank's; true when `good` holds for all of them, else the
// first that fails is in `first_bad` ("rank R: value").
bool AllRanksAgree(const MeshRendezvous& store, const std::string& prefix, const std::string& what, int rank,
                   int size, const std::string& mine, std::string* first_bad,
                   const std::function<bool(const std::string&)>& good) {
  store.set(prefix + what + "/" + std::to_string(rank), mine);
  bool all = true;
  for (int r = 0; r < size; ++r) {
    const std::string v = r == rank ? mine : store.get(prefix + what + "/" + std::to_string(r));
    if (!good(v) && all) {
      all = false;
      *first_bad = "rank " + std::to_string(r) + ": " + v;
    }
  }
  return all;
}

bool IsOk(const std::string& v) { return v == "ok"; }

}  // namespace

// The ranks walk three agreement rounds in the same order: wanted by all and
// all on this host; every segment created; every peer's segment mapped.
std::unique_ptr<SharedMemoryMesh> SharedMemoryMesh::Connect(const MeshRendezvous& store, int rank, int size,
                                                            bool wanted, int64_t ring_bytes, std::string* why_not) {
  if (size < 2) {
    *why_not = "a group of one rank has no peers";
    return nullptr;
  }
  if (ring_bytes <= 0 || ring_bytes % 4096 != 0) wanted = false;
  // Every key carries the number of meshes this rank has connected through
  // this store so far, which is the same on every rank (they create their
  // communicators in the same order): a second mesh never reads the first's keys.
  const int64_t connects = store.add("shardtrain/shm/connects/" + std::to_string(rank), 1);
  const std::string prefix = "shardtrain/shm/" + std::to_string(connects) + "/";
  std::string bad;
  // 1. Wanted by every rank, with the same ring size, and all on this host?
  const std::string host = local_host::Id(), mine = wanted ? host + " ring " + std::to_string(ring_bytes) : "off";
  if (!AllRanksAgree(store, prefix, "host", rank, size, mine, &bad,
                     [&](const std::string& v) { return wanted && v == mine; })) {
    *why_not = !wanted ? "shared memory is off on this rank"
                       : "not every rank runs on this host with the same ring size (this rank: " + mine + "; " + bad +
                             "; off: shared memory is off there)";
    return nullptr;
  }
  // 2. Rank 0 picks the job's token; every rank creates its segment.
  if (rank == 0) {
    std::random_device rd;
    const uint64_t t = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (static_cast<uint64_t>(getpid()) << 16);
    store.set(prefix + "token", std::to_string(t));
  }
  const uint64_t token = std::stoull(store.get(prefix + "token"));
  std::unique_ptr<SharedMemoryMesh> mesh(new SharedMemoryMesh(rank, size, ring_bytes));
  if (!AllRanksAgree(store, prefix, "created", rank, size, mesh->CreateSegment(token), &bad, IsOk)) {
    *why_not = "creating the shared memory segments failed (" + bad + ")";
    return nullptr;  // the destructor unlinks and unmaps what this rank made
  }
  // 3. Map the peers' segments.
  if (!AllRanksAgree(store, prefix, "mapped", rank, size, mesh->MapPeerSegments(token), &bad, IsOk)) {
    *why_not = "mapping the peers' shared memory segments failed (" + bad + ")";
    return nullptr;
  }
  // Every rank has mapped every segment: the names can go.
  shm_unlink(mesh->name_.c_str());
  mesh->name_.clear();
  return mesh;
}

std::string SharedMemoryMesh::CreateSegment(uint64_t token) {
  name_ = SegmentName(token, rank_);
  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return Errno(("shm_open(" + name_ + ")").c_str());
  std::string created = "ok";
  // posix_fallocate reserves the pages now: a full /dev/shm fails here,
  // not later with SIGBUS inside a collective.
  int rc = ftruncate(fd, static_cast<off_t>(segment_bytes_)) != 0 ? errno : 0;
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(segment_bytes_));
  if (rc != 0) {
    created = "reserving " + std::to_string(segment_bytes_) + " bytes in /dev/shm for " + name_ +
              " failed: " + std::strerror(rc);
  } else if (void* p = mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); p == MAP_FAILED) {
    created = Errno("mmap");
  } else {
    maps_[rank_] = p;
    SegmentHeader* h = Segment::Header(p);
    h->token = token;
    h->pid = getpid();
    h->rank = rank_;
    h->size = size_;
    h->ring_bytes = ring_bytes_;
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kMagic;
  }
  close(fd);
  return created;
}

std::string SharedMemoryMesh::MapPeerSegments(uint64_t token) {
  std::string mapped = "ok";
  for (int r = 0; r < size_ && mapped == "ok"; ++r) {
    if (r == rank_) continue;
    const std::string name = SegmentName(token, r);
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) return Errno(("shm_open(" + name + ")").c_str());
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != segment_bytes_) {
      mapped = name + " has an unexpected size";
    } else if (void* p = mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); p == MAP_FAILED) {
      mapped = Errno("mmap");
    } else {
      maps_[r] = p;
      const SegmentHeader* h = Segment::Header(p);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (h->magic != kMagic || h->token != token || h->rank != r || h->size != size_) {
        mapped = name + " belongs to another mesh";
      } else {
        pids_[r] = h->pid;
      }
    }
    close(fd);
  }
  return mapped;
}

SharedMemoryMesh::~SharedMemoryMesh() {
  Abort();
  if (!name_.empty()) shm_unlink(name_.c_str());
  for (void* p : maps_)
    if (p) munmap(p, segment_bytes_);
}

void SharedMemoryMesh::Abort() {
  if (!maps_[rank_] || aborted_.exchange(true)) return;
  Segment::Header(maps_[rank_])->closed.store(1, std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p)
    if (maps_[p]) Ring(p);  // wakes the peers, and this rank's own Exchange()
}

void SharedMemoryMesh::NoteProgress(int64_t issued, int op) {
  if (!maps_[rank_]) return;
  const uint64_t v = (static_cast<uint64_t>(issued) << 8) | static_cast<uint64_t>((op + 1) & 0xff);
  Segment::Header(maps_[rank_])->progress.store(v, std::memory_order_release);
}

std::optional<SharedMemoryMesh::Progress> SharedMemoryMesh::PeerProgress(int peer) const {
  if (peer < 0 || peer >= size_ || !maps_[peer]) return std::nullopt;
  const uint64_t v = Segment::Header(maps_[peer])->progress.load(std::memory_order_acquire);
  if (v == 0) return std::nullopt;
  return Progress{static_cast<int64_t>(v >> 8), static_cast<int>(v & 0xff) - 1};
}

void SharedMemoryMesh::Ring(int peer) {
  SegmentHeader* h = Segment::Header(maps_[peer]);
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) Futex(&h->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

std::optional<SharedMemoryError> SharedMemoryMesh::CheckPeers(const std::vector<Outstanding>& owed, bool check_pids) {
  if (aborted_.load()) {
    return SharedMemoryError(SharedMemoryError::Kind::kPeerClosed, -1,
                             "this rank's communicator was destroyed during the collective");
  }
  const int64_t self = getpid();
  for (int p = 0; p < size_; ++p) {
    const Outstanding& o = owed[p];
    if (p == rank_ || (o.recv == 0 && o.send == 0)) continue;
    // Acquire: whatever p wrote to the rings before it set its flag (or
    // before it died) is visible to the loads below.
    const bool closed = Segment::Header(maps_[p])->closed.load(std::memory_order_acquire);
    const bool died = !closed && check_pids && pids_[p] != self && local_host::ProcessGone(pids_[p]);
    if (!closed && !died) continue;
    std::atomic_thread_fence(std::memory_order_acquire);
    // A peer that left is a failure only if this rank still needs bytes from
    // it that are not in the ring, or still has bytes for it that the ring
    // cannot take. A peer that finished its part and left (the end of a job)
    // has written everything this rank needs, and read everything it sent.
    RingHeader* in = Segment::Ring(maps_[p], p, rank_, ring_bytes_);
    RingHeader* out = Segment::Ring(maps_[rank_], rank_, p, ring_bytes_);
    const int64_t in_ring =
        static_cast<int64_t>(in->head.load(std::memory_order_acquire) - in->tail.load(std::memory_order_relaxed));
    const int64_t room = ring_bytes_ - static_cast<int64_t>(out->head.load(std::memory_order_relaxed) -
                                                             out->tail.load(std::memory_order_acquire));
    if (in_ring >= o.recv && room >= o.send) continue;
    const std::string who = "rank " + std::to_string(p) +
                            (closed ? " left the shared memory mesh (closed its communicator)"
                                    : " (pid " + std::to_string(pids_[p]) + ") has died");
    std::string what;
    if (in_ring < o.recv) {
      const int64_t written = o.recv_total - std::max<int64_t>(0, o.recv_payload - in_ring);
      what = " having written " + std::to_string(written) + " of the " + std::to_string(o.recv_total) +
             " bytes this rank needs from it";
    } else {
      what = " with " + std::to_string(o.send) + " bytes this rank still has to send it: they would never be read";
    }
    return SharedMemoryError(closed ? SharedMemoryError::Kind::kPeerClosed : SharedMemoryError::Kind::kPeerDied, p,
                             who + what);
  }
  return std::nullopt;
}

// One peer's two streams in the Exchange() in progress.
struct SharedMemoryMesh::Stream {
  size_t piece = 0;      // next piece to send
  int64_t offset = 0;    // bytes of it sent
  int64_t pad = 0;       // padding bytes still to send after the pieces
  int64_t received = 0;  // bytes consumed
  int64_t recv_total = 0;
  int64_t skip = 0;      // padding bytes still to skip after the received bytes
  int64_t unsent = 0;    // bytes still to send, padding included
};

// An event loop over the peers: send what fits (SendTo), consume what arrived
// (ReceiveFrom), and when neither moved, spin briefly, check the peers, then
// sleep on this rank's doorbell (SleepOnDoorbell). The doorbell is read before
// looking at the rings, and the sleep is on the value read, so news that
// lands after the look ends the sleep at once.
void SharedMemoryMesh::Exchange(const std::vector<PeerTraffic>& traffic, const Consumer& consume,
                                SteadyClock::time_point deadline) {
  const int64_t chunk = std::min(kMaxChunk, ring_bytes_ / kChunkDivisor);
  std::vector<Stream> streams(size_);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    int64_t sent = 0;
    for (const auto& piece : traffic[p].send) sent += piece.second;
    streams[p].pad = (kStreamAlign - sent % kStreamAlign) % kStreamAlign;
    streams[p].unsent = sent + streams[p].pad;
    streams[p].recv_total = traffic[p].recv_bytes;
    streams[p].skip = (kStreamAlign - traffic[p].recv_bytes % kStreamAlign) % kStreamAlign;
  }
  SegmentHeader* me = Segment::Header(maps_[rank_]);
  std::vector<bool> pending(size_, false);
  std::vector<Outstanding> owed(size_);
  auto spin_until = SteadyClock::now() + kSpin;
  auto next_pid_check = SteadyClock::now() + kPidCheckPeriod;
  for (;;) {
    // Read before looking at the rings: news that lands after the look changes it.
    const uint32_t bell = me->doorbell.load(std::memory_order_seq_cst);
    bool progressed = false, done = true;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      Stream& g = streams[p];
      if (SendTo(p, traffic[p].send, g, chunk)) progressed = true;
      if (ReceiveFrom(p, consume, g, chunk)) progressed = true;
      pending[p] = g.piece < traffic[p].send.size() || g.pad > 0 || g.received < g.recv_total || g.skip > 0;
      owed[p] = {g.recv_total - g.received + g.skip, g.recv_total - g.received, g.recv_total, g.unsent};
      done = done && !pending[p];
    }
    if (done) return;
    if (progressed) {
      spin_until = SteadyClock::now() + kSpin;
      continue;
    }
    const auto now = SteadyClock::now();
    if (now < spin_until) {
      for (int i = 0; i < 32; ++i) CpuRelax();
      continue;
    }
    const bool check_pids = now >= next_pid_check;
    if (check_pids) next_pid_check = now + kPidCheckPeriod;
    if (auto gone = CheckPeers(owed, check_pids)) throw *gone;
    SleepOnDoorbell(bell, now, deadline, pending);
  }
}

bool SharedMemoryMesh::SendTo(int p, const std::vector<std::pair<const void*, int64_t>>& pieces, Stream& g,
                              int64_t chunk) {
  static const uint8_t kZeros[kStreamAlign] = {};
  const int64_t cap = ring_bytes_;
  RingHeader* out = Segment::Ring(maps_[rank_], rank_, p, cap);
  uint64_t head = out->head.load(std::memory_order_relaxed);
  bool progressed = false;
  while (g.piece < pieces.size() || g.pad > 0) {
    const int64_t space = cap - static_cast<int64_t>(head - out->tail.load(std::memory_order_acquire));
    if (space <= 0) break;
    const bool padding = g.piece >= pieces.size();
    const int64_t left = padding ? g.pad : pieces[g.piece].second - g.offset;
    const int64_t pos = static_cast<int64_t>(head % cap);
    const int64_t k = std::min({space, cap - pos, left, chunk});
    const uint8_t* src = padding ? kZeros : static_cast<const uint8_t*>(pieces[g.piece].first) + g.offset;
    if (k > 0) std::memcpy(Segment::Data(out) + pos, src, k);  // src is null for an empty tensor (UBSan)
    head += k;
    g.unsent -= k;
    out->head.store(head, std::memory_order_release);
    Ring(p);
    progressed = true;
    if (padding) {
      g.pad -= k;
    } else if ((g.offset += k) == pieces[g.piece].second) {
      ++g.piece;
      g.offset = 0;
    }
  }
  return progressed;
}

bool SharedMemoryMesh::ReceiveFrom(int p, const Consumer& consume, Stream& g, int64_t chunk) {
  const int64_t cap = ring_bytes_;
  RingHeader* in = Segment::Ring(maps_[p], p, rank_, cap);
  uint64_t tail = in->tail.load(std::memory_order_relaxed);
  bool progressed = false;
  while (g.received < g.recv_total || g.skip > 0) {
    const int64_t avail = static_cast<int64_t>(in->head.load(std::memory_order_acquire) - tail);
    if (avail <= 0) break;
    const int64_t pos = static_cast<int64_t>(tail % cap);
    int64_t used;
    if (g.received < g.recv_total) {
      const int64_t k = std::min({avail, cap - pos, g.recv_total - g.received, chunk});
      used = consume(p, g.received, Segment::Data(in) + pos, k);
      if (used <= 0) break;
      g.received += used;
    } else {
      used = std::min(avail, g.skip);
      g.skip -= used;
    }
    tail += used;
    in->tail.store(tail, std::memory_order_release);
    Ring(p);
    progressed = true;
  }
  return progressed;
}

void SharedMemoryMesh::SleepOnDoorbell(uint32_t bell, SteadyClock::time_point now, SteadyClock::time_point deadline,
                                       const std::vector<bool>& pending) {
  if (now >= deadline) {
    std::string waiting;
    int first = -1;
    for (int p = 0; p < size_; ++p) {
      if (!pending[p]) continue;
      if (first < 0) first = p;
      waiting += (waiting.empty() ? "" : ", ") + std::to_string(p);
    }
    throw SharedMemoryError(SharedMemoryError::Kind::kTimeout, first,
                            "no progress before the deadline; still waiting on rank(s) " + waiting);
  }
  SegmentHeader* me = Segment::Header(maps_[rank_]);
  const auto slice = std::min<SteadyClock::duration>(kSleepSlice, deadline - now);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  me->sleepers.fetch_add(1, std::memory_order_seq_cst);
  Futex(&me->doorbell, FUTEX_WAIT, bell, &ts);
  me->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace shardtrain::comm
