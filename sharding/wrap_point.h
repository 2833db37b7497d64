// Wrap points: where a model says "a sharded unit may begin here".
//
// LibTorch modules have no forward hooks, so a unit is a holder around a
// submodule: write `Sharded<BlockImpl>` where the model would hold `BlockImpl`.
// Sharded<Impl> *is* an Impl (same parameters, same names, same forward
// signature) and also a WrapPoint. When a wrap policy makes it a unit, its
// forward gathers the unit's full parameters, runs Impl::forward, reshards
// per the sharding strategy and arms the re-gather before the unit's backward.
// When it is not a unit (no sharding strategy, or the policy said no), it is
// exactly Impl.
#ifndef SHARDTRAIN_SHARDING_WRAP_POINT_H_
#define SHARDTRAIN_SHARDING_WRAP_POINT_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace shardtrain::sharding {

class ShardedUnit;

class WrapPoint {
 public:
  virtual ~WrapPoint() = default;

  // The wrapped module's type (for type-based wrap policies), e.g. "BlockImpl".
  virtual std::string WrapTypeName() const = 0;
  // The unit this wrap point runs, or nullptr when it is not a unit.
  ShardedUnit* unit() const { return unit_; }

 protected:
  // Called by Sharded<Impl>::forward around the inner forward.
  void PreForward();
  void PostForward(const std::vector<at::Tensor>& outputs);
  // Runs `fn` (the inner forward of one tensor) under activation checkpointing
  // when enabled for this unit: activations are dropped and recomputed in backward.
  at::Tensor MaybeCheckpoint(const at::Tensor& input, const std::function<at::Tensor(const at::Tensor&)>& fn);
  bool checkpointing() const;

 private:
  friend class ShardedModel;
  ShardedUnit* unit_ = nullptr;
};

namespace internal {
std::string Demangle(const char* name);

inline void CollectTensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void CollectTensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void CollectTensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (CollectTensors(e, out), ...); }, t);
}
template <typename A, typename B>
void CollectTensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  CollectTensors(p.first, out);
  CollectTensors(p.second, out);
}
// Anything else carries no tensors the sharding runtime can hook.
template <typename T>
void CollectTensors(const T&, std::vector<at::Tensor>&) {}
}  // namespace internal

template <typename Impl>
class Sharded : public Impl, public WrapPoint {
 public:
  using Impl::Impl;

  std::string WrapTypeName() const override { return internal::Demangle(typeid(Impl).name()); }

  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    if (unit() == nullptr) return Impl::forward(std::forward<Args>(args)...);
    PreForward();
    auto out = CallInner(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    internal::CollectTensors(out, tensors);
    PostForward(tensors);
    return out;
  }

 private:
  template <typename... Args>
  auto CallInner(Args&&... args) {
    if constexpr (sizeof...(Args) == 1 &&
                  (std::is_convertible_v<std::decay_t<Args>, at::Tensor> && ...) &&
                  std::is_same_v<decltype(this->Impl::forward(std::declval<Args>()...)), at::Tensor>) {
      if (checkpointing()) {
        return MaybeCheckpoint(args..., [this](const at::Tensor& x) { return Impl::forward(x); });
      }
    }
    return Impl::forward(std::forward<Args>(args)...);
  }
};

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_WRAP_POINT_H_
