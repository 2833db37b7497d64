// The full checkpoint's Lightning layout, piece by piece
// (trainer/checkpoint_io/internal/layout.h).
#include "trainer/checkpoint_io/internal/layout.h"

#include <ATen/ATen.h>

#include <cmath>

#include "base/errors.h"

namespace shardtrain::trainer::internal {
namespace {

using GenericDict = c10::impl::GenericDict;

GenericDict StrDict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

// Lightning's progress counters: {"ready", "completed"[, "started"[, "processed"]]}.
GenericDict Counts(int64_t n, int fields) {
  static const char* const kNames[] = {"ready", "completed", "started", "processed"};
  GenericDict d = StrDict();
  for (int i = 0; i < fields; ++i) d.insert(kNames[i], n);
  return d;
}

GenericDict Progress(int64_t total, int64_t current, int fields) {
  GenericDict d = StrDict();
  d.insert("total", Counts(total, fields));
  d.insert("current", Counts(current, fields));
  return d;
}

GenericDict BatchProgress(int64_t total, int64_t current, bool last) {
  GenericDict d = Progress(total, current, 4);
  d.insert("is_last_batch", last);
  return d;
}

GenericDict EvalLoop() {
  GenericDict d = StrDict();
  d.insert("state_dict", StrDict());
  d.insert("batch_progress", BatchProgress(0, 0, false));
  return d;
}

}  // namespace

c10::IValue At(const GenericDict& d, const char* key) {
  TORCH_CHECK(d.contains(key), "no '", key, "' entry");
  return d.at(key);
}

c10::IValue ToIValue(const StateValue& v, const TensorAdder& add) {
  struct Visitor {
    const TensorAdder& add;
    c10::IValue operator()(std::monostate) const { return c10::IValue(); }
    c10::IValue operator()(bool b) const { return b; }
    c10::IValue operator()(int64_t i) const { return i; }
    c10::IValue operator()(double d) const { return d; }
    c10::IValue operator()(const std::string& s) const { return s; }
    c10::IValue operator()(const std::vector<double>& v) const { return c10::List<double>(v); }
    c10::IValue operator()(ScoreTensor t) const { return add(at::scalar_tensor(t.value, at::kFloat)); }
    c10::IValue operator()(const StateValue::Scores& m) const {
      GenericDict d = StrDict();
      for (const auto& [k, s] : m) d.insert(k, add(at::scalar_tensor(s.value, at::kFloat)));
      return d;
    }
  };
  return std::visit(Visitor{add}, v.value());
}

std::optional<StateValue> FromIValue(const c10::IValue& v) {
  if (v.isNone()) return StateValue();
  if (v.isBool()) return StateValue(v.toBool());
  if (v.isInt()) return StateValue(v.toInt());
  if (v.isDouble()) return StateValue(v.toDouble());
  if (v.isString()) return StateValue(v.toStringRef());
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.numel() != 1) return std::nullopt;
    return StateValue(ScoreTensor{t.to(at::kDouble).item<double>()});
  }
  if (v.isList() || v.isTuple()) {
    std::vector<double> out;
    auto push = [&](const c10::IValue& e) {
      if (!e.isInt() && !e.isDouble()) return false;
      out.push_back(e.isInt() ? static_cast<double>(e.toInt()) : e.toDouble());
      return true;
    };
    if (v.isList()) {
      for (const auto& e : v.toListRef()) {
        if (!push(e)) return std::nullopt;
      }
    } else {
      for (const auto& e : v.toTupleRef().elements()) {
        if (!push(e)) return std::nullopt;
      }
    }
    return StateValue(std::move(out));
  }
  if (v.isGenericDict()) {
    StateValue::Scores scores;
    for (const auto& e : v.toGenericDict()) {
      if (!e.key().isString() || !e.value().isTensor() || e.value().toTensor().numel() != 1) return std::nullopt;
      scores[e.key().toStringRef()] = ScoreTensor{e.value().toTensor().to(at::kDouble).item<double>()};
    }
    return StateValue(std::move(scores));
  }
  return std::nullopt;
}

GenericDict DictToIValue(const StateDict& d, const TensorAdder& add) {
  GenericDict out = StrDict();
  for (const auto& [k, v] : d) out.insert(k, ToIValue(v, add));
  return out;
}

StateDict DictFromIValue(const c10::IValue& v) {
  StateDict out;
  for (const auto& e : v.toGenericDict()) {
    if (!e.key().isString()) continue;
    if (auto sv = FromIValue(e.value())) out[e.key().toStringRef()] = std::move(*sv);
  }
  return out;
}

