#include "trainer/checkpoint_io/checkpoint.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base/errors.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/internal/layout.h"
#include "trainer/optim/lr_scheduler.h"  // DoublesFromString: SchedulerState's lists

namespace shardtrain::trainer {
namespace fs = std::filesystem;

c10::IValue GradScalerStateToIValue(const GradScalerState& s) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("scale", s.scale);
  d.insert("growth_factor", s.growth_factor);
  d.insert("backoff_factor", s.backoff_factor);
  d.insert("growth_interval", s.growth_interval);
  d.insert("_growth_tracker", s.growth_tracker);
  return d;
}

GradScalerState GradScalerStateFromIValue(const c10::IValue& v) {
  auto g = v.toGenericDict();
  GradScalerState s;
  s.scale = g.at("scale").toDouble();
  s.growth_factor = g.at("growth_factor").toDouble();
  s.backoff_factor = g.at("backoff_factor").toDouble();
  s.growth_interval = g.at("growth_interval").toInt();
  s.growth_tracker = g.at("_growth_tracker").toInt();
  return s;
}

std::string PickleSavePlain(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* data, size_t n) { pickled.insert(pickled.end(), data, data + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(PlainForPickle(value));
  pickler.stop();
  std::string out;
  out.reserve(pickled.size());
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
      out.append(static_cast<const char*>(data), n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  return out;
}

namespace {

// SchedulerState keys whose text is a comma-separated list of floats (DoublesToString).
bool IsFloatList(const std::string& key) { return key == "base_lrs" || key == "_last_lr"; }

// One scheduler's text state with Python types; "3.last_epoch" (a child of
// SequentialLR) goes to "_schedulers"[3], as PyTorch's SequentialLR keeps it.
c10::impl::GenericDict SchedulerToIValue(const std::map<std::string, std::string>& st) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  std::map<size_t, std::map<std::string, std::string>> children;
  for (const auto& [k, v] : st) {
    // The optimizer's lrs and momentums are its param_groups' (format 1 kept
    // them here); a copy here would go stale in Python, which keeps every key.
    if (k == "optimizer_lrs" || k == "optimizer_momentums") continue;
    const auto dot = k.find('.');
    if (dot != std::string::npos && dot > 0 && std::all_of(k.begin(), k.begin() + dot, ::isdigit)) {
      children[std::stoul(k.substr(0, dot))][k.substr(dot + 1)] = v;
    } else if (IsFloatList(k)) {
      d.insert(k, c10::List<double>(DoublesFromString(v)));
    } else {
      d.insert(k, internal::ToIValue(k == "type" ? StateValue(v) : StateValue::Infer(v), nullptr));
    }
  }
  if (!children.empty()) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (const auto& [i, c] : children) list.push_back(SchedulerToIValue(c));
    d.insert("_schedulers", list);
  }
  return d;
}

void SchedulerFromIValue(const c10::IValue& v, const std::string& prefix, std::map<std::string, std::string>& out) {
  for (const auto& e : v.toGenericDict()) {
    const std::string& k = e.key().toStringRef();
    if (k == "_schedulers" && e.value().isList()) {
      size_t i = 0;
      for (const auto& c : e.value().toListRef()) SchedulerFromIValue(c, prefix + std::to_string(i++) + ".", out);
    } else if (auto sv = internal::FromIValue(e.value()); sv && !sv->is_none()) {
      out[prefix + k] = sv->ToString();
    }
  }
}

}  // namespace

