// Host memory that a sharded run frees goes back to the operating system.
//
// glibc's malloc serves allocations below its mmap threshold from its heap,
// and raises that threshold (up to 32 MiB) each time a mapped block is freed.
// A sharded step allocates and frees blocks of a unit's size or of a
// shard's size over and over (gathered parameters, per-parameter gradients,
// reduce-scatter outputs, the optimizer's moments and temporaries); once the
// threshold has risen past them they land in the heap, and the freed holes,
// too small or in the wrong place for the next request, stay resident.
// Measured on the 201.7M GPT at W=4 (bench/memory): the step's peak resident
// set was 1.36 GB while LibTorch's allocator never held more than 0.79 GB.
//
// KeepFreedHostMemoryReturnable() fixes the mmap threshold (which also turns
// its adjustment off), so every block of at least that size is mapped on its
// own and unmapped when freed: resident memory follows the live tensors. The
// sharding core calls it when a ShardedModel or a ShardedInitScope is made.
#ifndef SHARDTRAIN_SHARDING_HOST_MEMORY_H_
#define SHARDTRAIN_SHARDING_HOST_MEMORY_H_

#include <cstdint>

namespace shardtrain::sharding {

// The mmap threshold the sharding core sets: blocks of 4 MiB and more. (1 MiB
// gave the same peaks on the 201.7M GPT but made an 8-layer d 512 GPT fit
// 30-45% slower: a page-faulted mapping per block; 4 MiB cost ~2%.)
constexpr int64_t kDefaultMmapThresholdBytes = int64_t{4} << 20;

// Sets glibc's mmap threshold to `threshold_bytes`, once per process (later
// calls do nothing and return what the first did). Left alone, returning
// false, when the user chose one already (the environment variable
// MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES naming glibc.malloc.mmap_threshold),
// when SHARDTRAIN_MMAP_THRESHOLD=0, or without glibc. SHARDTRAIN_MMAP_THRESHOLD
// set to a positive number of bytes replaces `threshold_bytes`.
bool KeepFreedHostMemoryReturnable(int64_t threshold_bytes = kDefaultMmapThresholdBytes);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_HOST_MEMORY_H_
