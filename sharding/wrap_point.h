// Wrap points: where a model says "a sharded unit may begin here".
//
// LibTorch modules have no forward hooks, so a unit is a holder around a
// submodule: write `Sharded<BlockImpl>` where the model would hold `BlockImpl`.
// Sharded<Impl> *is* an Impl (same parameters, same names, same forward
// signature) and also a WrapPoint. When a wrap policy makes it a unit, its
// forward gathers the unit's full parameters, runs Impl::forward, reshards
// per the sharding strategy and arms the re-gather before the unit's backward.
// When it is not a unit (no sharding strategy, or the policy said no), it is
// exactly Impl. A unit under activation checkpointing keeps only its forward's
// tensor arguments for backward and runs the forward again there; it handles
// forwards that return at::Tensor, std::tuple<at::Tensor, ...> or
// std::vector<at::Tensor> and take tensors and copyable values.
#ifndef SHARDTRAIN_SHARDING_WRAP_POINT_H_
#define SHARDTRAIN_SHARDING_WRAP_POINT_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <memory>
#include <vector>

namespace torch::nn {
class Module;
}

namespace shardtrain::sharding {

class ShardedUnit;
class ShardedInitScope;
namespace internal {
struct PrebuiltUnit;
class UnitCollector;
}

class WrapPoint {
 public:
  virtual ~WrapPoint() = default;

  // The wrapped module's type (for type-based wrap policies), e.g. "BlockImpl".
  virtual std::string WrapTypeName() const = 0;
  // The unit this wrap point runs, or nullptr when it is not a unit.
  ShardedUnit* unit() const { return unit_; }
  // A unit's inner forward as a function of its tensor arguments (other
  // arguments are bound in the closure), returning its tensor outputs.
  using TensorsFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

 protected:
  // Called by Sharded<Impl>::forward around the inner forward.
  void PreForward();
  void PostForward(const std::vector<at::Tensor>& outputs);
  // Runs `fn` under activation checkpointing when enabled for this unit (and
  // grad mode is on): only `inputs` and the CPU RNG state are kept for
  // backward; the unit's forward runs again in backward, with the RNG state of
  // the first run, and its gradients flow to the inputs and parameters.
  // Otherwise it just calls fn(inputs).
  std::vector<at::Tensor> MaybeCheckpoint(const std::vector<at::Tensor>& inputs, const TensorsFn& fn);
  bool checkpointing() const;
  // Throws InvalidArgumentError: checkpointing is on for this unit but its
  // forward's signature (`why`) cannot be checkpointed.
  [[noreturn]] void CheckpointUnsupported(const std::string& why) const;

 private:
  friend class ShardedModel;
  friend class ShardedInitScope;
  friend class internal::UnitCollector;
  ShardedUnit* unit_ = nullptr;
  // This rank's shard made at construction by a ShardedInitScope, until a
  // ShardedModel adopts it as the unit's FlatParameter.
  std::shared_ptr<internal::PrebuiltUnit> prebuilt_;
};

namespace internal {
std::string Demangle(const char* name);
// Hands a just-constructed wrap point to the thread's active ShardedInitScope
// (does nothing when none is active). Defined in sharded_init.cc.
void OnWrapPointConstructed(WrapPoint& point, torch::nn::Module& module);

template <typename Self, typename... Args>
inline constexpr bool kIsCopyOf = sizeof...(Args) == 1 && (std::is_base_of_v<Self, std::decay_t<Args>> && ...);

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

// Activation checkpointing handles forwards whose outputs are at::Tensor,
// std::tuple<at::Tensor, ...> or std::vector<at::Tensor>.
template <typename T>
struct IsTensorTuple : std::false_type {};
template <typename... Ts>
struct IsTensorTuple<std::tuple<Ts...>> : std::bool_constant<(std::is_same_v<Ts, at::Tensor> && ...)> {};
template <typename R>
inline constexpr bool kCheckpointableOutput =
    std::is_same_v<R, at::Tensor> || std::is_same_v<R, std::vector<at::Tensor>> || IsTensorTuple<R>::value;

template <typename R>
std::vector<at::Tensor> OutputsToVector(R&& out) {
  using D = std::decay_t<R>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    return {std::forward<R>(out)};
  } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
    return std::forward<R>(out);
  } else {
    return std::apply([](auto&... e) { return std::vector<at::Tensor>{e...}; }, out);
  }
}
template <typename R, size_t... I>
R TupleFromVector(const std::vector<at::Tensor>& v, std::index_sequence<I...>) {
  return R(v.at(I)...);
}
template <typename R>
R OutputsFromVector(std::vector<at::Tensor> v) {
  if constexpr (std::is_same_v<R, at::Tensor>) {
    return v.at(0);
  } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
    return v;
  } else {
    return TupleFromVector<R>(v, std::make_index_sequence<std::tuple_size_v<R>>{});
  }
}
// Tensor arguments of a checkpointed forward are moved out of (TakeTensor) and
// back into (PutTensor) the bound argument tuple; other arguments stay bound.
template <typename T>
void TakeTensor(T& arg, std::vector<at::Tensor>& out) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    out.push_back(std::move(arg));
    arg = at::Tensor();
  }
}
template <typename T>
void PutTensor(T& arg, const std::vector<at::Tensor>& in, size_t& next) {
  if constexpr (std::is_same_v<T, at::Tensor>) arg = in.at(next++);
}
}  // namespace internal

template <typename Impl>
class Sharded : public Impl, public WrapPoint {
 public:
  // Impl's constructors, followed by the hand-over to an active ShardedInitScope.
  template <typename... Args>
    requires(std::is_constructible_v<Impl, Args && ...> && !internal::kIsCopyOf<Sharded, Args...>)
  explicit Sharded(Args&&... args) : Impl(std::forward<Args>(args)...) {
    internal::OnWrapPointConstructed(*this, *this);
  }

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
  // Under activation checkpointing, at::Tensor arguments are the checkpoint's
  // inputs (kept for backward; those that require grad get gradients) and
  // every other argument is copied into the recompute's closure.
  template <typename... Args>
  decltype(auto) CallInner(Args&&... args) {
    using R = decltype(this->Impl::forward(std::forward<Args>(args)...));
    if constexpr (!std::is_reference_v<R> && internal::kCheckpointableOutput<R> &&
                  (std::is_copy_constructible_v<std::decay_t<Args>> && ...)) {
      if (checkpointing()) {
        std::tuple<std::decay_t<Args>...> bound(args...);
        std::vector<at::Tensor> inputs;
        std::apply([&](auto&... a) { (internal::TakeTensor(a, inputs), ...); }, bound);
        auto fn = [this, bound](const std::vector<at::Tensor>& in) {
          auto call = bound;
          size_t next = 0;
          std::apply([&](auto&... a) { (internal::PutTensor(a, in, next), ...); }, call);
          return internal::OutputsToVector(std::apply([this](auto&... a) { return this->Impl::forward(a...); }, call));
        };
        return internal::OutputsFromVector<R>(MaybeCheckpoint(inputs, fn));
      }
    } else {
      if (checkpointing()) {
        CheckpointUnsupported(
            "forward must return at::Tensor, std::tuple<at::Tensor, ...> or std::vector<at::Tensor> and take "
            "copyable arguments");
      }
    }
    return Impl::forward(std::forward<Args>(args)...);
  }
};

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_WRAP_POINT_H_
