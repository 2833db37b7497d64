#include "sharding/source_release.h"

namespace shardtrain::sharding {
namespace {
thread_local SourceReleaseScope* g_active = nullptr;
}  // namespace

SourceReleaseScope::SourceReleaseScope(ReleaseFn release) : release_(release), previous_(g_active) { g_active = this; }

SourceReleaseScope::~SourceReleaseScope() { g_active = previous_; }

void SourceReleaseScope::Release(const at::Tensor& source) {
  if (g_active != nullptr && g_active->release_ != nullptr && source.defined()) g_active->release_(source);
}

}  // namespace shardtrain::sharding
