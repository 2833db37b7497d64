// StateValue: one value of checkpoint state that keeps its Python type, so
// that the full checkpoint holds what Lightning writes (hyper_parameters with
// int, float, bool and str values; callback states with tensor scores) and
// Python reads it back as the same type.
//
//   std::map<std::string, StateValue> hp = {{"width", 64}, {"lr", 3e-4}, {"name", "gpt"}, {"tied", true}};
//
// The string forms of earlier releases (TrainingModule::hparams(),
// Callback::state_dict()) keep working: StateValue::Infer reads a string as
// the int, float or bool it spells, and ToString writes any value as text.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_STATE_VALUE_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_STATE_VALUE_H_

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace shardtrain::trainer {

// A 0-d float32 tensor in the file (Lightning keeps metric scores as tensors).
struct ScoreTensor {
  double value = 0;
  bool operator==(const ScoreTensor& o) const { return value == o.value; }
};

class StateValue {
 public:
  // None, bool, int, float, str, list of floats, a score tensor, and
  // {str: score tensor} (ModelCheckpoint's best_k_models).
  using Scores = std::map<std::string, ScoreTensor>;
  using Value =
      std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<double>, ScoreTensor, Scores>;

  StateValue() = default;
  StateValue(bool v) : v_(v) {}                            // NOLINT: implicit, as a literal in a map
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  StateValue(T v) : v_(static_cast<int64_t>(v)) {}  // NOLINT: any integer (int, int64_t, size_t)
  StateValue(double v) : v_(v) {}                          // NOLINT
  StateValue(const char* v) : v_(std::string(v)) {}        // NOLINT: never bool
  StateValue(std::string v) : v_(std::move(v)) {}          // NOLINT
  StateValue(std::vector<double> v) : v_(std::move(v)) {}  // NOLINT
  StateValue(ScoreTensor v) : v_(v) {}                     // NOLINT
  StateValue(Scores v) : v_(std::move(v)) {}               // NOLINT

  // "3" -> int 3, "0.5" / "1e-05" / "nan" / "inf" -> float, "true" / "false"
  // (also Python's "True" / "False") -> bool, anything else -> str.
  static StateValue Infer(const std::string& text);

  const Value& value() const { return v_; }
  bool is_none() const { return std::holds_alternative<std::monostate>(v_); }
  template <typename T>
  bool is() const {
    return std::holds_alternative<T>(v_);
  }
  template <typename T>
  const T& get() const {
    return std::get<T>(v_);
  }
  // The number of a bool, int, float or score (throws InvalidArgumentError for others).
  double AsDouble() const;
  // Text that Infer reads back as the same value (floats exact, lists
  // comma-separated, None as "None", Scores as "path\tscore" lines).
  std::string ToString() const;
  // The Python type's name: "NoneType", "bool", "int", "float", "str", "list", "Tensor", "dict".
  std::string TypeName() const;

  bool operator==(const StateValue& o) const { return v_ == o.v_; }

 private:
  Value v_;
};

using StateDict = std::map<std::string, StateValue>;

// Each value as text (StateValue::ToString), and back (StateValue::Infer).
std::map<std::string, std::string> ToStrings(const StateDict& d);
StateDict InferTypes(const std::map<std::string, std::string>& d);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_STATE_VALUE_H_