c10::IValue OptimizerStatesToIValue(const FullOptimizerState& st, bool state_added,
                                    const std::vector<OptimizerGroup>& groups, const TensorAdder& add) {
  c10::impl::GenericList list(c10::AnyType::get());
  if (st.empty()) return list;
  GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList param_groups(c10::AnyType::get());
  int64_t index = 0;
  size_t named = 0;
  std::vector<OptimizerGroup> one;
  const std::vector<OptimizerGroup>* gs = &groups;
  if (groups.empty()) {  // a CheckpointData built by hand: one group, by name
    OptimizerGroup& g = one.emplace_back();
    for (const auto& [name, keys] : st.state) g.params.push_back(name);
    gs = &one;
  }
  for (const auto& g : *gs) {
    c10::List<int64_t> ids;
    c10::List<std::string> names;
    for (const auto& name : g.params) {
      auto it = st.state.find(name);
      if (it != st.state.end()) {
        ++named;
        GenericDict entry = StrDict();
        auto step = st.step.find(name);
        // torch.optim keeps Adam's step as a float32 0-d tensor; SGD has none.
        if (step != st.step.end() && st.kind != "SGD") {
          entry.insert("step", add(at::scalar_tensor(static_cast<double>(step->second), at::kFloat)));
        }
        for (const auto& [k, t] : it->second) entry.insert(k, state_added ? t : add(t));
        state.insert(index, entry);
      }
      ids.push_back(index++);
      names.push_back(name);
    }
    GenericDict pg = StrDict();
    for (const auto& [k, v] : g.options) {
      if (k == "betas" && v.is<std::vector<double>>() && v.get<std::vector<double>>().size() == 2) {
        const auto& b = v.get<std::vector<double>>();
        pg.insert(k, c10::ivalue::Tuple::create(b[0], b[1]));  // a tuple, as torch.optim writes it
      } else {
        pg.insert(k, ToIValue(v, add));
      }
    }
    pg.insert("params", ids);
    pg.insert("param_names", names);
    param_groups.push_back(pg);
  }
  ST_CHECK_ARG(named == st.state.size(), "optimizer state for ", st.state.size(), " parameters, of which only ", named,
               " are in the optimizer's parameter groups");
  GenericDict osd = StrDict();
  osd.insert("state", state);
  osd.insert("param_groups", param_groups);
  list.push_back(osd);
  return list;
}

void OptimizerStatesFromIValue(const c10::IValue& v, CheckpointData& out) {
  const auto& list = v.toListRef();
  if (list.empty()) return;
  TORCH_CHECK(list.size() == 1, "it holds the state of ", list.size(),
              " optimizers; ShardTrain trains with one (configure_optimizers returns one)");
  GenericDict osd = list[0].toGenericDict();
  bool all_named = true;
  bool sgd = false, decoupled = false;
  std::vector<std::vector<int64_t>> ids;
  for (const auto& gv : At(osd, "param_groups").toListRef()) {
    GenericDict g = gv.toGenericDict();
    OptimizerGroup& group = out.optimizer_groups.emplace_back();
    auto& gid = ids.emplace_back();
    for (const auto& p : At(g, "params").toListRef()) gid.push_back(p.toInt());
    if (g.contains("param_names")) {
      for (const auto& n : g.at("param_names").toListRef()) group.params.push_back(n.toStringRef());
    }
    all_named = all_named && group.params.size() == gid.size();
    for (const auto& e : g) {
      const std::string& k = e.key().toStringRef();
      if (k == "params" || k == "param_names") continue;
      if (auto sv = FromIValue(e.value())) group.options[k] = std::move(*sv);
    }
    sgd = sgd || g.contains("momentum");
    decoupled = decoupled || (g.contains("decoupled_weight_decay") && g.at("decoupled_weight_decay").isBool() &&
                              g.at("decoupled_weight_decay").toBool());
    out.optimizer_indexed.group_sizes.push_back(static_cast<int64_t>(gid.size()));
  }
  IndexedOptimizerState& indexed = out.optimizer_indexed;
  for (const auto& e : At(osd, "state").toGenericDict()) {
    const int64_t index = e.key().toInt();
    for (const auto& k : e.value().toGenericDict()) {
      const std::string& key = k.key().toStringRef();
      if (key == "step") {
        const c10::IValue& s = k.value();
        indexed.step[index] = s.isTensor() ? std::llround(s.toTensor().to(at::kDouble).item<double>())
                                           : (s.isInt() ? s.toInt() : std::llround(s.toDouble()));
      } else {
        indexed.state[index][key] = k.value().toTensor();
      }
    }
  }
  if (!all_named) {
    for (auto& g : out.optimizer_groups) g.params.clear();
    return;
  }
  // Named by the file: by name at once.
  std::map<int64_t, std::string> name_of;
  for (size_t g = 0; g < ids.size(); ++g) {
    for (size_t i = 0; i < ids[g].size(); ++i) name_of[ids[g][i]] = out.optimizer_groups[g].params[i];
  }
  FullOptimizerState& full = out.optimizer_full;
  full.kind = sgd ? "SGD" : decoupled ? "AdamW" : "Adam";
  for (const auto& [index, keys] : indexed.state) {
    auto it = name_of.find(index);
    TORCH_CHECK(it != name_of.end(), "optimizer state for parameter index ", index, ", which no parameter group holds");
    full.state[it->second] = keys;
  }
  for (const auto& [index, step] : indexed.step) {
    auto it = name_of.find(index);
    if (it != name_of.end()) full.step[it->second] = step;
  }
  out.optimizer_indexed = IndexedOptimizerState();
}

