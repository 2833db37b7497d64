// SourceReleaseScope: what to do with a full tensor once this rank has read
// its slice of it during a load.
//
// A full checkpoint is mapped from its file (trainer/checkpoint_io/archive.h MapArchive),
// and each rank copies only its slice of every record into its shards
// (FlatParameter::ShardOfFull). The pages a rank reads stay resident in its
// process until the mapping goes, so without help a rank's resident memory
// during a full load grows by every page it touched. The trainer holds this
// scope around a load with a function that drops a mapped record's pages from
// the process (they stay in the page cache); ShardOfFull calls it for each
// source tensor right after copying from it, and so do the sharded loads
// (ShardedModel::LoadShardedStateDict, sharding::OptimizerStatesFromShards)
// for each saved shard once its overlapping range is copied.
#ifndef SHARDTRAIN_SHARDING_SOURCE_RELEASE_H_
#define SHARDTRAIN_SHARDING_SOURCE_RELEASE_H_

#include <ATen/core/Tensor.h>

namespace shardtrain::sharding {

class SourceReleaseScope {
 public:
  using ReleaseFn = void (*)(const at::Tensor& source);
  // `release` must leave the tensor's values readable (a later read may page
  // them in again) and must ignore tensors it does not know.
  explicit SourceReleaseScope(ReleaseFn release);
  // The previous scope on this thread, if any, becomes active again.
  ~SourceReleaseScope();
  SourceReleaseScope(const SourceReleaseScope&) = delete;
  SourceReleaseScope& operator=(const SourceReleaseScope&) = delete;

  // Hands `source` to the active scope's function; nothing without a scope.
  static void Release(const at::Tensor& source);

 private:
  ReleaseFn release_;
  SourceReleaseScope* previous_;
};

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_SOURCE_RELEASE_H_
