// The flat-layout arithmetic behind resharded loads: which source shard
// ranges fill a destination shard, checked against a brute-force reference
// (every element's source position) for world size changes and for a unit
// whose parameter order changed.
#include "sharding/shard_layout.h"

#include <gtest/gtest.h>

#include <map>

namespace shardtrain::sharding {
namespace {

int64_t ShardOf(int64_t numel, int64_t world) { return (numel + world - 1) / world; }

FlatUnitLayout Unit(std::string name, std::vector<std::string> names, std::vector<int64_t> numels, int64_t world) {
  FlatUnitLayout u{std::move(name), std::move(names), std::move(numels), 0};
  u.shard_numel = ShardOf(u.numel(), world);
  return u;
}

// Fills each destination shard element from the plan; every element holds
// its source (unit, flat position) encoded as unit * 1e6 + position.
std::vector<int64_t> Apply(const std::vector<FlatUnitLayout>& src, int64_t src_world, const FlatUnitLayout& dst,
                           int64_t rank, std::vector<std::string>* problems = nullptr) {
  std::vector<int64_t> out(dst.shard_numel, -1);
  for (const auto& c : PlanShardCopies(src, src_world, dst, rank, problems)) {
    EXPECT_GE(c.src_rank, 0);
    EXPECT_LT(c.src_rank, src_world);
    EXPECT_LE(c.src_offset + c.len, src[c.src_unit].shard_numel);
    EXPECT_LE(c.dst_offset + c.len, dst.shard_numel);
    for (int64_t i = 0; i < c.len; ++i) {
      out[c.dst_offset + i] = c.src_unit * 1000000 + c.src_rank * src[c.src_unit].shard_numel + c.src_offset + i;
    }
  }
  return out;
}

// The reference: element e of dst's flat layout comes from parameter k at
// offset e - start(k), found by name in the source.
std::vector<int64_t> Expected(const std::vector<FlatUnitLayout>& src, const FlatUnitLayout& dst, int64_t rank) {
  std::map<std::string, std::pair<int64_t, int64_t>> where;
  for (size_t u = 0; u < src.size(); ++u) {
    int64_t off = 0;
    for (size_t k = 0; k < src[u].param_names.size(); ++k) {
      where[src[u].param_names[k]] = {static_cast<int64_t>(u), off};
      off += src[u].param_numels[k];
    }
  }
  std::vector<int64_t> flat;
  for (size_t k = 0; k < dst.param_names.size(); ++k) {
    auto [u, off] = where.at(dst.param_names[k]);
    for (int64_t i = 0; i < dst.param_numels[k]; ++i) flat.push_back(u * 1000000 + off + i);
  }
  std::vector<int64_t> out(dst.shard_numel, -1);
  for (int64_t i = 0; i < dst.shard_numel; ++i) {
    const int64_t e = rank * dst.shard_numel + i;
    if (e < static_cast<int64_t>(flat.size())) out[i] = flat[e];
  }
  return out;
}

TEST(ShardLayout, SameUnitsAtEveryWorldSizeAreDirectRangeCopies) {
  for (int64_t from : {1, 2, 3, 4, 5}) {
    for (int64_t to : {1, 2, 3, 4, 7}) {
      SCOPED_TRACE("from W=" + std::to_string(from) + " to W=" + std::to_string(to));
      std::vector<FlatUnitLayout> src = {Unit("a", {"a.w", "a.b"}, {12, 5}, from), Unit("b", {"b.w"}, {7}, from)};
      std::vector<FlatUnitLayout> dst = {Unit("a", {"a.w", "a.b"}, {12, 5}, to), Unit("b", {"b.w"}, {7}, to)};
      for (const auto& d : dst) {
        for (int64_t r = 0; r < to; ++r) {
          EXPECT_EQ(Apply(src, from, d, r), Expected(src, d, r)) << d.name << " rank " << r;
          // Direct copies: at most one per source shard the range overlaps.
          std::vector<std::string> problems;
          auto plan = PlanShardCopies(src, from, d, r, &problems);
          EXPECT_TRUE(problems.empty());
          EXPECT_LE(static_cast<int64_t>(plan.size()), from);
          for (const auto& c : plan) EXPECT_EQ(&src[c.src_unit] - &src[0], &d - &dst[0]);
        }
      }
    }
  }
}

TEST(ShardLayout, ChangedOrderAndWrappingFallBackPerParameter) {
  // The unit's parameters in another order, and a parameter moved in from
  // another source unit.
  std::vector<FlatUnitLayout> src = {Unit("a", {"a.w", "a.b"}, {12, 5}, 4), Unit("b", {"b.w", "b.b"}, {7, 3}, 4)};
  for (int64_t to : {1, 2, 3}) {
    FlatUnitLayout d = Unit("a", {"a.b", "b.w", "a.w"}, {5, 7, 12}, to);
    for (int64_t r = 0; r < to; ++r) {
      std::vector<std::string> problems;
      EXPECT_EQ(Apply(src, 4, d, r, &problems), Expected(src, d, r)) << "W=" << to << " rank " << r;
      EXPECT_TRUE(problems.empty());
    }
  }
  std::vector<FlatUnitLayout> dst = {Unit("a", {"a.b", "b.w", "a.w"}, {5, 7, 12}, 2)};
  auto unexpected = UnexpectedParameters(src, dst);
  ASSERT_EQ(unexpected.size(), 1u);
  EXPECT_NE(unexpected[0].find("'b.b'"), std::string::npos) << unexpected[0];
}

TEST(ShardLayout, MissingAndResizedParametersAreNamed) {
  std::vector<FlatUnitLayout> src = {Unit("a", {"a.w", "a.b"}, {12, 5}, 2)};
  FlatUnitLayout d = Unit("a", {"a.w", "a.b", "a.c"}, {12, 6, 2}, 2);
  std::vector<std::string> problems;
  PlanShardCopies(src, 2, d, 0, &problems);
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0], "size mismatch: 'a.b' has 5 elements in the checkpoint, 6 in the model");
  EXPECT_EQ(problems[1], "missing: 'a.c' (2 elements) is not in the checkpoint");
}

}  // namespace
}  // namespace shardtrain::sharding
