// The model summary table (trainer/callbacks/model_summary.h).
#include "trainer/callbacks/model_summary.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <tuple>
#include <utility>

#include "strategies/strategy.h"

namespace shardtrain::trainer {
namespace {

// The optimizer's kind and its state tensors per parameter (as its first group sets them).
std::pair<std::string, int> OptimizerStates(const torch::optim::Optimizer* opt) {
  if (opt == nullptr || opt->param_groups().empty()) return {"", 0};
  auto& g = const_cast<torch::optim::Optimizer*>(opt)->param_groups()[0].options();
  if (dynamic_cast<const torch::optim::AdamW*>(opt)) {
    return {"AdamW", static_cast<torch::optim::AdamWOptions&>(g).amsgrad() ? 3 : 2};
  }
  if (dynamic_cast<const torch::optim::Adam*>(opt)) {
    return {"Adam", static_cast<torch::optim::AdamOptions&>(g).amsgrad() ? 3 : 2};
  }
  if (dynamic_cast<const torch::optim::SGD*>(opt)) {
    return {"SGD", static_cast<torch::optim::SGDOptions&>(g).momentum() != 0 ? 1 : 0};
  }
  if (dynamic_cast<const torch::optim::RMSprop*>(opt)) {
    auto& o = static_cast<torch::optim::RMSpropOptions&>(g);
    return {"RMSprop", 1 + (o.momentum() != 0 ? 1 : 0) + (o.centered() ? 1 : 0)};
  }
  if (dynamic_cast<const torch::optim::Adagrad*>(opt)) return {"Adagrad", 1};
  return {"", 0};
}

std::string WithCommas(int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > (n < 0 ? 1 : 0); i -= 3) s.insert(i, ",");
  return s;
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::ostringstream os;
  if (u == 0) {
    os << bytes << " B";
  } else {
    os << std::fixed << std::setprecision(1) << v << " " << units[u];
  }
  return os.str();
}

ModelSummary SummarizeModel(const strategies::Strategy& strategy, const torch::optim::Optimizer* optimizer) {
  ModelSummary s;
  s.strategy = strategy.name();
  s.world_size = strategy.world_size();
  std::tie(s.optimizer, s.optimizer_states) = OptimizerStates(optimizer);
  s.total.name = "Total";
  for (const auto& u : strategy.UnitSummaries()) {
    ModelSummaryRow r;
    r.name = u.name.empty() ? "(root)" : u.name;
    r.parameters = u.parameters;
    r.trainable = u.trainable;
    r.shard_elements = u.shard_elements;
    r.param_bytes = u.shard_bytes;
    // Gradients and optimizer state cover the trainable share of what this rank stores.
    const int64_t trainable_bytes =
        u.parameters == 0 ? 0 : static_cast<int64_t>(static_cast<double>(u.shard_bytes) * u.trainable / u.parameters);
    r.bytes_per_rank = u.shard_bytes + trainable_bytes * (1 + s.optimizer_states);
    s.total.parameters += r.parameters;
    s.total.trainable += r.trainable;
    s.total.shard_elements += r.shard_elements;
    s.total.param_bytes += r.param_bytes;
    s.total.bytes_per_rank += r.bytes_per_rank;
    s.rows.push_back(std::move(r));
  }
  return s;
}

std::string FormatModelSummary(const ModelSummary& s) {
  std::vector<std::vector<std::string>> cells = {{"", "Name", "Params", "Trainable", "Stored/rank", "Memory/rank"}};
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const auto& r = s.rows[i];
    cells.push_back({std::to_string(i), r.name, WithCommas(r.parameters), WithCommas(r.trainable),
                     WithCommas(r.shard_elements), FormatBytes(r.bytes_per_rank)});
  }
  const auto& t = s.total;
  cells.push_back({"", t.name, WithCommas(t.parameters), WithCommas(t.trainable), WithCommas(t.shard_elements),
                   FormatBytes(t.bytes_per_rank)});
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& row : cells) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  auto line = [&](const std::vector<std::string>& row) {
    std::ostringstream os;
    for (size_t c = 0; c < row.size(); ++c) {
      if (c > 0) os << " | ";
      // Names left-aligned, numbers right-aligned.
      if (c == 1) {
        os << std::left << std::setw(static_cast<int>(width[c])) << row[c];
      } else {
        os << std::right << std::setw(static_cast<int>(width[c])) << row[c];
      }
    }
    return os.str();
  };
  std::ostringstream out;
  const std::string header = line(cells[0]);
  const std::string rule(header.size(), '-');
  out << "Model summary (" << s.strategy << ", " << s.world_size << (s.world_size == 1 ? " rank" : " ranks")
      << "; memory/rank = parameters + gradients + " << s.optimizer_states << " optimizer state"
      << (s.optimizer_states == 1 ? "" : "s") << (s.optimizer.empty() ? "" : " (" + s.optimizer + ")")
      << " per trainable element)\n";
  out << header << "\n" << rule << "\n";
  for (size_t i = 1; i + 1 < cells.size(); ++i) out << line(cells[i]) << "\n";
  out << rule << "\n" << line(cells.back()) << "\n";
  return out.str();
}

}  // namespace shardtrain::trainer
