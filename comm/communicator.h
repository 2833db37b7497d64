// The one communication interface the sharding core knows.
//
// A Communicator is a group of `size()` ranks; this process (or thread) is
// `rank()`. Collectives are asynchronous: each returns a Work handle that is
// waited on (with the communicator's timeout unless another is given); errors
// surface from Wait() as CommError / CommTimeoutError naming the operation and
// group (Gloo: also the peer at fault, from heartbeats). Backends: GlooCommunicator (CPU tensors, comm/gloo_communicator.h) and
// NcclCommunicator (CUDA tensors, comm/nccl_communicator.h, --config=cuda).
//
// Thread-safety contract: one thread issues collectives on a communicator at a
// time, and every rank of the group issues the same collectives in the same
// order. Work handles may be waited on from any thread. Statistics can be read
// at any time.
#ifndef SHARDTRAIN_COMM_COMMUNICATOR_H_
#define SHARDTRAIN_COMM_COMMUNICATOR_H_

#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::comm {

// Default timeout of every collective (as c10d's kProcessGroupDefaultTimeout).
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(30);

// The time limits every backend's communicator keeps: GlooOptions and
// NcclOptions inherit them (so `options.timeout` reads as before), and the
// Trainer fills one from TrainerOptions' fields of the same names.
struct CommLimits {
  // Creation and every collective; CommTimeoutError after it.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // While this rank is blocked in a collective, it reads its peers'
  // heartbeats and logs a warning, once per stall, naming a peer (rank, pid,
  // host, its last collective) that has made no progress for `stall_warning`:
  // its heartbeat stopped (process stopped or hung) or it has not issued this
  // collective (comm/peer_watch.h). 0 turns the warning off. Needs heartbeats
  // (the options' heartbeat_period > 0, W > 1).
  std::chrono::milliseconds stall_warning = std::chrono::seconds(60);
  // If > 0: a stall that lasts this long fails the blocked collective (and the
  // group) with CommTimeoutError naming the peer, long before `timeout`.
  // 0 (the default): only `timeout` ends a wait.
  std::chrono::milliseconds stall_timeout{0};
};

enum class ReduceOp { kSum, kAvg, kMax, kMin };
const char* ReduceOpName(ReduceOp op);

// How a reduction is scaled: the input is divided by `pre_divide` before the
// sum and the result by `post_divide` after it (fairscale's gradient
// pre/post-divide factors). kAvg divides by the group size on top of these.
struct ReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  double pre_divide = 1.0;
  double post_divide = 1.0;
};

// Operations that are counted in CommStats.
enum class CommOp { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier, kCount };
const char* CommOpName(CommOp op);

// Calls and bytes this rank sent, per operation. Bytes follow the algorithm
// actually used (ring/all-to-all: (W-1)/W of the full buffer for all-gather
// and reduce-scatter; 2(W-1)/W for all-reduce).
struct CommStats {
  std::array<int64_t, static_cast<int>(CommOp::kCount)> calls{};
  std::array<int64_t, static_cast<int>(CommOp::kCount)> bytes_sent{};
  int64_t Calls(CommOp op) const { return calls[static_cast<int>(op)]; }
  int64_t BytesSent(CommOp op) const { return bytes_sent[static_cast<int>(op)]; }
  int64_t TotalBytesSent() const;
  std::string ToString() const;
};

// Handle of an asynchronous collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective completed. Throws CommError (or
  // CommTimeoutError) naming operation, group and peer on failure. A timeout
  // of zero means the communicator's own timeout.
  virtual void Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) = 0;
  // True once complete (successfully or not); never blocks.
  virtual bool IsCompleted() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// A Work that is already complete (for W=1 fast paths and no-op collectives).
WorkPtr CompletedWork();

class Communicator;
using CommunicatorPtr = std::shared_ptr<Communicator>;

// The two groups HYBRID_SHARD needs: shard within `shard`, replicate across `replicate`.
struct HybridGroups {
  CommunicatorPtr shard;
  CommunicatorPtr replicate;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Group name used in errors and logs ("world", "world/shard0", ...).
  const std::string& name() const { return name_; }
  // Backend name: "gloo" or "nccl".
  virtual std::string backend() const = 0;
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Gathers every rank's `input` (numel n, contiguous) into `output` (numel
  // size()*n, contiguous, same dtype and device): rank r's data lands at
  // [r*n, (r+1)*n).
  virtual WorkPtr AllGather(const at::Tensor& input, const at::Tensor& output) = 0;

  // Reduces `input` (numel size()*n) across ranks and leaves block rank() of
  // the result in `output` (numel n).
  virtual WorkPtr ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                                const ReduceOptions& options = {}) = 0;

  // ReduceScatter of the concatenation of `pieces` (each contiguous, with
  // output's dtype and device; numels summing to size() * output.numel()).
  // A backend that ReadsPiecesInPlace() reduces them where they lie; the
  // default concatenates them into one buffer first. The sharding core hands
  // a unit's per-parameter gradients over this way instead of copying each
  // into one flat buffer. The pieces must stay unchanged until the Work is done.
  virtual WorkPtr ReduceScatterPieces(const std::vector<at::Tensor>& pieces, const at::Tensor& output,
                                      const ReduceOptions& options = {});
  // True when ReduceScatterPieces reads the pieces in place (no concatenated copy).
  virtual bool ReadsPiecesInPlace() const { return false; }

  // In-place reduction of `tensor` across ranks.
  virtual WorkPtr AllReduce(const at::Tensor& tensor, const ReduceOptions& options = {}) = 0;

  // Copies `tensor` from `root` to every rank, in place.
  virtual WorkPtr Broadcast(const at::Tensor& tensor, int root) = 0;

  virtual WorkPtr Barrier() = 0;

  // Creates the sub-group of `ranks` (ranks of this group, ascending). Every
  // rank of this group must call it with the same arguments in the same order;
  // ranks outside `ranks` get nullptr.
  virtual CommunicatorPtr NewGroup(const std::vector<int>& ranks, const std::string& name) = 0;

  // Splits the group into size()/shard_size shard groups of consecutive ranks
  // and shard_size replicate groups of ranks with the same index within their
  // shard group (a 2x2 world: shard {0,1},{2,3}; replicate {0,2},{1,3}).
  HybridGroups SplitHybrid(int shard_size);

  CommStats stats() const;
  void ResetStats();

 protected:
  Communicator(int rank, int size, std::string name, std::chrono::milliseconds timeout);
  void Count(CommOp op, int64_t bytes_sent);
  // Checks NewGroup's arguments and numbers the group (every rank calls it the
  // same way). Returns this rank's index in `ranks`, or -1 when it is not a
  // member; `group_id` receives the group's number for its store prefix.
  int PrepareNewGroup(const std::vector<int>& ranks, const std::string& name, int* group_id);
  // Checks the arguments common to all-gather / reduce-scatter.
  void CheckGatherScatter(const char* op, const at::Tensor& shard, const at::Tensor& full) const;
  // Checks ReduceScatterPieces' arguments.
  void CheckPieces(const std::vector<at::Tensor>& pieces, const at::Tensor& output) const;

  int rank_;
  int size_;
  std::string name_;
  std::chrono::milliseconds timeout_;

 private:
  int next_group_ = 0;
  std::array<std::atomic<int64_t>, static_cast<int>(CommOp::kCount)> calls_{};
  std::array<std::atomic<int64_t>, static_cast<int>(CommOp::kCount)> bytes_{};
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_COMMUNICATOR_H_
