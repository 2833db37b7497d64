// Model-free arithmetic of FSDP's flat layout, for resharding checkpoints.
//
// A unit's flat parameter is its parameters laid end to end (in param_names
// order), padded to world * shard_numel; shard rank r holds the elements
// [r * shard_numel, (r + 1) * shard_numel). Loading a sharded checkpoint at
// another world size (or with a changed wrapping) fills each destination
// shard from the byte ranges of the source shards that overlap it: nothing
// here touches tensors, it only says which source range feeds which
// destination range.
#ifndef SHARDTRAIN_SHARDING_SHARD_LAYOUT_H_
#define SHARDTRAIN_SHARDING_SHARD_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::sharding {

// One unit's flat layout: parameter names and element counts in flat order,
// and the elements each shard rank holds.
struct FlatUnitLayout {
  std::string name;
  std::vector<std::string> param_names;
  std::vector<int64_t> param_numels;
  int64_t shard_numel = 0;

  int64_t numel() const;  // sum of param_numels (padding excluded)
};

// Copy `len` elements from shard `src_rank` of source unit `src_unit`,
// starting at `src_offset` in that shard, to `dst_offset` in the destination
// shard.
struct ShardCopy {
  int64_t src_unit = 0;
  int64_t src_rank = 0;
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t len = 0;
};

// The copies that fill destination shard `dst_rank` of unit `dst` (its flat
// elements [dst_rank * S, (dst_rank + 1) * S), padding excluded) from the
// `src` units, each sharded over `src_world` ranks.
//
// A source unit with dst's name and the same parameters in the same order
// gives direct range copies (one per source shard the range overlaps);
// otherwise each parameter is taken by name from whichever source unit holds
// it, still only for the elements this destination shard owns. Parameters
// of `dst` that no source unit has, or has with another element count, are
// added to `problems` (one line each: "missing: 'name' ..." or "size
// mismatch: ...") and get no copies.
std::vector<ShardCopy> PlanShardCopies(const std::vector<FlatUnitLayout>& src, int64_t src_world,
                                       const FlatUnitLayout& dst, int64_t dst_rank,
                                       std::vector<std::string>* problems);

// Parameters of `src` that no unit of `dst` has ("unexpected: 'name' ..." lines).
std::vector<std::string> UnexpectedParameters(const std::vector<FlatUnitLayout>& src,
                                              const std::vector<FlatUnitLayout>& dst);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_SHARD_LAYOUT_H_
