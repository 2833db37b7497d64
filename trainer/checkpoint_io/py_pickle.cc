#include "trainer/checkpoint_io/py_pickle.h"

#include <cstring>
#include <map>
#include <memory>

#include "base/errors.h"
#include "trainer/checkpoint_io/pickle_scan.h"

namespace shardtrain::trainer::py {
namespace {

void PutLE(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void DumpInto(const PyValue& v, std::string* out) {
  using K = PyValue::Kind;
  switch (v.kind) {
    case K::kNone:
      out->push_back('N');
      return;
    case K::kBool:
      out->push_back(static_cast<char>(v.b ? 0x88 : 0x89));
      return;
    case K::kInt:
      if (v.i >= 0 && v.i < 256) {
        out->push_back('K');
        PutLE(out, static_cast<uint64_t>(v.i), 1);
      } else if (v.i >= INT32_MIN && v.i <= INT32_MAX) {
        out->push_back('J');
        PutLE(out, static_cast<uint32_t>(static_cast<int32_t>(v.i)), 4);
      } else {
        out->push_back(static_cast<char>(0x8a));  // LONG1: 8 bytes, two's complement
        out->push_back(8);
        PutLE(out, static_cast<uint64_t>(v.i), 8);
      }
      return;
    case K::kFloat: {
      uint64_t bits = 0;
      std::memcpy(&bits, &v.f, 8);
      out->push_back('G');
      for (int i = 7; i >= 0; --i) out->push_back(static_cast<char>((bits >> (8 * i)) & 0xff));  // big-endian
      return;
    }
    case K::kStr:
    case K::kBytes:
      out->push_back(v.kind == K::kStr ? 'X' : 'B');
      PutLE(out, v.s.size(), 4);
      out->append(v.s);
      return;
    case K::kTuple:
      if (v.items.empty()) {
        out->push_back(')');
        return;
      }
      out->push_back('(');
      for (const auto& e : v.items) DumpInto(*e, out);
      out->push_back('t');
      return;
    case K::kList:
      out->push_back(']');
      if (v.items.empty()) return;
      out->push_back('(');
      for (const auto& e : v.items) DumpInto(*e, out);
      out->push_back('e');
      return;
    case K::kDict:
      out->push_back('}');
      if (v.entries.empty()) return;
      out->push_back('(');
      for (const auto& [k, e] : v.entries) {
        DumpInto(*k, out);
        DumpInto(*e, out);
      }
      out->push_back('u');
      return;
    case K::kGlobal:
      out->append("c" + v.s + "\n" + v.name + "\n");
      return;
    case K::kObject: {
      DumpInto(*v.callable, out);
      DumpInto(*v.args, out);
      out->push_back(static_cast<char>(v.newobj ? 0x81 : 'R'));
      if (v.state) {
        DumpInto(*v.state, out);
        out->push_back('b');
      }
      return;
    }
  }
}

class Parser {
 public:
  Parser(const char* data, size_t size, const std::string& file, PyArena* arena, size_t max_nodes)
      : p_(reinterpret_cast<const unsigned char*>(data)),
        size_(size),
        file_(file),
        a_(arena),
        max_nodes_(arena->size() + max_nodes) {}

  PyPtr Run() {
    while (true) {
      at_ = pos_;
      const unsigned char op = p_[pos_++];  // ScanPickle: every opcode and its argument lie inside, STOP included
      if (op == '.') break;
      Step(op);
      if (a_->size() > max_nodes_) Fail("limit", "more than ", max_nodes_, " values");
    }
    if (stack_.size() != 1 || !marks_.empty())
      Fail("STOP", "the pickle leaves ", stack_.size(), " values on its stack");
    return stack_.back();
  }

 private:
  template <typename... A>
  [[noreturn]] void Fail(const char* opname, const A&... what) {
    ST_THROW(Error, file_, ": pickle offset ", at_, " (", opname, "): ", what...);
  }

  uint64_t LE(int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p_[pos_ + i];
    pos_ += n;
    return v;
  }
  std::string Bytes(uint64_t n) {
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }
  std::string Line() {
    const size_t start = pos_;
    while (p_[pos_] != '\n') ++pos_;
    return std::string(reinterpret_cast<const char*>(p_ + start), pos_++ - start);
  }
  PyPtr Pop(const char* opname) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) Fail(opname, "pops from an empty stack");
    PyPtr v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::vector<PyPtr> PopMark(const char* opname) {
    if (marks_.empty()) Fail(opname, "needs a MARK and there is none");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyPtr> items(stack_.begin() + static_cast<ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  PyPtr& Top(const char* opname) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) Fail(opname, "needs a value on the stack");
    return stack_.back();
  }
  PyPtr Container(const char* opname, PyValue::Kind kind) {
    PyPtr& c = Top(opname);
    if (!c->Is(kind)) Fail(opname, "applies to a ", c->TypeName());
    return c;
  }
  void Push(PyPtr v) { stack_.push_back(std::move(v)); }

  // One opcode: a plain value or tuple (StepValue), else a container, global, object or memo operation.
  void Step(unsigned char op) {
    if (!StepValue(op)) StepStructure(op);
  }

  // Returns false for opcodes that are not plain values or tuples. Long by
  // design (tools/BUILD.bazel allows it): one short case per opcode.
  bool StepValue(unsigned char op) {
    switch (op) {
      case 0x80:
        pos_ += 1;
        return true;  // PROTO
      case 0x95:
        pos_ += 8;
        return true;  // FRAME: its opcodes follow
      case '(':
        marks_.push_back(stack_.size());
        return true;
      case 'N':
        Push(a_->None());
        return true;
      case 0x88:
        Push(a_->Bool(true));
        return true;
      case 0x89:
        Push(a_->Bool(false));
        return true;
      case 'K':
        Push(a_->Int(static_cast<int64_t>(LE(1))));
        return true;
      case 'M':
        Push(a_->Int(static_cast<int64_t>(LE(2))));
        return true;
      case 'J':
        Push(a_->Int(static_cast<int32_t>(static_cast<uint32_t>(LE(4)))));
        return true;
      case 0x8a: {  // LONG1
        const uint64_t n = LE(1);
        if (n > 8) Fail("LONG1", "an integer of ", n, " bytes (valid: up to 8, a signed 64-bit value)");
        uint64_t v = n ? LE(static_cast<int>(n)) : 0;
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
        Push(a_->Int(static_cast<int64_t>(v)));
        return true;
      }
      case 'G': {
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | p_[pos_ + i];
        pos_ += 8;
        double d = 0;
        std::memcpy(&d, &bits, 8);
        Push(a_->Float(d));
        return true;
      }
      case 0x8c:
        Push(a_->Str(Bytes(LE(1))));
        return true;  // SHORT_BINUNICODE
      case 'X':
        Push(a_->Str(Bytes(LE(4))));
        return true;  // BINUNICODE
      case 0x8d:
        Push(a_->Str(Bytes(LE(8))));
        return true;  // BINUNICODE8
      case 'C':
        Push(a_->Bytes(Bytes(LE(1))));
        return true;  // SHORT_BINBYTES
      case 'B':
        Push(a_->Bytes(Bytes(LE(4))));
        return true;  // BINBYTES
      case 0x8e:
        Push(a_->Bytes(Bytes(LE(8))));
        return true;  // BINBYTES8
      case ')':
        Push(a_->Tuple({}));
        return true;
      case 't':
        Push(a_->Tuple(PopMark("TUPLE")));
        return true;
      case 0x85:
      case 0x86:
      case 0x87: {
        const int n = op - 0x84;
        std::vector<PyPtr> items(n);
        for (int k = n - 1; k >= 0; --k) items[k] = Pop("TUPLEn");
        Push(a_->Tuple(std::move(items)));
        return true;
      }
      default:
        return false;
    }
  }

  // Long by design (tools/BUILD.bazel allows it): one short case per opcode.
  void StepStructure(unsigned char op) {
    using K = PyValue::Kind;
    switch (op) {
      case ']':
        Push(a_->List({}));
        return;
      case 'l':
        Push(a_->List(PopMark("LIST")));
        return;
      case 'a': {
        PyPtr v = Pop("APPEND");
        Container("APPEND", K::kList)->items.push_back(std::move(v));
        return;
      }
      case 'e': {
        std::vector<PyPtr> items = PopMark("APPENDS");
        auto& dst = Container("APPENDS", K::kList)->items;
        dst.insert(dst.end(), items.begin(), items.end());
        return;
      }
      case '}':
        Push(a_->Dict({}));
        return;
      case 'd':
      case 'u': {
        const char* name = op == 'd' ? "DICT" : "SETITEMS";
        std::vector<PyPtr> kv = PopMark(name);
        if (kv.size() % 2) Fail(name, "an odd number (", kv.size(), ") of keys and values");
        PyPtr d = op == 'd' ? a_->Dict({}) : Container(name, K::kDict);
        for (size_t k = 0; k < kv.size(); k += 2) d->entries.emplace_back(kv[k], kv[k + 1]);
        if (op == 'd') Push(d);
        return;
      }
      case 's': {
        PyPtr v = Pop("SETITEM");
        PyPtr k = Pop("SETITEM");
        Container("SETITEM", K::kDict)->entries.emplace_back(std::move(k), std::move(v));
        return;
      }
      case 'c': {
        std::string module = Line();
        Push(a_->Global(std::move(module), Line()));
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        PyPtr name = Pop("STACK_GLOBAL");
        PyPtr module = Pop("STACK_GLOBAL");
        if (!name->Is(K::kStr) || !module->Is(K::kStr)) Fail("STACK_GLOBAL", "module and name are not strings");
        Push(a_->Global(module->s, name->s));
        return;
      }
      case 'R':
      case 0x81: {
        const char* name = op == 'R' ? "REDUCE" : "NEWOBJ";
        PyPtr args = Pop(name);
        PyPtr callable = Pop(name);
        if (!args->Is(K::kTuple)) Fail(name, "its arguments are a ", args->TypeName(), ", not a tuple");
        if (!callable->Is(K::kGlobal)) Fail(name, "calls a ", callable->TypeName(), ", not a global");
        Push(a_->Object(callable, args, op == 0x81));
        return;
      }
      case 'b': {
        PyPtr state = Pop("BUILD");
        PyPtr obj = Container("BUILD", K::kObject);
        if (obj->state) Fail("BUILD", "the object ", obj->TypeName(), " was built already");
        obj->state = std::move(state);
        return;
      }
      case 0x94:
        memo_[memo_.size()] = Top("MEMOIZE");
        return;
      case 'q':
        memo_[LE(1)] = Top("BINPUT");
        return;
      case 'r':
        memo_[LE(4)] = Top("LONG_BINPUT");
        return;
      case 'h':
      case 'j': {
        const uint64_t index = LE(op == 'h' ? 1 : 4);
        auto it = memo_.find(index);
        if (it == memo_.end()) Fail("BINGET", "memo entry ", index, " was never stored");
        Push(it->second);
        return;
      }
      case '0':
        Pop("POP");
        return;
      case '1':
        PopMark("POP_MARK");
        return;
      case '2':
        Push(Top("DUP"));
        return;
      default:
        break;
    }
    Fail(("opcode 0x" + Hex(op)).c_str(),
         "is not one this reader takes (valid: the opcodes of plain values, "
         "globals, REDUCE, NEWOBJ, BUILD and the memo, as Python's pickle.dump writes them)");
  }

  static std::string Hex(unsigned char c) {
    static const char* d = "0123456789abcdef";
    return std::string{d[c >> 4], d[c & 15]};
  }

  const unsigned char* p_;
  size_t size_;
  const std::string& file_;
  PyArena* const a_;
  const size_t max_nodes_;
  size_t pos_ = 0, at_ = 0;
  std::vector<PyPtr> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, PyPtr> memo_;
};

}  // namespace

std::string PyValue::QualifiedName() const {
  if (kind == Kind::kGlobal) return s + "." + name;
  if (kind == Kind::kObject && callable) return callable->QualifiedName();
  return "";
}

std::string PyValue::TypeName() const {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kGlobal:
      return "global " + QualifiedName();
    case Kind::kObject:
      return QualifiedName() + " object";
  }
  return "?";
}

