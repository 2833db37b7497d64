#include "sharding/shard_layout.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

namespace shardtrain::sharding {
namespace {

// A run of elements at `src` in source unit `unit`'s flat layout and at `dst`
// in the destination's.
struct Segment {
  int64_t unit = 0;
  int64_t src = 0;
  int64_t dst = 0;
  int64_t len = 0;
};

bool SameParams(const FlatUnitLayout& a, const FlatUnitLayout& b) {
  return a.name == b.name && a.param_names == b.param_names && a.param_numels == b.param_numels;
}

std::vector<Segment> Segments(const std::vector<FlatUnitLayout>& src, const FlatUnitLayout& dst,
                              std::vector<std::string>* problems) {
  for (size_t u = 0; u < src.size(); ++u) {
    if (SameParams(src[u], dst)) return {Segment{static_cast<int64_t>(u), 0, 0, dst.numel()}};
  }
  // Per parameter, by name.
  struct Where {
    int64_t unit, offset, numel;
  };
  std::map<std::string, Where> where;
  for (size_t u = 0; u < src.size(); ++u) {
    int64_t offset = 0;
    for (size_t k = 0; k < src[u].param_names.size(); ++k) {
      where.emplace(src[u].param_names[k], Where{static_cast<int64_t>(u), offset, src[u].param_numels[k]});
      offset += src[u].param_numels[k];
    }
  }
  std::vector<Segment> out;
  int64_t dst_offset = 0;
  for (size_t k = 0; k < dst.param_names.size(); ++k) {
    const std::string& name = dst.param_names[k];
    const int64_t n = dst.param_numels[k];
    auto it = where.find(name);
    if (it == where.end()) {
      if (problems) problems->push_back("missing: '" + name + "' (" + std::to_string(n) + " elements) is not in the checkpoint");
    } else if (it->second.numel != n) {
      if (problems) {
        problems->push_back("size mismatch: '" + name + "' has " + std::to_string(it->second.numel) +
                            " elements in the checkpoint, " + std::to_string(n) + " in the model");
      }
    } else if (!out.empty() && out.back().unit == it->second.unit &&
               out.back().src + out.back().len == it->second.offset && out.back().dst + out.back().len == dst_offset) {
      out.back().len += n;  // continues the previous run
    } else {
      out.push_back(Segment{it->second.unit, it->second.offset, dst_offset, n});
    }
    dst_offset += n;
  }
  return out;
}

}  // namespace

int64_t FlatUnitLayout::numel() const {
  int64_t n = 0;
  for (auto e : param_numels) n += e;
  return n;
}

std::vector<ShardCopy> PlanShardCopies(const std::vector<FlatUnitLayout>& src, int64_t src_world,
                                       const FlatUnitLayout& dst, int64_t dst_rank,
                                       std::vector<std::string>* problems) {
  std::vector<ShardCopy> out;
  const int64_t begin = dst_rank * dst.shard_numel;
  const int64_t end = std::min(begin + dst.shard_numel, dst.numel());
  for (const Segment& s : Segments(src, dst, problems)) {
    const int64_t x = std::max(begin, s.dst), y = std::min(end, s.dst + s.len);
    const int64_t S = src[s.unit].shard_numel;
    int64_t p = s.src + (x - s.dst);  // source flat position of destination element x
    for (int64_t d = x; d < y;) {
      const int64_t rank = p / S, off = p % S;
      const int64_t n = std::min(S - off, y - d);
      if (rank >= src_world) break;  // outside the saved shards (inconsistent sizes; checked by the reader)
      out.push_back(ShardCopy{s.unit, rank, off, d - begin, n});
      d += n;
      p += n;
    }
  }
  return out;
}

std::vector<std::string> UnexpectedParameters(const std::vector<FlatUnitLayout>& src,
                                              const std::vector<FlatUnitLayout>& dst) {
  std::set<std::string> known;
  for (const auto& u : dst) known.insert(u.param_names.begin(), u.param_names.end());
  std::vector<std::string> out;
  for (const auto& u : src) {
    for (size_t k = 0; k < u.param_names.size(); ++k) {
      if (!known.count(u.param_names[k])) {
        out.push_back("unexpected: '" + u.param_names[k] + "' (" + std::to_string(u.param_numels[k]) +
                      " elements) is in the checkpoint but not in the model");
      }
    }
  }
  return out;
}

}  // namespace shardtrain::sharding