namespace {

// The checkpoint's root dict; without `model_state`, no "state_dict" and
// "optimizer_states" (a sharded checkpoint's meta.pt).
c10::impl::GenericDict CheckpointRoot(const CheckpointData& data, const internal::TensorAdder& add, bool model_state,
                                      const c10::IValue& streamed_state_dict,
                                      const FullOptimizerState* streamed_optimizer_full) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  const FullOptimizerState& opt = streamed_optimizer_full ? *streamed_optimizer_full : data.optimizer_full;
  if (model_state) {
    if (!streamed_state_dict.isNone()) {
      d.insert("state_dict", streamed_state_dict);
    } else {
      c10::Dict<std::string, at::Tensor> sd;
      for (const auto& [k, v] : data.state_dict) sd.insert(k, add(v));
      d.insert("state_dict", sd);
    }
    d.insert("optimizer_states",
             internal::OptimizerStatesToIValue(opt, streamed_optimizer_full != nullptr, data.optimizer_groups, add));
  }
  d.insert("lr_schedulers", LRSchedulerStatesToIValue(data.lr_schedulers));
  d.insert("epoch", data.epoch);
  d.insert("global_step", data.global_step);
  d.insert("pytorch-lightning_version", std::string(kLightningVersion));
  d.insert("loops", internal::LoopsToIValue(data));
  c10::impl::GenericDict cbs(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [key, st] : data.callbacks) cbs.insert(key, internal::DictToIValue(st, add));
  d.insert("callbacks", cbs);
  d.insert("hparams_name", std::string("kwargs"));
  d.insert("hyper_parameters", internal::DictToIValue(data.hparams, add));
  if (data.grad_scaler) d.insert("MixedPrecision", GradScalerStateToIValue(*data.grad_scaler));
  c10::impl::GenericDict own(c10::StringType::get(), c10::AnyType::get());
  own.insert("format_version", kFormatVersion);
  own.insert("world_size", data.world_size);
  own.insert("batch_in_epoch", data.batch_in_epoch);
  own.insert("strategy", data.strategy);
  own.insert("rng_state", add(data.rng_state.defined() ? data.rng_state : at::empty({0}, at::kByte)));
  c10::List<at::Tensor> cuda;
  for (const auto& t : data.cuda_rng_states) cuda.push_back(add(t));  // CPU byte tensors
  own.insert("cuda_rng_states", cuda);
  c10::List<at::Tensor> archives;
  for (const auto& s : data.optimizer_states) {
    archives.push_back(add(at::from_blob(const_cast<char*>(s.data()), {static_cast<int64_t>(s.size())}, at::kByte)));
  }
  own.insert("optimizer_archives", archives);
  own.insert("optimizer_kind", opt.kind);  // "" for others; torch.optim's state does not say Adam from AdamW
  // The groups again, for optimizers "optimizer_states" cannot hold (their lrs and momentums).
  own.insert("optimizer_groups", OptimizerGroupsToIValue(data.optimizer_groups));
  d.insert("shardtrain", own);
  return d;
}

}  // namespace

void FinishCheckpoint(ArchiveWriter& w, const CheckpointData& data, const c10::IValue& streamed_state_dict,
                      const FullOptimizerState* streamed_optimizer_full) {
  const internal::TensorAdder add = [&](const at::Tensor& t) { return w.Add(t.detach()); };
  w.Finish(CheckpointRoot(data, add, true, streamed_state_dict, streamed_optimizer_full));
}

void SaveCheckpointMeta(const std::string& path, const CheckpointData& data) {
  ArchiveWriter w(path);
  const internal::TensorAdder add = [&](const at::Tensor& t) { return w.Add(t.detach()); };
  w.Finish(CheckpointRoot(data, add, false, c10::IValue(), nullptr));
}

c10::IValue StateDictToIValue(const StateDict& d) {
  return internal::DictToIValue(d, [](const at::Tensor& t) { return t; });
}

StateDict StateDictFromIValue(const c10::IValue& v) { return internal::DictFromIValue(v); }

c10::IValue OptimizerGroupsToIValue(const std::vector<OptimizerGroup>& groups) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& g : groups) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("param_names", c10::List<std::string>(g.params));
    d.insert("options", StateDictToIValue(g.options));
    list.push_back(d);
  }
  return list;
}

