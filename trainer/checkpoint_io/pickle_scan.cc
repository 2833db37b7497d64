#include "trainer/checkpoint_io/pickle_scan.h"

#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "base/errors.h"

namespace shardtrain::trainer {
namespace {

// What follows an opcode.
enum class Arg {
  kNone,
  kStop,
  kFixed,      // `n` bytes
  kLine,       // text up to '\n'
  kTwoLines,   // GLOBAL, INST: module and name lines
  kLen,        // an unsigned little-endian length of `n` bytes, then that many bytes
  kSignedLen,  // the same, signed 4 bytes (BINSTRING, LONG4)
  kFrame,      // an 8-byte frame length; the frame's opcodes follow
  kPut,        // a memo index of `n` bytes to store at
  kGet,        // a memo index of `n` bytes to read
  kPutLine,    // PUT: a decimal memo index up to '\n'
  kMemoize,    // MEMOIZE: the next memo index, implicitly
};

struct Op {
  const char* name = nullptr;  // null: not an opcode
  Arg arg = Arg::kNone;
  int n = 0;
};

struct Table {
  Op ops[256];
  void Set(unsigned char code, const char* name, Arg arg, int n = 0) { ops[code] = Op{name, arg, n}; }
  Table() {
    // Protocols 0 and 1.
    Set('(', "MARK", Arg::kNone);
    Set('.', "STOP", Arg::kStop);
    Set('0', "POP", Arg::kNone);
    Set('1', "POP_MARK", Arg::kNone);
    Set('2', "DUP", Arg::kNone);
    Set('F', "FLOAT", Arg::kLine);
    Set('I', "INT", Arg::kLine);
    Set('J', "BININT", Arg::kFixed, 4);
    Set('K', "BININT1", Arg::kFixed, 1);
    Set('L', "LONG", Arg::kLine);
    Set('M', "BININT2", Arg::kFixed, 2);
    Set('N', "NONE", Arg::kNone);
    Set('P', "PERSID", Arg::kLine);
    Set('Q', "BINPERSID", Arg::kNone);
    Set('R', "REDUCE", Arg::kNone);
    Set('S', "STRING", Arg::kLine);
    Set('T', "BINSTRING", Arg::kSignedLen, 4);
    Set('U', "SHORT_BINSTRING", Arg::kLen, 1);
    Set('V', "UNICODE", Arg::kLine);
    Set('X', "BINUNICODE", Arg::kLen, 4);
    Set('a', "APPEND", Arg::kNone);
    Set('b', "BUILD", Arg::kNone);
    Set('c', "GLOBAL", Arg::kTwoLines);
    Set('d', "DICT", Arg::kNone);
    Set('}', "EMPTY_DICT", Arg::kNone);
    Set('e', "APPENDS", Arg::kNone);
    Set('g', "GET", Arg::kLine);
    Set('h', "BINGET", Arg::kGet, 1);
    Set('i', "INST", Arg::kTwoLines);
    Set('j', "LONG_BINGET", Arg::kGet, 4);
    Set('l', "LIST", Arg::kNone);
    Set(']', "EMPTY_LIST", Arg::kNone);
    Set('o', "OBJ", Arg::kNone);
    Set('p', "PUT", Arg::kPutLine);
    Set('q', "BINPUT", Arg::kPut, 1);
    Set('r', "LONG_BINPUT", Arg::kPut, 4);
    Set('s', "SETITEM", Arg::kNone);
    Set('t', "TUPLE", Arg::kNone);
    Set(')', "EMPTY_TUPLE", Arg::kNone);
    Set('u', "SETITEMS", Arg::kNone);
    Set('G', "BINFLOAT", Arg::kFixed, 8);
    // Protocol 2.
    Set(0x80, "PROTO", Arg::kFixed, 1);
    Set(0x81, "NEWOBJ", Arg::kNone);
    Set(0x82, "EXT1", Arg::kFixed, 1);
    Set(0x83, "EXT2", Arg::kFixed, 2);
    Set(0x84, "EXT4", Arg::kFixed, 4);
    Set(0x85, "TUPLE1", Arg::kNone);
    Set(0x86, "TUPLE2", Arg::kNone);
    Set(0x87, "TUPLE3", Arg::kNone);
    Set(0x88, "NEWTRUE", Arg::kNone);
    Set(0x89, "NEWFALSE", Arg::kNone);
    Set(0x8a, "LONG1", Arg::kLen, 1);
    Set(0x8b, "LONG4", Arg::kSignedLen, 4);
    // Protocol 3.
    Set('B', "BINBYTES", Arg::kLen, 4);
    Set('C', "SHORT_BINBYTES", Arg::kLen, 1);
    // Protocol 4.
    Set(0x8c, "SHORT_BINUNICODE", Arg::kLen, 1);
    Set(0x8d, "BINUNICODE8", Arg::kLen, 8);
    Set(0x8e, "BINBYTES8", Arg::kLen, 8);
    Set(0x8f, "EMPTY_SET", Arg::kNone);
    Set(0x90, "ADDITEMS", Arg::kNone);
    Set(0x91, "FROZENSET", Arg::kNone);
    Set(0x92, "NEWOBJ_EX", Arg::kNone);
    Set(0x93, "STACK_GLOBAL", Arg::kNone);
    Set(0x94, "MEMOIZE", Arg::kMemoize);
    Set(0x95, "FRAME", Arg::kFrame, 8);
    // Protocol 5.
    Set(0x96, "BYTEARRAY8", Arg::kLen, 8);
    Set(0x97, "NEXT_BUFFER", Arg::kNone);
    Set(0x98, "READONLY_BUFFER", Arg::kNone);
  }
};

const Table& Ops() {
  static const Table table;
  return table;
}

uint64_t LittleEndian(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

class Scanner {
 public:
  Scanner(const char* data, size_t size, const std::string& file)
      : p_(reinterpret_cast<const unsigned char*>(data)), size_(size), file_(file) {}

  // `spans`, where not null, receives each opcode's [start, end).
  void Run(std::vector<std::pair<size_t, size_t>>* spans) {
    while (pos_ < size_) {
      op_at_ = pos_;
      code_ = p_[pos_++];
      const Op& op = Ops().ops[code_];
      name_ = op.name ? op.name : "(unknown)";
      if (!op.name) Fail("is not an opcode of pickle protocols 0-5");
      const bool stop = Step(op);
      if (spans) spans->emplace_back(op_at_, pos_);
      if (stop) return;
    }
    op_at_ = size_;
    name_ = nullptr;
    Fail("the pickle ends without STOP");
  }

 private:
  // One opcode's argument; true at STOP.
  bool Step(const Op& op) {
    switch (op.arg) {
      case Arg::kStop: return true;
      case Arg::kNone: return false;
      case Arg::kFixed: Need(op.n, "its argument"); pos_ += op.n; return false;
      case Arg::kLine: Line(); return false;
      case Arg::kTwoLines: Line(); Line(); return false;
      case Arg::kLen: Payload(Field(op.n, false, true)); return false;
      case Arg::kSignedLen: Payload(Field(op.n, true, true)); return false;
      case Arg::kFrame: Field(op.n, false, true); return false;  // its opcodes follow and are scanned
      case Arg::kPut: Memo(Field(op.n, false, false)); return false;
      case Arg::kGet: {
        const uint64_t index = Field(op.n, false, false);
        if (index >= memo_) {
          Fail(internal::StrCat("reads memo entry ", index, " but only ", memo_, " entries were stored before it"));
        }
        return false;
      }
      case Arg::kPutLine: {
        const size_t start = pos_;
        Line();
        Memo(std::strtoull(reinterpret_cast<const char*>(p_ + start), nullptr, 10));
        return false;
      }
      case Arg::kMemoize: ++memo_; return false;
    }
    return false;
  }

  // Reads an n-byte little-endian field; a length (`is_length`) must fit in what follows it.
  uint64_t Field(int n, bool is_signed, bool is_length) {
    Need(n, "its argument");
    uint64_t v = LittleEndian(p_ + pos_, n);
    pos_ += n;
    if (is_signed && (v & 0x80000000u)) {
      Fail(internal::StrCat("declares a negative length (", static_cast<int64_t>(static_cast<int32_t>(v)),
                            "); valid: 0..", size_ - pos_, " (the bytes that follow it)"));
    }
    if (is_length && v > size_ - pos_) {
      Fail(internal::StrCat("declares ", v, " bytes but only ", size_ - pos_, " of the pickle's ", size_,
                            " bytes follow it; valid: a length that fits in the pickle"));
    }
    return v;
  }
  void Payload(uint64_t n) {
    Need(n, "the bytes it declares");
    pos_ += n;
  }
  void Line() {
    const void* nl = std::memchr(p_ + pos_, '\n', size_ - pos_);
    if (!nl) Fail("has no end of line ('\\n') before the end of the pickle");
    pos_ = static_cast<size_t>(static_cast<const unsigned char*>(nl) - p_) + 1;
  }
  // LibTorch appends each memo entry whatever its index says, but first
  // reserves a table of 1 + 2 * index entries: an index is refused when no
  // pickle of this size could hold that many entries (each takes a byte).
  void Memo(uint64_t index) {
    if (index >= size_) {
      Fail(internal::StrCat("stores memo entry ", index, ", more entries than a pickle of ", size_,
                            " bytes can hold; valid: 0..", size_ - 1));
    }
    ++memo_;
  }
  void Need(uint64_t n, const char* what) {
    if (n > size_ - pos_) {
      Fail(internal::StrCat("needs ", n, " bytes for ", what, " but only ", size_ - pos_, " of the pickle's ", size_,
                            " bytes follow it"));
    }
  }
  [[noreturn]] void Fail(const std::string& why) const {
    char code[8];
    std::snprintf(code, sizeof code, "0x%02x", code_);
    if (!name_) ST_THROW(Error, file_, " is corrupt: at byte ", op_at_, " of ", size_, ": ", why);
    ST_THROW(Error, file_, " is corrupt: at byte ", op_at_, " of ", size_, ", opcode ", name_, " (", code, ") ", why,
             "; refusing to unpickle it");
  }

  const unsigned char* p_;
  const size_t size_;
  const std::string& file_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  unsigned char code_ = 0;
  const char* name_ = nullptr;
  uint64_t memo_ = 0;
};

}  // namespace

void ScanPickle(const char* data, size_t size, const std::string& file) { Scanner(data, size, file).Run(nullptr); }

namespace {

// For each BUILD opcode (by span index), the span index where the state it
// applies begins: a simulation of where each stack entry's opcodes start.
// Empty when an opcode's stack effect is not known here.
std::map<size_t, size_t> BuildStateStarts(const char* data, const std::vector<std::pair<size_t, size_t>>& spans) {
  struct Entry {
    size_t start;
    bool mark;
  };
  std::vector<Entry> st;
  std::map<size_t, size_t> out;
  auto pop_to_mark = [&]() -> std::optional<size_t> {
    while (!st.empty() && !st.back().mark) st.pop_back();
    if (st.empty()) return std::nullopt;
    const size_t start = st.back().start;
    st.pop_back();
    return start;
  };
  auto pop = [&](size_t n) -> std::optional<size_t> {
    if (st.size() < n) return std::nullopt;
    const size_t start = st[st.size() - n].start;
    st.resize(st.size() - n);
    return start;
  };
  static const std::string kPush1 =
      std::string("NIJKMLFGSTUVXBC]})cghjP2") + '\x88' + '\x89' + '\x8a' + '\x8b' + '\x8c' + '\x8d' + '\x8e' + '\x8f';
  static const std::string kNone = std::string("pqr.") + '\x80' + '\x94' + '\x95';
  for (size_t i = 0; i < spans.size(); ++i) {
    const char c = data[spans[i].first];
    std::optional<size_t> start = i;
    if (kPush1.find(c) != std::string::npos) {
      st.push_back({i, false});
    } else if (kNone.find(c) != std::string::npos) {
    } else if (c == '(') {
      st.push_back({i, true});
    } else if (c == 't' || c == 'l' || c == 'd' || c == '\x91') {
      if ((start = pop_to_mark())) st.push_back({*start, false});
    } else if (c == 'e' || c == 'u' || c == '\x90') {
      start = pop_to_mark();
    } else if (c == 'a' || c == '0') {
      start = pop(1);
    } else if (c == 'b') {
      if ((start = pop(1))) out[i] = *start;
    } else if (c == 's') {
      start = pop(2);
    } else if (c == 'R' || c == '\x81' || c == '\x93' || c == '\x86') {
      if ((start = pop(2))) st.push_back({*start, false});
    } else if (c == 'Q' || c == '\x85') {
      if ((start = pop(1))) st.push_back({*start, false});
    } else if (c == '\x87') {
      if ((start = pop(3))) st.push_back({*start, false});
    } else {
      return {};  // an opcode not simulated here
    }
    if (!start) return {};
  }
  return out;
}

}  // namespace

std::string PlainDictsForLibTorch(const char* data, size_t size, const std::string& file) {
  std::vector<std::pair<size_t, size_t>> spans;
  Scanner(data, size, file).Run(&spans);
  static const std::string kOrderedDict = "ccollections\nOrderedDict\n";
  auto text = [&](const std::pair<size_t, size_t>& sp) { return std::string(data + sp.first, sp.second - sp.first); };
  auto memo_index = [&](const std::pair<size_t, size_t>& sp) -> int64_t {  // PUT/GET variants' index
    const char c = data[sp.first];
    const auto* p = reinterpret_cast<const unsigned char*>(data + sp.first + 1);
    if (c == 'q' || c == 'h') return p[0];
    if (c == 'r' || c == 'j') return static_cast<int64_t>(LittleEndian(p, 4));
    if (c == 'p' || c == 'g') return std::strtoll(data + sp.first + 1, nullptr, 10);
    return -1;
  };
  auto is_put = [&](char c) { return c == 'q' || c == 'r' || c == 'p'; };
  auto is_get = [&](char c) { return c == 'h' || c == 'j' || c == 'g'; };
  // BUILD applies a state LibTorch cannot (an OrderedDict's "_metadata"):
  // drop the state's opcodes and BUILD itself, unless a later GET reads a
  // memo entry they store.
  std::vector<bool> drop(spans.size(), false);
  for (const auto& [build, start] : BuildStateStarts(data, spans)) {
    std::set<int64_t> puts;
    for (size_t k = start; k <= build; ++k) {
      if (is_put(data[spans[k].first])) puts.insert(memo_index(spans[k]));
    }
    bool read_later = false;
    for (size_t k = build + 1; k < spans.size() && !read_later; ++k) {
      read_later = is_get(data[spans[k].first]) && puts.count(memo_index(spans[k]));
    }
    if (read_later) continue;
    for (size_t k = start; k <= build; ++k) drop[k] = true;
  }
  std::set<int64_t> od_memo;  // memo entries that hold the OrderedDict class
  std::string out;
  bool changed = false;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (drop[i]) {
      changed = true;
      continue;
    }
    const char c = data[spans[i].first];
    const bool od_global = c == 'c' && text(spans[i]) == kOrderedDict;
    const bool od_get = is_get(c) && od_memo.count(memo_index(spans[i]));
    if (od_global || od_get) {
      // OrderedDict [PUT k] EMPTY_TUPLE REDUCE -> EMPTY_DICT (LibTorch reads the
      // class as None and then fails on the dict's items).
      size_t j = i + 1;
      if (j < spans.size() && is_put(data[spans[j].first])) {
        if (od_global) od_memo.insert(memo_index(spans[j]));
        ++j;
      }
      if (j + 1 < spans.size() && data[spans[j].first] == ')' && data[spans[j + 1].first] == 'R') {
        out += '}';  // EMPTY_DICT
        i = j + 1;
        changed = true;
        continue;
      }
    }
    out.append(data + spans[i].first, spans[i].second - spans[i].first);
  }
  return changed ? out : std::string();
}

void ScanPickleArchive(const std::vector<char>& zip, const std::string& file) {
  at::DataPtr pickle;
  size_t size = 0;
  try {
    std::istringstream in(std::string(zip.begin(), zip.end()));
    caffe2::serialize::PyTorchStreamReader reader(&in);
    std::tie(pickle, size) = reader.getRecord("data.pkl");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    ST_THROW(Error, file, " is not a readable torch.save archive (", zip.size(), " bytes): ",
             what.substr(0, what.find('\n')));
  }
  ScanPickle(static_cast<const char*>(pickle.get()), size, file + " (data.pkl)");
}

}  // namespace shardtrain::trainer
