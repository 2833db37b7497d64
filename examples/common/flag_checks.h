// Range checks for the example programs' command-line flags. A value out of
// range throws FlagError, whose message names the flag, the value given and
// what is valid; RunExampleMain (trainer_flags.h) prints it and exits with
// kUsageErrorExitCode before any rank is started. No LibTorch here: the checks
// run before the programs touch a tensor.
#ifndef SHARDTRAIN_EXAMPLES_COMMON_FLAG_CHECKS_H_
#define SHARDTRAIN_EXAMPLES_COMMON_FLAG_CHECKS_H_

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardtrain::examples {

// The exit status of a program given a bad command line (as getopt-style tools do).
inline constexpr int kUsageErrorExitCode = 2;

// No upper bound, for the checks below.
inline constexpr int64_t kNoMaxInt = std::numeric_limits<int64_t>::max();
inline constexpr double kNoMax = std::numeric_limits<double>::infinity();

// A flag value out of its valid range: "--NAME=VALUE is not valid; valid: ...".
class FlagError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Throws FlagError "--flag=value is not valid[ (why)]; valid: <valid>".
[[noreturn]] void FailFlag(const std::string& flag, const std::string& value, const std::string& valid,
                           const std::string& why = "");

// min <= value <= max (max == kNoMaxInt: no upper bound).
void CheckIntFlag(const std::string& flag, int64_t value, int64_t min, int64_t max = kNoMaxInt);

// value == special (which means `special_meaning`, e.g. -1 "no limit") or min <= value <= max.
void CheckIntFlagOr(const std::string& flag, int64_t value, int64_t special, const std::string& special_meaning,
                    int64_t min, int64_t max = kNoMaxInt);

// A finite value in [min, max]; min_open / max_open exclude that end. max == kNoMax: no
// upper bound. NaN and infinities are never valid.
void CheckDoubleFlag(const std::string& flag, double value, double min, double max = kNoMax, bool min_open = false,
                     bool max_open = false);

// `value` is one of `valid`.
void CheckChoiceFlag(const std::string& flag, const std::string& value, const std::vector<std::string>& valid);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_COMMON_FLAG_CHECKS_H_
