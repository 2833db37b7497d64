// Wrap policies: which wrap points become units (sharding/sharded_model.h).
#include <cxxabi.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "sharding/sharded_model.h"
#include "sharding/wrap_point.h"

namespace shardtrain::sharding {

WrapPolicy WrapPolicy::Always() {
  return {[](const WrapPoint&, int64_t) { return true; }};
}
WrapPolicy WrapPolicy::Never() {
  return {[](const WrapPoint&, int64_t) { return false; }};
}
WrapPolicy WrapPolicy::SizeBased(int64_t min_num_params) {
  ST_CHECK_ARG(min_num_params >= 0, "min_num_params must be >= 0, got ", min_num_params);
  return {[min_num_params](const WrapPoint&, int64_t numel) { return numel >= min_num_params; }};
}
WrapPolicy WrapPolicy::ByType(std::vector<std::string> type_names) {
  return {[names = std::move(type_names)](const WrapPoint& p, int64_t) {
    const std::string t = p.WrapTypeName();
    for (const auto& n : names) {
      if (t == n || (t.size() > n.size() && t.compare(t.size() - n.size(), n.size(), n) == 0 &&
                     t[t.size() - n.size() - 1] == ':')) {
        return true;
      }
    }
    return false;
  }};
}

namespace internal {
std::string Demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = (status == 0 && d) ? d : name;
  std::free(d);
  return out;
}
}  // namespace internal

}  // namespace shardtrain::sharding
