#include "tests/testing/counting_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "sharding/host_memory.h"

namespace shardtrain::testing {
namespace {

struct ThreadCounter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};  // written by the owning thread only
  // One reference for the owning thread while it runs, one per live
  // allocation: storage may be freed after its allocating thread ended.
  std::atomic<int64_t> refs{1};
};

void Unref(ThreadCounter* counter) {
  if (counter->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete counter;
}

// Drops the thread's reference when the thread exits; the counter is freed
// then, or by the last Free of storage the thread allocated.
struct CounterHolder {
  ThreadCounter* counter = new ThreadCounter();
  ~CounterHolder() { Unref(counter); }
};

ThreadCounter* MyCounter() {
  thread_local CounterHolder holder;
  return holder.counter;
}

struct Allocation {
  void* context;
  c10::DeleterFnPtr deleter;
  int64_t bytes;
  ThreadCounter* owner;
};

std::mutex g_mu;
std::unordered_map<void*, Allocation>* g_allocations = new std::unordered_map<void*, Allocation>();

void Free(void* ptr) {
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_allocations->find(ptr);
    if (it == g_allocations->end()) return;  // cannot happen: every pointer with this deleter was recorded
    a = it->second;
    g_allocations->erase(it);
  }
  a.owner->live -= a.bytes;
  Unref(a.owner);
  a.deleter(a.context);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* ptr = inner.get();
    if (ptr == nullptr) return inner;  // zero bytes: nothing to count
    const c10::Device device = inner.device();
    c10::DeleterFnPtr deleter = inner.get_deleter();
    void* context = inner.release_context();
    ThreadCounter* owner = MyCounter();
    owner->refs.fetch_add(1, std::memory_order_relaxed);
    const int64_t now = owner->live += static_cast<int64_t>(n);
    if (now > owner->peak.load()) owner->peak = now;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      (*g_allocations)[ptr] = Allocation{context, deleter, static_cast<int64_t>(n), owner};
    }
    return c10::DataPtr(ptr, ptr, &Free, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

}  // namespace

void InstallCountingCpuAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Under the counting allocator, the one the sharding core installs for
    // itself (sharding/host_memory.h): live bytes are counted as before, and
    // the process's resident set is the cache's.
    sharding::InstallHostBlockCache();
    static CountingAllocator* allocator = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(allocator, /*priority=*/100);
  });
}

int64_t LiveCpuBytesOfThisThread() { return MyCounter()->live.load(); }

void ResetPeakCpuBytesOfThisThread() { MyCounter()->peak = MyCounter()->live.load(); }

int64_t PeakCpuBytesOfThisThread() {
  ThreadCounter* c = MyCounter();
  return std::max(c->peak.load(), c->live.load());
}

}  // namespace shardtrain::testing
