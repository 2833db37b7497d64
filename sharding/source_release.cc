#include "sharding/source_release.h"

namespace shardtrain::sharding {
namespace {
thread_local SourceReleaseScope* g_active_release_scope = nullptr;
}  // namespace

SourceReleaseScope::SourceReleaseScope(ReleaseFn release) : release_(release), previous_(g_active_release_scope) {
  g_active_release_scope = this;
}

SourceReleaseScope::~SourceReleaseScope() { g_active_release_scope = previous_; }

void SourceReleaseScope::Release(const at::Tensor& source) {
  if (g_active_release_scope != nullptr && g_active_release_scope->release_ != nullptr && source.defined())
    g_active_release_scope->release_(source);
}

}  // namespace shardtrain::sharding