PyPtr PyValue::Find(const std::string& key) const {
  for (const auto& [k, v] : entries) {
    if (k->Is(Kind::kStr) && k->s == key) return v;
  }
  return nullptr;
}

PyPtr PyArena::New(PyValue::Kind kind) {
  nodes_.push_back(std::make_unique<PyValue>());
  nodes_.back()->kind = kind;
  return nodes_.back().get();
}
PyPtr PyArena::None() { return New((PyValue::Kind::kNone)); }
PyPtr PyArena::Bool(bool v) {
  PyPtr p = New((PyValue::Kind::kBool));
  p->b = v;
  return p;
}
PyPtr PyArena::Int(int64_t v) {
  PyPtr p = New((PyValue::Kind::kInt));
  p->i = v;
  return p;
}
PyPtr PyArena::Float(double v) {
  PyPtr p = New((PyValue::Kind::kFloat));
  p->f = v;
  return p;
}
PyPtr PyArena::Str(std::string v) {
  PyPtr p = New((PyValue::Kind::kStr));
  p->s = std::move(v);
  return p;
}
PyPtr PyArena::Bytes(std::string v) {
  PyPtr p = New((PyValue::Kind::kBytes));
  p->s = std::move(v);
  return p;
}
PyPtr PyArena::Tuple(std::vector<PyPtr> items) {
  PyPtr p = New((PyValue::Kind::kTuple));
  p->items = std::move(items);
  return p;
}
PyPtr PyArena::List(std::vector<PyPtr> items) {
  PyPtr p = New((PyValue::Kind::kList));
  p->items = std::move(items);
  return p;
}
PyPtr PyArena::Dict(std::vector<std::pair<PyPtr, PyPtr>> entries) {
  PyPtr p = New((PyValue::Kind::kDict));
  p->entries = std::move(entries);
  return p;
}
PyPtr PyArena::Global(std::string module, std::string name) {
  PyPtr p = New((PyValue::Kind::kGlobal));
  p->s = std::move(module);
  p->name = std::move(name);
  return p;
}
PyPtr PyArena::Object(PyPtr callable, PyPtr args, bool newobj, PyPtr state) {
  PyPtr p = New((PyValue::Kind::kObject));
  p->callable = callable;
  p->args = args;
  p->newobj = newobj;
  p->state = state;
  return p;
}

std::string Dumps(const PyValue& v) {
  std::string out = "\x80\x02";
  DumpInto(v, &out);
  out.push_back('.');
  return out;
}

PyPtr Loads(const char* data, size_t size, const std::string& file, PyArena* arena, size_t max_nodes) {
  ScanPickle(data, size, file);
  return Parser(data, size, file, arena, max_nodes).Run();
}

}  // namespace shardtrain::trainer::py
