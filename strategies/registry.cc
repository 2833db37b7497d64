#include "strategies/registry.h"

#include <algorithm>
#include <mutex>

#include "base/errors.h"
#include "base/names.h"

namespace shardtrain::strategies {
namespace {

struct Entry {
  std::vector<OptionDoc> options;
  std::vector<std::string> valid_keys;  // sorted
  StrategyFactory factory;
  std::string description;
  std::string options_of;  // a variant's base: its options are listed there
};

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, Entry>& Entries() {
  static auto* entries = new std::map<std::string, Entry>();
  return *entries;
}

}  // namespace

void StrategyRegistry::Register(const std::string& name, std::vector<OptionDoc> options, StrategyFactory factory,
                                std::string description) {
  std::lock_guard<std::mutex> lock(Mu());
  ST_CHECK_ARG(!Entries().count(name), "strategy '", name, "' is registered twice");
  std::vector<std::string> keys = OptionKeys(options);
  Entries()[name] = Entry{std::move(options), std::move(keys), std::move(factory), std::move(description)};
}

void StrategyRegistry::RegisterVariant(const std::string& name, const std::string& base, StrategyFactory factory,
                                       std::string description) {
  std::lock_guard<std::mutex> lock(Mu());
  ST_CHECK_ARG(!Entries().count(name), "strategy '", name, "' is registered twice");
  auto it = Entries().find(base);
  ST_CHECK_ARG(it != Entries().end(), "strategy '", name, "' is a variant of '", base,
               "', which is not registered yet; register '", base, "' first");
  Entry e = it->second;
  e.factory = std::move(factory);
  e.description = std::move(description);
  e.options_of = base;
  Entries()[name] = std::move(e);
}

bool RegisterStrategy(const std::string& name, std::vector<OptionDoc> options, StrategyFactory factory,
                      std::string description) {
  StrategyRegistry::Register(name, std::move(options), std::move(factory), std::move(description));
  return true;
}

bool RegisterStrategyVariant(const std::string& name, const std::string& base, StrategyFactory factory,
                             std::string description) {
  StrategyRegistry::RegisterVariant(name, base, std::move(factory), std::move(description));
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
      ST_THROW(InvalidArgumentError, "unknown strategy '", name, "'; registered strategies: ", JoinNames(names),
               " (a strategy is known only when its Bazel target is linked, e.g. //strategies:all)");
    }
    entry = it->second;
  }
  std::vector<std::string> unknown;
  for (const auto& [k, v] : options) {
    if (!std::binary_search(entry.valid_keys.begin(), entry.valid_keys.end(), k)) unknown.push_back(k);
  }
  ST_CHECK_ARG(unknown.empty(), "strategy '", name, "': unknown option", unknown.size() > 1 ? "s " : " ",
               JoinNames(unknown), "; valid options: ", JoinNames(entry.valid_keys));
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

std::vector<OptionDoc> StrategyRegistry::Options(const std::string& name) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Entries().find(name);
  ST_CHECK_ARG(it != Entries().end(), "unknown strategy '", name, "'");
  return it->second.options;
}

std::string StrategyRegistry::OptionReference() {
  std::lock_guard<std::mutex> lock(Mu());
  std::string out =
      "# Strategy options\n\n"
      "Generated from the strategies' option tables (strategies/option_table.h) by\n"
      "`tools/bazel run //tests/strategies:strategies_test -- --gtest_filter=OptionReference.*`;\n"
      "tests/strategies checks that this file matches them. Options are given as\n"
      "strings: `StrategyRegistry::Create(name, {{key, value}, ...})` or the examples'\n"
      "`--strategy_options=key=value,...`.\n";
  for (const auto& [name, e] : Entries()) {
    out += "\n## " + name + "\n\n" + (e.description.empty() ? "" : e.description + ".\n\n");
    if (e.options.empty()) {
      out += "No options.\n";
    } else if (!e.options_of.empty()) {
      out += "Options as `" + e.options_of + "`.\n";
    } else {
      out += OptionDocsMarkdown(e.options);
    }
  }
  return out;
}

std::string StrategyRegistry::Description(const std::string& name) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Entries().find(name);
  ST_CHECK_ARG(it != Entries().end(), "unknown strategy '", name, "'");
  return it->second.description;
}

}  // namespace shardtrain::strategies
