// Internal to //sharding:host_memory: what the block cache needs from the
// glibc-malloc side of host memory (host_memory.cc owns every glibc call).
#ifndef SHARDTRAIN_SHARDING_INTERNAL_MALLOC_HEAP_H_
#define SHARDTRAIN_SHARDING_INTERNAL_MALLOC_HEAP_H_

namespace shardtrain::sharding::internal {

// Gives the free pages inside glibc's heap back to the system (malloc_trim).
// Does nothing where malloc is not glibc's (another libc, a sanitizer's).
void TrimMallocHeap();

}  // namespace shardtrain::sharding::internal

#endif  // SHARDTRAIN_SHARDING_INTERNAL_MALLOC_HEAP_H_
