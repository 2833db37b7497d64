// Internal to //sharding: the side streams of the sharding core on a device
// with streams (CUDA); on the CPU (Gloo) neither class does anything.
//
// GatherOrder: what an all-gather of a unit's parameters waits for.
//
// A collective waits, on the device, for everything queued on the stream that
// is current when it is issued (comm/nccl_communicator.cc). Issued from the
// compute stream, unit i+1's gather would wait for unit i's forward, which the
// host queued just before: no overlap unless forward_prefetch issued it
// earlier. A gather reads only its unit's shard, written last by whatever ran
// before the iteration (the optimizer step, a load). So, as PyTorch's FSDP
// does with its unshard stream:
//   - Mark(), at the start of a forward, records the compute stream's position;
//   - Issue() runs a gather's allocation, input cast and collective with a side
//     stream current, which first waits for that mark only (outside an
//     iteration, for everything queued so far, as before);
//   - the compute stream waits for the gather where the unit runs
//     (WaitUnshard: Work::Wait orders the current stream after it);
//   - RecordComputeUse() before a gathered buffer is freed: it was allocated on
//     the side stream, so the caching allocator must not hand it out again
//     before the compute stream's work on it is done.
// On the CPU every call does nothing and Issue() just runs the gather.
//
// GradOffload: with offload_params on a GPU, each unit's reduced gradient
// shard is copied into page-locked host memory on a side stream as soon as
// its reduce-scatter is done, so the copy overlaps the rest of backward
// instead of a blocking copy into pageable memory at its end; FinishBackward
// waits for those copies only.
#ifndef SHARDTRAIN_SHARDING_INTERNAL_DEVICE_STREAMS_H_
#define SHARDTRAIN_SHARDING_INTERNAL_DEVICE_STREAMS_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <functional>
#include <optional>

namespace shardtrain::sharding::internal {

class GatherOrder {
 public:
  // The shards are unchanged from the compute stream's current position on
  // `device` until Forget(): the iteration's gathers wait for this point only.
  void Mark(c10::Device device);
  // The iteration ended: later gathers wait for everything queued before them.
  void Forget();
  // Runs `issue` (allocate the gathered buffer, make the input, issue the
  // collective) ordered as above; on a device without streams, just runs it.
  void Issue(c10::Device device, const std::function<void()>& issue);
  // Before `gathered`'s storage is freed: its block is not reused before the
  // compute stream's queued work on it is done. No-op off a stream device.
  void RecordComputeUse(const at::Tensor& gathered);
 private:
  static bool HasStreams(c10::Device device) { return device.is_cuda(); }

  std::optional<c10::Stream> side_;  // created on first use, on the first stream device
  std::optional<c10::Event> mark_;   // recorded by Mark(), reset by Forget()
};

class GradOffload {
 public:
  // Starts copying `reduced` (a device tensor) to page-locked host memory,
  // after what the caller's stream has queued (its reduce-scatter); returns
  // the host tensor, whose values are there once Wait() returns.
  at::Tensor Start(const at::Tensor& reduced);
  // Waits for every copy started since the last Wait().
  void Wait();

 private:
  std::optional<c10::Stream> side_;
  std::optional<c10::Event> last_;  // behind the latest copy (the side stream runs them in order)
};

}  // namespace shardtrain::sharding::internal

#endif  // SHARDTRAIN_SHARDING_INTERNAL_DEVICE_STREAMS_H_
