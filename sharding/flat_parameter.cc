#include "sharding/flat_parameter.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>

#include "base/errors.h"
#include "sharding/source_release.h"

namespace shardtrain::sharding {

FlatParameter::FlatParameter(std::string unit_name, std::vector<FlatParamEntry> entries, int shard_rank,
                             int shard_world, NoValues)
    : unit_name_(std::move(unit_name)), entries_(std::move(entries)), shard_rank_(shard_rank), shard_world_(shard_world) {
  ST_CHECK_ARG(shard_world >= 1 && shard_rank >= 0 && shard_rank < shard_world, "FlatParameter: bad shard rank ",
               shard_rank, " of ", shard_world);
  if (!entries_.empty()) device_ = entries_.front().param.device();
  for (auto& e : entries_) {
    ST_CHECK_ARG(e.param.defined(), "unit '", unit_name_, "': parameter '", e.name, "' is undefined");
    ST_CHECK_ARG(e.param.device() == device_, "unit '", unit_name_, "' has parameters on different devices: '",
                 entries_.front().name, "' on ", device_, " and '", e.name, "' on ", e.param.device(),
                 "; move the model to one device before sharding");
    ST_CHECK_ARG(e.param.scalar_type() == at::kFloat, "unit '", unit_name_, "': parameter '", e.name, "' is ",
                 e.param.scalar_type(),
                 "; sharded parameters must be float32 (lower precision is set with mixed_precision.param_dtype)");
    e.shape = e.param.sizes().vec();
    e.numel = e.param.numel();
    e.offset = numel_;
    numel_ += e.numel;
  }
  padded_numel_ = (numel_ + shard_world - 1) / shard_world * shard_world;
  shard_numel_ = padded_numel_ / shard_world;
}

FlatParameter::FlatParameter(std::string unit_name, std::vector<FlatParamEntry> entries, int shard_rank,
                             int shard_world, bool offload_shard)
    : FlatParameter(std::move(unit_name), std::move(entries), shard_rank, shard_world, NoValues{}) {
  std::vector<at::Tensor> data;
  for (const auto& e : entries_) data.push_back(e.param.detach());
  at::Tensor flat = Flatten(data, at::kFloat);
  SetShard(flat.narrow(0, shard_offset(), shard_numel_), offload_shard, /*adopt=*/false);
}

std::unique_ptr<FlatParameter> FlatParameter::FromShard(std::string unit_name, std::vector<FlatParamEntry> entries,
                                                        at::Tensor shard, int shard_rank, int shard_world,
                                                        bool offload_shard) {
  std::unique_ptr<FlatParameter> f(
      new FlatParameter(std::move(unit_name), std::move(entries), shard_rank, shard_world, NoValues{}));
  ST_CHECK_ARG(shard.defined() && shard.scalar_type() == at::kFloat && shard.dim() == 1 &&
                   shard.numel() == f->shard_numel_,
               "unit '", f->unit_name_, "': the adopted shard must be a float32 vector of ", f->shard_numel_,
               " elements (", f->numel_, " parameters padded to a multiple of ", shard_world, ", split ", shard_world,
               " ways), got ", shard.defined() ? shard.sizes() : c10::IntArrayRef{}, " ",
               shard.defined() ? shard.scalar_type() : at::kFloat);
  f->SetShard(shard, offload_shard, /*adopt=*/true);
  return f;
}

void FlatParameter::PlaceEmptyOn(c10::Device device, bool offload_shard) {
  ST_CHECK_ARG(entries_.empty(), "unit '", unit_name_, "' has ", entries_.size(),
               " parameters: only a unit without parameters takes another device");
  device_ = device;
  SetShard(at::empty({0}, at::TensorOptions().dtype(at::kFloat)), offload_shard, /*adopt=*/false);
}

void FlatParameter::SetShard(at::Tensor shard, bool offload_shard, bool adopt) {
  if (offload_shard && !device_.is_cpu()) {
    shard_ = at::empty({shard_numel_}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    shard_.copy_(shard);
  } else if (adopt && !shard.is_view() && !shard.requires_grad() && shard.is_contiguous() &&
             shard.storage_offset() == 0 && shard.storage().nbytes() == shard.nbytes() &&
             shard.device() == device_) {
    shard_ = shard;  // owns exactly its bytes already: no copy
  } else {
    shard_ = shard.to(device_).clone();  // a clone owns exactly its bytes
  }
  shard_.set_requires_grad(true);
}

at::Tensor FlatParameter::Flatten(const std::vector<at::Tensor>& tensors, c10::ScalarType dtype) const {
  ST_CHECK_ARG(tensors.size() == entries_.size(), "unit '", unit_name_, "': expected ", entries_.size(),
               " tensors to flatten, got ", tensors.size());
  at::Tensor flat = at::zeros({padded_numel_}, at::TensorOptions().dtype(dtype).device(device_));
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    ST_CHECK_ARG(tensors[i].numel() == e.numel, "unit '", unit_name_, "': '", e.name, "' has ", tensors[i].numel(),
                 " elements, expected ", e.numel, " (shape ", c10::IntArrayRef(e.shape), ")");
    flat.narrow(0, e.offset, e.numel).copy_(tensors[i].reshape({-1}));
  }
  return flat;
}

at::Tensor FlatParameter::ShardOfFull(const std::vector<at::Tensor>& tensors, c10::ScalarType dtype) const {
  ST_CHECK_ARG(tensors.size() == entries_.size(), "unit '", unit_name_, "': expected ", entries_.size(),
               " tensors to shard, got ", tensors.size());
  at::Tensor shard = at::zeros({shard_numel_}, at::TensorOptions().dtype(dtype).device(device_));
  const int64_t lo = shard_offset(), hi = lo + shard_numel_;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    ST_CHECK_ARG(tensors[i].numel() == e.numel, "unit '", unit_name_, "': '", e.name, "' has ", tensors[i].numel(),
                 " elements, expected ", e.numel, " (shape ", c10::IntArrayRef(e.shape), ")");
    const int64_t b = std::max(lo, e.offset), end = std::min(hi, e.offset + e.numel);
    if (b < end) shard.narrow(0, b - lo, end - b).copy_(tensors[i].reshape({-1}).narrow(0, b - e.offset, end - b));
    SourceReleaseScope::Release(tensors[i]);  // e.g. drop a mapped checkpoint record's pages
  }
  return shard;
}

std::vector<at::Tensor> FlatParameter::Views(const at::Tensor& flat) const {
  ST_CHECK_ARG(flat.numel() >= numel_, "unit '", unit_name_, "': flat tensor has ", flat.numel(),
               " elements, expected at least ", numel_);
  std::vector<at::Tensor> out;
  for (const auto& e : entries_) out.push_back(flat.narrow(0, e.offset, e.numel).view(e.shape));
  return out;
}

std::vector<at::Tensor> FlatParameter::Unflatten(const at::Tensor& flat) const {
  std::vector<at::Tensor> out;
  for (auto& v : Views(flat)) out.push_back(v.clone());
  return out;
}

void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->reset();
}

void AllocateStorage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  if (s->nbytes() == nbytes && s->data() != nullptr) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

bool StorageIsFreed(const at::Tensor& t) { return t.storage().nbytes() == 0; }

}  // namespace shardtrain::sharding
