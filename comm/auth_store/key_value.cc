// The authenticated store's operations, with c10d's TCPStore semantics:
// add() keeps a decimal string, compareSet() with an empty expected value
// creates a missing key, get/wait/multiGet wait for their keys.
#include "comm/auth_store/internal/key_value.h"

#include <charconv>
#include <limits>

namespace shardtrain::comm::auth_store {
namespace {

Outcome Malformed() {
  Outcome o;
  o.malformed = true;
  return o;
}

Outcome Reply(Bytes response, bool mutated = false) {
  Outcome o;
  o.response = std::move(response);
  o.mutated = mutated;
  return o;
}

Bytes Ok() { return Writer(static_cast<uint8_t>(Status::kOk)).Take(); }

Bytes Failure(const std::string& message) { return Writer(static_cast<uint8_t>(Status::kError)).Str(message).Take(); }

// A waiting request: its keys and the deadline from its timeout in ms (0 = none).
Outcome Wait(Op op, std::vector<std::string> keys, int64_t timeout_ms) {
  if (timeout_ms < 0) return Malformed();
  Outcome o;
  o.waiting = Waiting{op, std::move(keys), std::nullopt};
  if (timeout_ms > 0) o.waiting->deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  return o;
}

}  // namespace

Bytes KeyValueTable::TimedOut() { return Writer(static_cast<uint8_t>(Status::kTimeout)).Take(); }

Outcome KeyValueTable::Run(const Bytes& request) {
  Reader r(request);
  uint8_t op = 0;
  if (!r.U8(&op)) return Malformed();
  switch (static_cast<Op>(op)) {
    case Op::kSet: case Op::kDelete: case Op::kMultiSet: case Op::kAppend:
      return RunWrite(static_cast<Op>(op), r);
    case Op::kGet: case Op::kCheck: case Op::kWait: case Op::kNumKeys: case Op::kMultiGet:
      return RunRead(static_cast<Op>(op), r);
    case Op::kAdd:
      return Add(r);
    case Op::kCompareSet:
      return CompareSet(r);
  }
  return Malformed();  // an unknown operation
}

Outcome KeyValueTable::RunWrite(Op op, Reader& r) {
  std::string key;
  Bytes value;
  if (op == Op::kMultiSet) {
    std::vector<std::string> keys;
    uint32_t n = 0;
    if (!r.Keys(&keys) || !r.U32(&n) || n != keys.size()) return Malformed();
    std::vector<Bytes> values(n);
    for (auto& v : values) {
      if (!r.Blob(kMaxValueBytes, &v)) return Malformed();
    }
    if (!r.AtEnd()) return Malformed();
    for (size_t i = 0; i < keys.size(); ++i) values_[keys[i]] = std::move(values[i]);
    return Reply(Ok(), true);
  }
  if (!r.Str(kMaxKeyBytes, &key)) return Malformed();
  if (op == Op::kDelete) {
    if (!r.AtEnd()) return Malformed();
    const bool erased = values_.erase(key) > 0;
    return Reply(Writer(static_cast<uint8_t>(Status::kOk)).U8(erased ? 1 : 0).Take(), erased);
  }
  if (!r.Blob(kMaxValueBytes, &value) || !r.AtEnd()) return Malformed();
  if (op == Op::kSet) {
    values_[key] = std::move(value);
    return Reply(Ok(), true);
  }
  Bytes& stored = values_[key];  // kAppend
  if (stored.size() + value.size() > kMaxValueBytes) {
    return Reply(Failure("append to store key '" + key + "' would make it " +
                         std::to_string(stored.size() + value.size()) + " bytes; at most " +
                         std::to_string(kMaxValueBytes)));
  }
  Append(&stored, value);
  return Reply(Ok(), true);
}

Outcome KeyValueTable::RunRead(Op op, Reader& r) {
  if (op == Op::kNumKeys) {
    if (!r.AtEnd()) return Malformed();
    return Reply(Writer(static_cast<uint8_t>(Status::kOk)).I64(static_cast<int64_t>(values_.size())).Take());
  }
  std::vector<std::string> keys(1);
  if (op == Op::kGet ? !r.Str(kMaxKeyBytes, &keys[0]) : !r.Keys(&keys)) return Malformed();
  if (op == Op::kCheck) {
    if (!r.AtEnd()) return Malformed();
    bool all = true;
    for (const auto& k : keys) all = all && values_.count(k) > 0;
    return Reply(Writer(static_cast<uint8_t>(Status::kOk)).U8(all ? 1 : 0).Take());
  }
  int64_t timeout_ms = 0;
  if (!r.I64(&timeout_ms) || !r.AtEnd()) return Malformed();
  Outcome o = Wait(op, std::move(keys), timeout_ms);
  if (o.waiting) {
    if (auto done = TryFinish(*o.waiting)) return Reply(std::move(*done));
  }
  return o;
}

Outcome KeyValueTable::Add(Reader& r) {
  std::string key;
  int64_t delta = 0;
  if (!r.Str(kMaxKeyBytes, &key) || !r.I64(&delta) || !r.AtEnd()) return Malformed();
  int64_t current = 0;
  if (auto it = values_.find(key); it != values_.end()) {
    const char* begin = reinterpret_cast<const char*>(it->second.data());
    const char* end = begin + it->second.size();
    const auto [ptr, ec] = std::from_chars(begin, end, current);
    if (ec != std::errc() || ptr != end) {
      return Reply(Failure("add to store key '" + key + "': its value (" + std::to_string(it->second.size()) +
                           " bytes) is not a decimal integer; valid: a key written only by add()"));
    }
  }
  const bool overflow = (delta > 0 && current > std::numeric_limits<int64_t>::max() - delta) ||
                        (delta < 0 && current < std::numeric_limits<int64_t>::min() - delta);
  if (overflow) return Reply(Failure("add to store key '" + key + "' overflows a 64-bit integer"));
  current += delta;
  const std::string text = std::to_string(current);
  values_[key] = Bytes(text.begin(), text.end());
  return Reply(Writer(static_cast<uint8_t>(Status::kOk)).I64(current).Take(), true);
}

Outcome KeyValueTable::CompareSet(Reader& r) {
  std::string key;
  Bytes expected, desired;
  if (!r.Str(kMaxKeyBytes, &key) || !r.Blob(kMaxValueBytes, &expected) || !r.Blob(kMaxValueBytes, &desired) ||
      !r.AtEnd()) {
    return Malformed();
  }
  auto it = values_.find(key);
  Writer w(static_cast<uint8_t>(Status::kOk));
  if (it == values_.end()) {
    // c10d: a missing key is created only when `expected` is empty; else the
    // caller gets its own `expected` back.
    if (!expected.empty()) return Reply(w.Vec(expected).Take());
    values_[key] = desired;
    return Reply(w.Vec(desired).Take(), true);
  }
  const bool swap = it->second == expected;
  if (swap) it->second = std::move(desired);
  return Reply(w.Vec(it->second).Take(), swap);
}

std::optional<Bytes> KeyValueTable::TryFinish(const Waiting& waiting) const {
  size_t total = 0;
  for (const auto& k : waiting.keys) {
    auto it = values_.find(k);
    if (it == values_.end()) return std::nullopt;
    total += it->second.size() + 4;
  }
  Writer w(static_cast<uint8_t>(Status::kOk));
  if (waiting.op == Op::kWait) return w.Take();
  if (total + 16 > kMaxFrameBytes) {
    return Failure("the values of the " + std::to_string(waiting.keys.size()) + " keys asked for total " +
                   std::to_string(total) + " bytes; at most " + std::to_string(kMaxFrameBytes) + " in one response");
  }
  if (waiting.op == Op::kGet) return w.Vec(values_.at(waiting.keys[0])).Take();
  w.U32(static_cast<uint32_t>(waiting.keys.size()));
  for (const auto& k : waiting.keys) w.Vec(values_.at(k));
  return w.Take();
}

}  // namespace shardtrain::comm::auth_store
