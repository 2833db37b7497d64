#include "strategies/registry.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <mutex>

#include "base/errors.h"

namespace shardtrain::strategies {
namespace {

struct Entry {
  std::vector<std::string> valid_keys;
  StrategyFactory factory;
  std::string description;
};

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, Entry>& Entries() {
  static auto* entries = new std::map<std::string, Entry>();
  return *entries;
}

std::string Join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "(none)" : out;
}

std::string Lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

void StrategyRegistry::Register(const std::string& name, std::vector<std::string> valid_keys, StrategyFactory factory,
                                std::string description) {
  std::lock_guard<std::mutex> lock(Mu());
  ST_CHECK_ARG(!Entries().count(name), "strategy '", name, "' is registered twice");
  std::sort(valid_keys.begin(), valid_keys.end());
  Entries()[name] = Entry{std::move(valid_keys), std::move(factory), std::move(description)};
}

bool RegisterStrategy(const std::string& name, std::vector<std::string> valid_keys, StrategyFactory factory,
                      std::string description) {
  StrategyRegistry::Register(name, std::move(valid_keys), std::move(factory), std::move(description));
  return true;
}

StrategyPtr StrategyRegistry::Create(const std::string& name, const StrategyOptions& options) {
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(Mu());
    auto it = Entries().find(name);
    if (it == Entries().end()) {
      std::vector<std::string> names;
      for (const auto& [n, e] : Entries()) names.push_back(n);
      ST_THROW(InvalidArgumentError, "unknown strategy '", name, "'; registered strategies: ", Join(names),
               " (a strategy is known only when its Bazel target is linked, e.g. //strategies:all)");
    }
    entry = it->second;
  }
  std::vector<std::string> unknown;
  for (const auto& [k, v] : options) {
    if (!std::binary_search(entry.valid_keys.begin(), entry.valid_keys.end(), k)) unknown.push_back(k);
  }
  ST_CHECK_ARG(unknown.empty(), "strategy '", name, "': unknown option", unknown.size() > 1 ? "s " : " ",
               Join(unknown), "; valid options: ", Join(entry.valid_keys));
  return entry.factory(options);
}

bool StrategyRegistry::Has(const std::string& name) {
  std::lock_guard<std::mutex> lock(Mu());
  return Entries().count(name) > 0;
}

std::vector<std::string> StrategyRegistry::Names() {
  std::lock_guard<std::mutex> lock(Mu());
  std::vector<std::string> names;
  for (const auto& [n, e] : Entries()) names.push_back(n);
  return names;
}

std::vector<std::string> StrategyRegistry::ValidKeys(const std::string& name) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Entries().find(name);
  ST_CHECK_ARG(it != Entries().end(), "unknown strategy '", name, "'");
  return it->second.valid_keys;
}

std::string StrategyRegistry::Description(const std::string& name) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Entries().find(name);
  ST_CHECK_ARG(it != Entries().end(), "unknown strategy '", name, "'");
  return it->second.description;
}

namespace option_parsing {

bool ParseBool(const std::string& strategy, const std::string& key, const std::string& value) {
  std::string v = Lower(value);
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  ST_THROW(InvalidArgumentError, "strategy '", strategy, "': option ", key, "='", value,
           "' is not a boolean; valid: true, false, 1, 0, yes, no");
}

int64_t ParseInt(const std::string& strategy, const std::string& key, const std::string& value) {
  // Accept "1e8" (fairscale's default is written that way) when it is integral.
  double d = ParseDouble(strategy, key, value);
  ST_CHECK_ARG(std::floor(d) == d && std::abs(d) < 9e18, "strategy '", strategy, "': option ", key, "='", value,
               "' is not an integer");
  return static_cast<int64_t>(d);
}

double ParseDouble(const std::string& strategy, const std::string& key, const std::string& value) {
  size_t pos = 0;
  double d = 0;
  try {
    d = std::stod(value, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  ST_CHECK_ARG(pos == value.size() && !value.empty() && std::isfinite(d), "strategy '", strategy, "': option ", key,
               "='", value, "' is not a number");
  return d;
}

c10::ScalarType ParseDtype(const std::string& strategy, const std::string& key, const std::string& value) {
  std::string v = Lower(value);
  if (v == "bf16" || v == "bfloat16") return c10::ScalarType::BFloat16;
  if (v == "fp16" || v == "float16" || v == "half") return c10::ScalarType::Half;
  if (v == "fp32" || v == "float32" || v == "float") return c10::ScalarType::Float;
  ST_THROW(InvalidArgumentError, "strategy '", strategy, "': option ", key, "='", value,
           "' is not a supported dtype; valid: bf16, fp16, fp32");
}

std::string DtypeName(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16:
      return "bf16";
    case c10::ScalarType::Half:
      return "fp16";
    case c10::ScalarType::Float:
      return "fp32";
    default:
      return c10::toString(t);
  }
}

}  // namespace option_parsing
}  // namespace shardtrain::strategies