c10::IValue LoopsToIValue(const CheckpointData& d) {
  const int64_t E = d.epoch, b = d.batch_in_epoch, G = d.global_step;
  const int64_t acc = std::max<int64_t>(d.accumulate_grad_batches, 1);
  const bool mid = b > 0;
  GenericDict epoch_progress = StrDict();
  GenericDict ep_counts = StrDict();  // an epoch under way: ready and started, not processed
  ep_counts.insert("ready", mid ? E + 1 : E);
  ep_counts.insert("completed", E);
  ep_counts.insert("started", mid ? E + 1 : E);
  ep_counts.insert("processed", E);
  epoch_progress.insert("total", ep_counts);
  epoch_progress.insert("current", ep_counts.copy());
  GenericDict optimizer = StrDict();
  optimizer.insert("step", Progress(G, mid ? b / acc : 0, 2));
  optimizer.insert("zero_grad", Progress(G, mid ? b / acc : 0, 3));
  GenericDict optim_progress = StrDict();
  optim_progress.insert("optimizer", optimizer);
  GenericDict epoch_loop_state = StrDict();
  epoch_loop_state.insert("_batches_that_stepped", G);
  GenericDict fit = StrDict();
  fit.insert("state_dict", StrDict());
  fit.insert("epoch_loop.state_dict", epoch_loop_state);
  fit.insert("epoch_loop.batch_progress", BatchProgress(G * acc, b, d.batches_in_epoch > 0 && b == d.batches_in_epoch));
  fit.insert("epoch_loop.scheduler_progress", Progress(G, mid ? b / acc : 0, 2));
  fit.insert("epoch_loop.automatic_optimization.state_dict", StrDict());
  fit.insert("epoch_loop.automatic_optimization.optim_progress", optim_progress);
  fit.insert("epoch_loop.manual_optimization.state_dict", StrDict());
  fit.insert("epoch_loop.manual_optimization.optim_step_progress", Progress(0, 0, 2));
  fit.insert("epoch_loop.val_loop.state_dict", StrDict());
  fit.insert("epoch_loop.val_loop.batch_progress", BatchProgress(0, 0, false));
  fit.insert("epoch_progress", epoch_progress);
  GenericDict loops = StrDict();
  loops.insert("fit_loop", fit);
  loops.insert("validate_loop", EvalLoop());
  loops.insert("test_loop", EvalLoop());
  loops.insert("predict_loop", EvalLoop());
  return loops;
}

void PositionFromLoops(const c10::IValue& loops, CheckpointData& out) {
  GenericDict fit = At(loops.toGenericDict(), "fit_loop").toGenericDict();
  GenericDict ep = At(At(fit, "epoch_progress").toGenericDict(), "current").toGenericDict();
  const int64_t processed = At(ep, "processed").toInt();
  const int64_t started = At(ep, "started").toInt();
  out.epoch = processed;
  out.batch_in_epoch = 0;
  if (started > processed && fit.contains("epoch_loop.batch_progress")) {
    // Mid-epoch: the batches of the epoch under way that were processed.
    GenericDict bp = At(fit.at("epoch_loop.batch_progress").toGenericDict(), "current").toGenericDict();
    out.batch_in_epoch = At(bp, "processed").toInt();
  }
}

}  // namespace shardtrain::trainer::internal