std::vector<OptimizerGroup> OptimizerGroupsFromIValue(const c10::IValue& v) {
  std::vector<OptimizerGroup> out;
  for (const auto& e : v.toListRef()) {
    auto d = e.toGenericDict();
    OptimizerGroup& g = out.emplace_back();
    for (const auto& n : d.at("param_names").toListRef()) g.params.push_back(n.toStringRef());
    g.options = StateDictFromIValue(d.at("options"));
  }
  return out;
}

c10::IValue LRSchedulerStatesToIValue(const std::vector<std::map<std::string, std::string>>& states) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& st : states) list.push_back(SchedulerToIValue(st));
  return list;
}

std::vector<std::map<std::string, std::string>> LRSchedulerStatesFromIValue(const c10::IValue& value) {
  std::vector<std::map<std::string, std::string>> out;
  for (const auto& e : value.toListRef()) SchedulerFromIValue(e, "", out.emplace_back());
  return out;
}

void NameOptimizerState(CheckpointData& ck, const std::vector<std::vector<std::string>>& groups,
                        const std::string& kind, const std::string& path) {
  IndexedOptimizerState& in = ck.optimizer_indexed;
  if (in.empty()) return;
  std::vector<int64_t> sizes;
  for (const auto& g : groups) sizes.push_back(static_cast<int64_t>(g.size()));
  auto text = [](const std::vector<int64_t>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return "[" + s + "]";
  };
  if (sizes != in.group_sizes) {
    ST_THROW(Error, "checkpoint '", path, "': its optimizer has parameter groups of ", text(in.group_sizes),
             " parameters, this run's optimizer ", text(sizes),
             "; build the optimizer over the same parameters in the same order (nothing was loaded)");
  }
  const char* need = kind == "SGD" ? "momentum_buffer" : "exp_avg";
  std::vector<std::string> names;
  for (const auto& g : groups) names.insert(names.end(), g.begin(), g.end());
  FullOptimizerState full;
  full.kind = kind;
  for (const auto& [index, keys] : in.state) {
    if (index < 0 || index >= static_cast<int64_t>(names.size())) {
      ST_THROW(Error, "checkpoint '", path, "': optimizer state for parameter index ", index, " of ", names.size());
    }
    if (!keys.count(need)) {
      std::string have;
      for (const auto& [k, t] : keys) have += (have.empty() ? "" : ", ") + k;
      ST_THROW(Error, "checkpoint '", path, "': the state of parameter ", index, " has keys {", have,
               "}, not those of this run's optimizer ", kind, " ('", need, "'; nothing was loaded)");
    }
    full.state[names[index]] = keys;
  }
  for (const auto& [index, step] : in.step) {
    if (index >= 0 && index < static_cast<int64_t>(names.size())) full.step[names[index]] = step;
  }
  for (size_t g = 0; g < groups.size() && g < ck.optimizer_groups.size(); ++g)
    ck.optimizer_groups[g].params = groups[g];
  ck.optimizer_full = std::move(full);
  ck.optimizer_indexed = IndexedOptimizerState();
}

void SaveCheckpoint(const std::string& path, const CheckpointData& data) {
  ArchiveWriter w(path);
  FinishCheckpoint(w, data, c10::IValue(), nullptr);
}

