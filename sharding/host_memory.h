// Host memory of a sharded run: resident while it is needed, neither kept
// beyond the peak of what is live nor given back and faulted in again on
// every unit.
//
// A sharded step allocates and frees blocks of a unit's or a shard's size over
// and over (gathered parameters, flat gradients, reduce-scatter outputs,
// mixed-precision copies, the optimizer's temporaries), with activations and
// logits around them. Two ways this went wrong, both measured:
//  - glibc's malloc alone raises its mmap threshold (up to 32 MiB) each time
//    a mapped block is freed; the blocks then come from its heap and the
//    freed holes stay resident (201.7M GPT at W=4, bench/memory: a 1.36 GB
//    resident set for 0.79 GB of live tensors);
//  - with the threshold fixed at 4 MiB every such block was mapped afresh,
//    page-faulted in, zero-filled and unmapped again, every unit of every step
//    (23.2M GPT at W=2, bench/e2e: 250k minor faults and a quarter of the step).
//
// The host block cache is LibTorch's CPU allocator for blocks of 1 MiB and
// more (the smaller ones go to the allocator it replaced). A freed block's
// pages stay resident, for the next request of its size or, moved by page
// table (mremap), for a block of another size; at no moment do live and
// cached bytes together exceed the most bytes that were live at once since
// the last release, so the resident set never grows past what the program
// itself needed. ReleaseHostBlockCache() gives every cached page back; the
// sharding core and the Trainer call it where a phase that ran once ends
// (construction, wrapping, a resume's load, Fit, a save outside Fit). Pages are
// never zeroed for reuse (tensor storage is uninitialised anyway), and under
// AddressSanitizer the cache stays off (it would hide a use after free). A
// block made of moved chunks may be a mapping per MiB: within Linux's default
// vm.max_map_count (65530) up to ~60 GiB of blocks per process; past it a
// move that fails leaves its slot fresh (faulted in, nothing lost).
// Measured in docs/benchmarks.md ("The step at the compute limit").
//
// KeepFreedHostMemoryReturnable() still fixes glibc's mmap threshold, for
// what does not go through LibTorch's allocator. The sharding core calls both
// when a ShardedModel or a ShardedInitScope is made.
#ifndef SHARDTRAIN_SHARDING_HOST_MEMORY_H_
#define SHARDTRAIN_SHARDING_HOST_MEMORY_H_

#include <cstdint>

namespace shardtrain::sharding {

// The mmap threshold the sharding core sets: blocks of 4 MiB and more. (1 MiB
// gave the same peaks on the 201.7M GPT but made an 8-layer d 512 GPT fit
// 30-45% slower: a page-faulted mapping per block; 4 MiB cost ~2%.)
constexpr int64_t kDefaultMmapThresholdBytes = int64_t{4} << 20;

// Sets glibc's mmap threshold to `threshold_bytes`, once per process (later
// calls only check their input and return what the first did). Left alone, returning
// false, when the user chose one already (the environment variable
// MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES naming glibc.malloc.mmap_threshold),
// when SHARDTRAIN_MMAP_THRESHOLD=0, or without glibc. SHARDTRAIN_MMAP_THRESHOLD
// set to a positive number of bytes replaces `threshold_bytes`.
bool KeepFreedHostMemoryReturnable(int64_t threshold_bytes = kDefaultMmapThresholdBytes);

// Requests below this many bytes go to the allocator the cache replaced; the
// cache moves freed pages between blocks in chunks of this size.
constexpr int64_t kHostBlockCacheMinBytes = int64_t{1} << 20;

// Makes the host block cache LibTorch's CPU allocator, once per process, and
// says whether it is. It is not when SHARDTRAIN_HOST_CACHE=0 (any value but
// 0 or 1 throws InvalidArgumentError), under AddressSanitizer, or when the
// program installed a CPU allocator of its own with a priority above
// LibTorch's default (c10::SetCPUAllocator); one installed later wraps it.
bool InstallHostBlockCache();

// Gives every cached page back to the system and starts the peak afresh
// from the bytes live now. Does nothing when the cache is not installed.
void ReleaseHostBlockCache();

// What the host block cache holds and did since it was installed (all zero
// and installed = false when it is not).
struct HostCacheStats {
  bool installed = false;
  int64_t live_bytes = 0;      // blocks lent out to tensors now (whole pages)
  int64_t cached_bytes = 0;    // freed pages kept for reuse
  int64_t peak_bytes = 0;      // most live bytes since the last release: live + cached never exceed it
  int64_t hits = 0;            // requests served by a freed block of the same size, as it was
  int64_t assembled = 0;       // requests served by a new mapping
  int64_t moved_bytes = 0;     // cached pages moved into those new mappings
  int64_t fresh_bytes = 0;     // new pages in them (faulted in when first touched)
  int64_t returned_bytes = 0;  // pages given back to the system
  int64_t releases = 0;        // ReleaseHostBlockCache calls
};
HostCacheStats GetHostCacheStats();

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_HOST_MEMORY_H_
