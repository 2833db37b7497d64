#include "trainer/connectors/internal/metric_log.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "base/errors.h"
#include "comm/host_collectives.h"

namespace shardtrain::trainer {

void TrainingModule::Log(const std::string& name, double value, const LogOptions& options) {
  internal::CheckReduceFx(options.reduce_fx);
  LogOptions o = options;
  if (!o.on_step) o.on_step = !log_eval_defaults_;
  if (!o.on_epoch) o.on_epoch = log_eval_defaults_;
  ST_CHECK_ARG(!(log_eval_defaults_ && *o.on_step), "Log(\"", name,
               "\", on_step=true) in validation/test: values logged there are aggregated over the run; valid: "
               "on_epoch=true (the default there) with on_step unset or false");
  ST_CHECK_ARG(*o.on_step || *o.on_epoch, "Log(\"", name,
               "\"): on_step and on_epoch are both false, so nothing would be logged; set at least one");
  logged_[name] = value;
  log_options_[name] = o;
}

namespace internal {
namespace {

// FNV-1a of the sorted names, exact in a double.
double Fingerprint(const std::set<std::string>& names) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& n : names) {
    for (unsigned char c : n) {
      h ^= c;
      h *= 1099511628211ull;
    }
    h ^= 0xffu;  // separator
    h *= 1099511628211ull;
  }
  return static_cast<double>(h >> 12);
}

std::vector<std::string> GatherStrings(comm::Communicator* world, const std::string& s) {
  if (world == nullptr || world->size() == 1) return {s};
  const int W = world->size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(s.size()), at::kLong);
  at::Tensor lens = at::empty({W}, at::kLong);
  comm::HostAllGather(*world, len, lens);
  const int64_t max_len = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor buf = at::zeros({max_len}, at::kByte);
  if (!s.empty()) std::memcpy(buf.data_ptr<uint8_t>(), s.data(), s.size());
  at::Tensor all = at::empty({W * max_len}, at::kByte);
  comm::HostAllGather(*world, buf, all);
  std::vector<std::string> out;
  const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < W; ++r) out.emplace_back(p + r * max_len, lens[r].item<int64_t>());
  return out;
}

// "s:acc" -> "acc (on_step)".
std::string Describe(const std::string& key) {
  if (key.size() > 2 && key[1] == ':') return key.substr(2) + (key[0] == 's' ? " (on_step)" : " (on_epoch)");
  return key;
}

}  // namespace

void CheckReduceFx(const std::string& fx) {
  ST_CHECK_ARG(fx == "mean" || fx == "sum" || fx == "max" || fx == "min", "Log: unknown reduce_fx \"", fx,
               "\"; valid: mean, sum, max, min");
}

void MetricCollector::AddBatch(TrainingModule& m, double weight) {
  for (const auto& [name, value] : m.logged_) {
    LogOptions o;
    o.sync_dist = true;  // written without Log: as log()
    if (auto it = m.log_options_.find(name); it != m.log_options_.end()) o = it->second;
    if (!o.on_step) o.on_step = !m.log_eval_defaults_;
    if (!o.on_epoch) o.on_epoch = m.log_eval_defaults_;
    if (*o.on_step) {
      step_[name] = {value, o};
      step_names_.insert("s:" + name);
    }
    if (*o.on_epoch) {
      Accumulated& a = epoch_[name];
      a.options = o;
      step_names_.insert("e:" + name);
      if (weight <= 0) continue;
      if (a.count == 0) a.max = a.min = value;
      a.sum += value;
      a.max = std::max(a.max, value);
      a.min = std::min(a.min, value);
      a.wsum += weight * value;
      a.weight += weight;
      ++a.count;
    }
  }
  m.logged_.clear();
  m.log_options_.clear();
}

double MetricCollector::Reduce(const std::vector<double>& per_rank, const LogOptions& o) const {
  if (!o.sync_dist) return per_rank[0];
  double r = per_rank[0];
  double sum = 0;
  for (double x : per_rank) {
    sum += x;
    if (o.reduce_fx == "max") r = std::max(r, x);
    if (o.reduce_fx == "min") r = std::min(r, x);
  }
  if (o.reduce_fx == "mean") return sum / static_cast<double>(per_rank.size());
  if (o.reduce_fx == "sum") return sum;
  return r;
}

void MetricCollector::CheckSameNames(const double* slots, const std::vector<std::string>& mine,
                                     const std::string& what) {
  const int W = comm_.world_size;
  bool same = true;
  for (int r = 1; r < W; ++r) same = same && slots[r] == slots[0];
  if (same) return;
  // Every rank sees the same slots, so every rank is here: gather the names and throw.
  std::string joined;
  for (const auto& n : mine) joined += n + '\n';
  const std::vector<std::string> all = GatherStrings(comm_.world, joined);
  std::vector<std::set<std::string>> sets;
  std::set<std::string> any;
  for (const auto& s : all) {
    std::set<std::string> names;
    std::istringstream in(s);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) names.insert(line);
    }
    any.insert(names.begin(), names.end());
    sets.push_back(std::move(names));
  }
  std::ostringstream msg;
  msg << "the ranks logged different names in " << what << "; every rank must Log the same names:";
  std::string sep = " ";
  for (const auto& n : any) {
    std::vector<int> missing;
    for (int r = 0; r < static_cast<int>(sets.size()); ++r) {
      if (!sets[r].count(n)) missing.push_back(r);
    }
    if (missing.empty()) continue;
    msg << sep << Describe(n) << " not logged by rank";
    if (missing.size() > 1) msg << "s";
    for (size_t i = 0; i < missing.size(); ++i) msg << (i ? "," : " ") << missing[i];
    sep = "; ";
  }
  ST_THROW(InvalidArgumentError, msg.str());
}