namespace {

void ReadLightningLayout(const c10::impl::GenericDict& d, CheckpointData& out) {
  out.epoch = internal::At(d, "epoch").toInt();
  out.global_step = internal::At(d, "global_step").toInt();
  if (d.contains("loops") && d.at("loops").isGenericDict() && d.at("loops").toGenericDict().contains("fit_loop")) {
    internal::PositionFromLoops(d.at("loops"), out);
  }
  if (d.contains("optimizer_states")) internal::OptimizerStatesFromIValue(d.at("optimizer_states"), out);
  if (d.contains("lr_schedulers")) out.lr_schedulers = LRSchedulerStatesFromIValue(d.at("lr_schedulers"));
  if (d.contains("callbacks")) {
    for (const auto& e : d.at("callbacks").toGenericDict()) {
      if (e.value().isGenericDict()) out.callbacks[e.key().toStringRef()] = internal::DictFromIValue(e.value());
    }
  }
  if (d.contains("hyper_parameters") && d.at("hyper_parameters").isGenericDict()) {
    out.hparams = internal::DictFromIValue(d.at("hyper_parameters"));
  }
  if (d.contains("MixedPrecision")) out.grad_scaler = GradScalerStateFromIValue(d.at("MixedPrecision"));
  if (!d.contains("shardtrain")) {  // written by Python Lightning
    out.world_size = 0;
    out.rng_state = at::Tensor();
    return;
  }
  auto own = d.at("shardtrain").toGenericDict();
  const int64_t version = own.at("format_version").toInt();
  TORCH_CHECK(version <= kFormatVersion, "its format_version is ", version, "; this ShardTrain reads up to ",
              kFormatVersion, " (a newer release wrote it)");
  out.world_size = own.at("world_size").toInt();
  out.batch_in_epoch = own.at("batch_in_epoch").toInt();
  out.strategy = own.at("strategy").toStringRef();
  out.rng_state = own.at("rng_state").toTensor();
  for (const auto& t : own.at("cuda_rng_states").toListRef()) out.cuda_rng_states.push_back(t.toTensor());
  for (const auto& t : own.at("optimizer_archives").toListRef()) {
    at::Tensor b = t.toTensor().contiguous();
    out.optimizer_states.emplace_back(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()), b.numel());
  }
  if (own.contains("optimizer_kind") && !out.optimizer_full.empty()) {
    out.optimizer_full.kind = own.at("optimizer_kind").toStringRef();
  }
  if (out.optimizer_groups.empty() && own.contains("optimizer_groups")) {
    out.optimizer_groups = OptimizerGroupsFromIValue(own.at("optimizer_groups"));
  }
}

}  // namespace

namespace {

CheckpointData ReadCheckpointFile(const std::string& path, bool model_state) {
  // Tensors are views of the mapped file: a loader that copies only its
  // slice of each tensor reads only those pages.
  c10::IValue v = MapArchive(path);
  if (!v.isGenericDict()) ST_THROW(Error, "checkpoint '", path, "' is not a ShardTrain checkpoint (not a dict)");
  auto d = v.toGenericDict();
  auto need = [&](const char* key) {
    if (!d.contains(key)) ST_THROW(Error, "checkpoint '", path, "' has no '", key, "' entry");
    return d.at(key);
  };
  CheckpointData out;
  try {
    if (!d.contains("pytorch-lightning_version")) {
      internal::ReadLegacyLayout(d, out);
    } else {
      ReadLightningLayout(d, out);
    }
    if (model_state) {
      for (const auto& e : need("state_dict").toGenericDict()) {
        out.state_dict[e.key().toStringRef()] = e.value().toTensor();
      }
    } else if (d.contains("shardtrain") && d.at("shardtrain").toGenericDict().contains("optimizer_kind")) {
      out.optimizer_full.kind = d.at("shardtrain").toGenericDict().at("optimizer_kind").toStringRef();  // no state here
    }
  } catch (const c10::Error& e) {
    std::string what = e.what();
    ST_THROW(Error, "checkpoint '", path, "' has an unexpected layout: ", what.substr(0, what.find('\n')));
  } catch (const std::out_of_range& e) {  // c10::Dict::at on a missing key
    ST_THROW(Error, "checkpoint '", path, "' has an unexpected layout: an entry is missing (", e.what(), ")");
  }
  return out;
}

}  // namespace

CheckpointData LoadCheckpoint(const std::string& path) { return ReadCheckpointFile(path, true); }
CheckpointData LoadCheckpointMeta(const std::string& path) { return ReadCheckpointFile(path, false); }

}  // namespace shardtrain::trainer
