// TrainerOptions::nonfinite: the local check and the shared decision.
#include "base/names.h"
#include "trainer/loops/nonfinite.h"

#include <ATen/ops/isfinite.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "base/logging.h"

namespace shardtrain::trainer {

const std::vector<std::string>& NonfiniteModes() {
  static const std::vector<std::string> modes = {"off", "error", "skip"};  // Mode's order
  return modes;
}

NonfiniteCheck::NonfiniteCheck(const std::string& mode, bool check_gradients) : check_gradients_(check_gradients) {
  const auto& modes = NonfiniteModes();
  const auto it = std::find(modes.begin(), modes.end(), mode);
  ST_CHECK_ARG(it != modes.end(), "nonfinite must be one of ", JoinNames(modes, modes.size(), "\""), ", got \"", mode, "\"");
  mode_ = static_cast<Mode>(it - modes.begin());
}

double NonfiniteCheck::LocalFlag(double loss,
                                 const std::vector<std::pair<std::string, at::Tensor>>& named_parameters) {
  found_.clear();
  if (mode_ == Mode::kOff) return 0;
  if (!std::isfinite(loss)) {
    std::ostringstream os;
    os << "the loss is " << loss;
    found_ = os.str();
    return kFlag;
  }
  if (!check_gradients_) return 0;
  for (const auto& [name, p] : named_parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined() || at::isfinite(g).all().item<bool>()) continue;
    found_ = "the gradient of '" + name + "' is not finite";
    return kFlag;
  }
  return 0;
}

bool NonfiniteCheck::Decide(double slot_sum, int64_t global_step, int rank) {
  const int64_t ranks = static_cast<int64_t>(slot_sum / kFlag);
  if (mode_ == Mode::kOff || ranks == 0) return false;
  if (mode_ == Mode::kError) {
    std::ostringstream os;
    os << "non-finite value at global step " << global_step << ": ";
    if (!found_.empty()) {
      os << found_ << " on rank " << rank;
    } else {
      os << "found on " << ranks << " other rank(s) (see their errors); this rank's loss and gradients are finite";
    }
    os << " (TrainerOptions::nonfinite = \"error\"; \"skip\" skips such steps instead)";
    throw NonfiniteError(os.str());
  }
  ++skipped_;
  if (rank == 0) {
    ST_LOG(WARNING) << "skipped the optimizer step at global step " << global_step << ": a non-finite loss or gradient on "
                    << ranks << " rank(s)" << (found_.empty() ? "" : " (here: " + found_ + ")") << "; " << skipped_
                    << " step(s) skipped so far (TrainerOptions::nonfinite = \"skip\")";
  }
  return true;
}

}  // namespace shardtrain::trainer