std::vector<double> MetricCollector::SyncStep(std::vector<double> header) {
  const int W = comm_.world_size;
  const int r = comm_.rank;
  const size_t h = header.size();
  std::vector<std::string> names;  // this step's on_step names, sorted
  for (const auto& [k, v] : step_) names.push_back(k);
  const bool same_layout = names == layout_;  // the same on every rank once the fingerprints agree
  std::vector<double> v = std::move(header);
  v.resize(h + W + layout_.size() * W, 0.0);
  v[h + r] = Fingerprint(step_names_);
  if (same_layout) {
    for (size_t j = 0; j < layout_.size(); ++j) v[h + W + j * W + r] = step_.at(layout_[j]).first;
  }
  v = comm_.all_reduce_sum(std::move(v));
  CheckSameNames(v.data() + h, std::vector<std::string>(step_names_.begin(), step_names_.end()), "this step");
  std::vector<double> values(v.begin() + h + W, v.end());
  if (!same_layout) {  // the names changed (on every rank alike): the values in the new layout
    layout_ = names;
    values.assign(layout_.size() * W, 0.0);
    for (size_t j = 0; j < layout_.size(); ++j) values[j * W + r] = step_.at(layout_[j]).first;
    values = comm_.all_reduce_sum(std::move(values));
  }
  step_metrics_.clear();
  for (size_t j = 0; j < layout_.size(); ++j) {
    const LogOptions& o = step_.at(layout_[j]).second;
    const std::vector<double> per_rank(values.begin() + j * W, values.begin() + (j + 1) * W);
    const std::string name = layout_[j] + (*o.on_epoch ? "_step" : "");
    const double x = Reduce(per_rank, o);
    step_metrics_[name] = x;
    if (o.prog_bar) prog_bar_[name] = x;
  }
  step_.clear();
  step_names_.clear();
  v.resize(h);
  return v;
}

std::map<std::string, double> MetricCollector::ReduceEpoch(const std::string& what, bool names_agreed) {
  const int W = comm_.world_size;
  const int r = comm_.rank;
  std::set<std::string> keys;
  std::vector<std::string> names;
  for (const auto& [k, a] : epoch_) {
    keys.insert("e:" + k);
    names.push_back(k);
  }
  if (!names_agreed) {
    std::vector<double> slots(W, 0.0);
    slots[r] = Fingerprint(keys);
    slots = comm_.all_reduce_sum(std::move(slots));
    CheckSameNames(slots.data(), std::vector<std::string>(keys.begin(), keys.end()), what);
  }
  std::map<std::string, double> out;
  if (names.empty()) return out;
  // Per name and rank: sum, count, max, min, weighted sum, weight.
  constexpr int kSlots = 6;
  std::vector<double> v(names.size() * W * kSlots, 0.0);
  for (size_t j = 0; j < names.size(); ++j) {
    const Accumulated& a = epoch_.at(names[j]);
    double* p = v.data() + (j * W + r) * kSlots;
    p[0] = a.sum;
    p[1] = static_cast<double>(a.count);
    p[2] = a.max;
    p[3] = a.min;
    p[4] = a.wsum;
    p[5] = a.weight;
  }
  v = comm_.all_reduce_sum(std::move(v));
  for (size_t j = 0; j < names.size(); ++j) {
    const LogOptions& o = epoch_.at(names[j]).options;
    double sum = 0, count = 0, wsum = 0, weight = 0;
    double mx = -std::numeric_limits<double>::infinity(), mn = std::numeric_limits<double>::infinity();
    for (int q = 0; q < (o.sync_dist ? W : 1); ++q) {  // without sync_dist: rank 0's
      const double* p = v.data() + (j * W + q) * kSlots;
      if (p[1] == 0) continue;
      sum += p[0];
      count += p[1];
      wsum += p[4];
      weight += p[5];
      mx = std::max(mx, p[2]);
      mn = std::min(mn, p[3]);
    }
    double x = sum;
    if (o.reduce_fx == "mean") x = weight > 0 ? wsum / weight : std::numeric_limits<double>::quiet_NaN();
    if (o.reduce_fx == "max") x = mx;
    if (o.reduce_fx == "min") x = mn;
    const std::string name = names[j] + (*o.on_step ? "_epoch" : "");
    out[name] = x;
    if (o.prog_bar) prog_bar_[name] = x;
  }
  epoch_.clear();
  return out;
}

}  // namespace internal
}  // namespace shardtrain::trainer
