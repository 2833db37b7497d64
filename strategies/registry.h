// StrategyRegistry: strategies by short name, built from string options.
//
//   auto s = StrategyRegistry::Create("fsdp_native", {{"sharding_strategy", "SHARD_GRAD_OP"}});
//
// Each strategy target registers its names when it is linked (static
// registration; the targets are alwayslink), so a program that links only
// //strategies/fsdp_native knows only that strategy. Unknown names and
// unknown option keys throw InvalidArgumentError listing the valid ones;
// invalid values and combinations are reported by the strategy's constructor.
#ifndef SHARDTRAIN_STRATEGIES_REGISTRY_H_
#define SHARDTRAIN_STRATEGIES_REGISTRY_H_

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "strategies/option_table.h"
#include "strategies/strategy.h"

namespace shardtrain::strategies {

using StrategyFactory = std::function<StrategyPtr(const StrategyOptions&)>;

class StrategyRegistry {
 public:
  // Registers `name`. `options` are the options its factory accepts (its
  // OptionTable's Docs()). Registering a name twice throws InvalidArgumentError.
  static void Register(const std::string& name, std::vector<OptionDoc> options, StrategyFactory factory,
                       std::string description = "");
  // Registers `name` with the options of `base` (already registered): an
  // alias or a preset such as fsdp_native_full_shard_offload. The option
  // reference lists the options under `base` and says so under `name`.
  static void RegisterVariant(const std::string& name, const std::string& base, StrategyFactory factory,
                              std::string description);
  // Creates a strategy; see the header comment for errors.
  static StrategyPtr Create(const std::string& name, const StrategyOptions& options = {});
  static bool Has(const std::string& name);
  static std::vector<std::string> Names();
  static std::vector<std::string> ValidKeys(const std::string& name);
  static std::string Description(const std::string& name);
  static std::vector<OptionDoc> Options(const std::string& name);
  // The option reference of every registered strategy (Markdown; the text of
  // docs/strategy_options.md when every strategy is linked).
  static std::string OptionReference();
};

// Helper that strategies use at static-initialization time:
//   static const bool kRegistered = RegisterStrategy("ddp", Table().Docs(), factory);
bool RegisterStrategy(const std::string& name, std::vector<OptionDoc> options, StrategyFactory factory,
                      std::string description = "");
// The same for StrategyRegistry::RegisterVariant; `base` must be registered
// first (earlier in the same file: static initialization runs in order there).
bool RegisterStrategyVariant(const std::string& name, const std::string& base, StrategyFactory factory,
                             std::string description);
}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_REGISTRY_H_
