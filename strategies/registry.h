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

#include "strategies/strategy.h"

namespace shardtrain::strategies {

using StrategyOptions = std::map<std::string, std::string>;
using StrategyFactory = std::function<StrategyPtr(const StrategyOptions&)>;

class StrategyRegistry {
 public:
  // Registers `name`. `valid_keys` are the option keys its factory accepts.
  // Registering a name twice throws InvalidArgumentError.
  static void Register(const std::string& name, std::vector<std::string> valid_keys, StrategyFactory factory,
                       std::string description = "");
  // Creates a strategy; see the header comment for errors.
  static StrategyPtr Create(const std::string& name, const StrategyOptions& options = {});
  static bool Has(const std::string& name);
  static std::vector<std::string> Names();
  static std::vector<std::string> ValidKeys(const std::string& name);
  static std::string Description(const std::string& name);
};

// Helper that strategies use at static-initialization time:
//   static const bool kRegistered = RegisterStrategy("ddp", {...}, factory);
bool RegisterStrategy(const std::string& name, std::vector<std::string> valid_keys, StrategyFactory factory,
                      std::string description = "");

// Typed reads of string options, with messages naming the strategy and key.
// Booleans: true/false/1/0/yes/no (case-insensitive).
namespace option_parsing {
bool ParseBool(const std::string& strategy, const std::string& key, const std::string& value);
int64_t ParseInt(const std::string& strategy, const std::string& key, const std::string& value);
double ParseDouble(const std::string& strategy, const std::string& key, const std::string& value);
// "bf16"/"bfloat16", "fp16"/"float16"/"half", "fp32"/"float32"/"float".
c10::ScalarType ParseDtype(const std::string& strategy, const std::string& key, const std::string& value);
std::string DtypeName(c10::ScalarType t);
}  // namespace option_parsing

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_REGISTRY_H_
