// Internal to the Gloo backend (comm/gloo/); not part of the public API.
//
// W=2 fast paths for AllGather, ReduceScatter and AllReduce (measured in
// bench/comm, see docs/comm_benchmark.md). At W=2 all-gather and
// reduce-scatter are one exchange of n elements each way, and a small
// all-reduce (up to kDirectAllReduceMaxBytes) one exchange of the whole tensor
// each way. The general paths pay for c10d internals that dominate on large
// buffers: _allgather_base gathers into a freshly allocated full-size tensor
// and copies it into `output`; the all-to-all reduce-scatter receives into a
// fresh full-size tensor and reduces with blocks.sum(0) (very slow for 16-bit
// types); fresh buffers above glibc's mmap threshold are page-faulted in on
// every call. The fast paths instead exchange with c10d alltoall_base and
// split sizes {0, n} / {n, 0}: each rank sends n elements straight from the
// user's tensor and receives n straight into the user's output (all-reduce:
// into a receive buffer), on Gloo's worker threads like every other op.
// All-gather is one such exchange; reduce-scatter and all-reduce are one per
// 4 MiB piece, and their wait() combines (adds and scales) piece k while later
// pieces are still moving. The local steps (own shard copy; add and scale) run
// on the calling thread in pieces of at most GRAIN_SIZE elements (Serially).
//
// Each function must be taken on both ranks alike (the callers decide from
// the size, dtype and op, which the ranks agree on). Same arithmetic as the
// general paths, bit for bit (checked by comm_bench's self-check).
#ifndef SHARDTRAIN_COMM_GLOO_INTERNAL_PAIR_EXCHANGE_H_
#define SHARDTRAIN_COMM_GLOO_INTERNAL_PAIR_EXCHANGE_H_

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>

namespace shardtrain::comm::gloo_internal {

// Largest all-reduce (bytes) that takes the W=2 exchange. Every rank then adds
// all n elements, where Gloo's ring (c10d allreduce: reduce-scatter, then
// all-gather of the sums) adds n/2 per rank and moves as many bytes, in two
// dependent steps. Measured on 2 cores over loopback (bench/comm, A/B in one
// binary): the exchange is ~1.5x faster at 1 MiB (one round trip fewer), even
// at ~2 MiB, and 6-25% slower from 4 MiB on, where the extra additions compete
// with the copies for the cores; the ring is then already at loopback speed.
constexpr int64_t kDirectAllReduceMaxBytes = int64_t{2} << 20;

// All-gather of a non-empty `input` into `output` (2 blocks) at W=2.
c10::intrusive_ptr<c10d::Work> PairAllGather(c10d::Backend& pg, int rank, const at::Tensor& input,
                                             const at::Tensor& output, std::chrono::milliseconds timeout);

// Reduce-scatter (sum, then times `scale`) of a floating `input` (2 blocks of
// output.numel() > 0 elements) into `output` at W=2.
c10::intrusive_ptr<c10d::Work> PairReduceScatter(c10d::Backend& pg, int rank, const at::Tensor& input,
                                                 const at::Tensor& output, double scale,
                                                 std::chrono::milliseconds timeout);

// SUM all-reduce of a floating, non-empty `tensor` of at most
// kDirectAllReduceMaxBytes at W=2, then divided by `post`.
c10::intrusive_ptr<c10d::Work> PairAllReduce(c10d::Backend& pg, int rank, const at::Tensor& tensor, double post,
                                             std::chrono::milliseconds timeout);

}  // namespace shardtrain::comm::gloo_internal

#endif  // SHARDTRAIN_COMM_GLOO_INTERNAL_PAIR_EXCHANGE_H_
