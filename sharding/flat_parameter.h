// FlatParameter: one unit's parameters as a single flat buffer, sharded.
//
// The unit's parameters (in registration order) are laid end to end in a
// buffer padded to a multiple of the shard group size W; rank r keeps the
// contiguous block [r*S, (r+1)*S) of S = padded/W elements as `shard()`, a
// float32 leaf and the only tensor an optimizer sees. While the unit is
// unsharded the original parameters are views into the gathered buffer, so
// module code is untouched; after use the buffer's storage is released (its
// bytes freed, its metadata kept) and refilled before backward.
#ifndef SHARDTRAIN_SHARDING_FLAT_PARAMETER_H_
#define SHARDTRAIN_SHARDING_FLAT_PARAMETER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::sharding {

// One original parameter's place in its unit's flat buffer.
struct FlatParamEntry {
  std::string name;          // fully qualified, as in the unwrapped model
  // Further names of the same tensor when the model registers it in several
  // modules (tied weights); state dicts carry it under every name.
  std::vector<std::string> aliases;
  at::Tensor param;          // the module's own parameter (identity kept)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;        // in the unpadded flat buffer
  bool requires_grad = true;
};

class FlatParameter {
 public:
  // `entries` give name, parameter and requires_grad; shapes and offsets are
  // filled in here. All parameters must be float32 and on one device.
  // With `offload_shard` the shard (and so its gradient and the optimizer
  // state) lives in CPU memory (pinned when the parameters are on CUDA).
  FlatParameter(std::string unit_name, std::vector<FlatParamEntry> entries, int shard_rank, int shard_world,
                bool offload_shard = false);
  // Adopts `shard` (float32, this rank's block of the padded flat buffer) as
  // the unit's shard without reading the parameters' values, which may be
  // freed: ShardedInitScope (sharding/sharded_init.h) computes it while the
  // module is constructed. Entries are laid out as by the constructor.
  static std::unique_ptr<FlatParameter> FromShard(std::string unit_name, std::vector<FlatParamEntry> entries,
                                                  at::Tensor shard, int shard_rank, int shard_world,
                                                  bool offload_shard = false);

  const std::string& unit_name() const { return unit_name_; }
  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shard_offset() const { return shard_rank_ * shard_numel_; }
  int shard_rank() const { return shard_rank_; }
  int shard_world() const { return shard_world_; }
  c10::Device device() const { return device_; }
  // A unit without parameters (a root whose parameters all sit in wrapped
  // units, a parameterless wrap point) runs on the model's device: its empty
  // shard and collectives go there, as NCCL takes only CUDA tensors.
  void PlaceEmptyOn(c10::Device device, bool offload_shard);

  // The float32 master shard (an optimizer leaf). Never replaced or resized.
  const at::Tensor& shard() const { return shard_; }

  // Concatenates the given per-parameter tensors (one per entry, in order) into
  // a padded flat tensor of `dtype`.
  at::Tensor Flatten(const std::vector<at::Tensor>& tensors, c10::ScalarType dtype) const;
  // This rank's shard of what Flatten would build, made without building it:
  // only the part of each tensor that falls into the shard is read (so a
  // tensor mapped from a file pages in only this rank's slice). Padding is 0.
  at::Tensor ShardOfFull(const std::vector<at::Tensor>& tensors, c10::ScalarType dtype) const;
  // Splits a flat (padded or unpadded) tensor into clones shaped like the entries.
  std::vector<at::Tensor> Unflatten(const at::Tensor& flat) const;
  // Views of `flat` shaped like the entries (no copy).
  std::vector<at::Tensor> Views(const at::Tensor& flat) const;

 private:
  struct NoValues {};
  FlatParameter(std::string unit_name, std::vector<FlatParamEntry> entries, int shard_rank, int shard_world,
                NoValues);
  // Keeps `shard` itself when `adopt` and it owns exactly its bytes, else a copy.
  void SetShard(at::Tensor shard, bool offload_shard, bool adopt);

  std::string unit_name_;
  std::vector<FlatParamEntry> entries_;
  int shard_rank_;
  int shard_world_;
  c10::Device device_{c10::kCPU};
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  at::Tensor shard_;
};

// Releases a tensor's storage bytes while keeping every view's metadata.
void FreeStorage(const at::Tensor& t);
// Re-allocates the storage released by FreeStorage (contents undefined).
void AllocateStorage(const at::Tensor& t);
bool StorageIsFreed(const at::Tensor& t);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_FLAT_PARAMETER_H_
