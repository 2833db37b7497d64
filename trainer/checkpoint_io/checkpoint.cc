#include "trainer/checkpoint_io/checkpoint.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base/errors.h"
#include "trainer/checkpoint_io/archive.h"

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

void FinishCheckpoint(ArchiveWriter& w, const CheckpointData& data, const c10::IValue& streamed_state_dict,
                      const c10::IValue& streamed_optimizer_full) {
  auto add = [&](const at::Tensor& t) { return w.Add(t.detach()); };
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  if (!streamed_state_dict.isNone()) {
    d.insert("state_dict", streamed_state_dict);
  } else {
    c10::Dict<std::string, at::Tensor> sd;
    for (const auto& [k, v] : data.state_dict) sd.insert(k, add(v));
    d.insert("state_dict", sd);
  }
  c10::List<at::Tensor> opts;
  for (const auto& s : data.optimizer_states) {
    at::Tensor t = at::from_blob(const_cast<char*>(s.data()), {static_cast<int64_t>(s.size())}, at::kByte);
    opts.push_back(add(t));
  }
  c10::Dict<std::string, std::string> hp;
  for (const auto& [k, v] : data.hparams) hp.insert(k, v);
  d.insert("optimizer_states", opts);
  d.insert("epoch", data.epoch);
  d.insert("global_step", data.global_step);
  d.insert("batch_in_epoch", data.batch_in_epoch);
  d.insert("world_size", data.world_size);
  d.insert("strategy", data.strategy);
  d.insert("rng_state", add(data.rng_state.defined() ? data.rng_state : at::empty({0}, at::kByte)));
  d.insert("hparams", hp);
  if (!data.cuda_rng_states.empty()) {
    c10::List<at::Tensor> states;
    for (const auto& t : data.cuda_rng_states) states.push_back(add(t));  // CPU byte tensors
    d.insert("cuda_rng_states", states);
  }
  if (!streamed_optimizer_full.isNone()) {
    d.insert("optimizer_full", streamed_optimizer_full);
  } else if (!data.optimizer_full.empty()) {
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [name, keys] : data.optimizer_full.state) {
      c10::Dict<std::string, at::Tensor> ks;
      for (const auto& [k, t] : keys) ks.insert(k, add(t));
      state.insert(name, ks);
    }
    c10::Dict<std::string, int64_t> steps;
    for (const auto& [name, s] : data.optimizer_full.step) steps.insert(name, s);
    c10::impl::GenericDict of(c10::StringType::get(), c10::AnyType::get());
    of.insert("kind", data.optimizer_full.kind);
    of.insert("state", state);
    of.insert("step", steps);
    d.insert("optimizer_full", of);
  }
  if (!data.callbacks.empty()) {
    c10::impl::GenericDict cbs(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, st] : data.callbacks) {
      c10::Dict<std::string, std::string> m;
      for (const auto& [k, v] : st) m.insert(k, v);
      cbs.insert(key, m);
    }
    d.insert("callbacks", cbs);
  }
  if (data.grad_scaler) d.insert("grad_scaler", GradScalerStateToIValue(*data.grad_scaler));
  if (!data.lr_schedulers.empty()) d.insert("lr_schedulers", LRSchedulerStatesToIValue(data.lr_schedulers));
  w.Finish(c10::IValue(d));
}

c10::IValue LRSchedulerStatesToIValue(const std::vector<std::map<std::string, std::string>>& states) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& st : states) {
    c10::Dict<std::string, std::string> m;
    for (const auto& [k, v] : st) m.insert(k, v);
    list.push_back(m);
  }
  return list;
}

std::vector<std::map<std::string, std::string>> LRSchedulerStatesFromIValue(const c10::IValue& value) {
  std::vector<std::map<std::string, std::string>> out;
  for (const auto& e : value.toListRef()) {
    auto& st = out.emplace_back();
    for (const auto& k : e.toGenericDict()) st[k.key().toStringRef()] = k.value().toStringRef();
  }
  return out;
}

void SaveCheckpoint(const std::string& path, const CheckpointData& data) {
  ArchiveWriter w(path);
  FinishCheckpoint(w, data, c10::IValue(), c10::IValue());
}

CheckpointData LoadCheckpoint(const std::string& path) {
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
    for (const auto& e : need("state_dict").toGenericDict()) {
      out.state_dict[e.key().toStringRef()] = e.value().toTensor();
    }
    for (const auto& t : need("optimizer_states").toList()) {
      at::Tensor b = t.get().toTensor().contiguous();
      out.optimizer_states.emplace_back(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()), b.numel());
    }
    out.epoch = need("epoch").toInt();
    out.global_step = need("global_step").toInt();
    out.batch_in_epoch = need("batch_in_epoch").toInt();
    out.world_size = need("world_size").toInt();
    out.strategy = need("strategy").toStringRef();
    out.rng_state = need("rng_state").toTensor();
    for (const auto& e : need("hparams").toGenericDict()) {
      out.hparams[e.key().toStringRef()] = e.value().toStringRef();
    }
    if (d.contains("cuda_rng_states")) {
      for (const auto& t : d.at("cuda_rng_states").toList()) out.cuda_rng_states.push_back(t.get().toTensor());
    }
    if (d.contains("optimizer_full")) {
      auto of = d.at("optimizer_full").toGenericDict();
      out.optimizer_full.kind = of.at("kind").toStringRef();
      for (const auto& e : of.at("state").toGenericDict()) {
        auto& keys = out.optimizer_full.state[e.key().toStringRef()];
        for (const auto& k : e.value().toGenericDict()) keys[k.key().toStringRef()] = k.value().toTensor();
      }
      for (const auto& e : of.at("step").toGenericDict()) {
        out.optimizer_full.step[e.key().toStringRef()] = e.value().toInt();
      }
    }
    if (d.contains("callbacks")) {
      for (const auto& e : d.at("callbacks").toGenericDict()) {
        auto& st = out.callbacks[e.key().toStringRef()];
        for (const auto& k : e.value().toGenericDict()) st[k.key().toStringRef()] = k.value().toStringRef();
      }
    }
    if (d.contains("grad_scaler")) out.grad_scaler = GradScalerStateFromIValue(d.at("grad_scaler"));
    if (d.contains("lr_schedulers")) out.lr_schedulers = LRSchedulerStatesFromIValue(d.at("lr_schedulers"));
  } catch (const c10::Error& e) {
    std::string what = e.what();
    ST_THROW(Error, "checkpoint '", path, "' has an unexpected layout: ", what.substr(0, what.find('\n')));
  } catch (const std::out_of_range& e) {  // c10::Dict::at on a missing key
    ST_THROW(Error, "checkpoint '", path, "' has an unexpected layout: an entry is missing (", e.what(), ")");
  }
  return out;
}

}  // namespace shardtrain::trainer
