// Rendering of the Jinja subset: scopes as jinja2 keeps them (a loop
// iteration is a scope, `if` is not), Python's operators on the values, and
// the filters, tests, methods and globals chat templates call.
#include <algorithm>
#include <cmath>
#include <ctime>

#include "base/errors.h"
#include "examples/llama/jinja.h"

namespace shardtrain::examples::llama::jinja {

namespace {

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  Renderer(const std::map<std::string, Value>& globals, const std::string& origin) : origin_(origin) {
    scopes_.emplace_back();
    for (const char* f : {"raise_exception", "namespace", "dict", "range", "strftime_now"})
      scopes_.back()[f] = Value::Function(f);
    scopes_.push_back(globals);
  }

  Flow Exec(const Body& body, std::string& out) {
    for (const Node& n : body) {
      line_ = n.line;
      Flow f = Flow::kNormal;
      switch (n.kind) {
        case Node::kText:
          out += n.text;
          break;
        case Node::kOutput:
          out += ToString(Eval(*n.expr));
          break;
        case Node::kIf:
          for (const auto& [cond, b] : n.branches) {
            if (!cond || Truthy(Eval(*cond))) {
              f = Exec(b, out);
              break;
            }
          }
          break;
        case Node::kFor:
          ExecFor(n, out);
          break;
        case Node::kSet:
          ExecSet(n);
          break;
        case Node::kBreak:
          return Flow::kBreak;
        case Node::kContinue:
          return Flow::kContinue;
      }
      if (out.size() > kMaxTextBytes) Fail("the output exceeds " + std::to_string(kMaxTextBytes) + " bytes");
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

 private:
  [[noreturn]] void Fail(const std::string& what) const {
    ST_THROW(InvalidArgumentError, origin_, ": line ", line_, ": ", what);
  }
  std::function<void(const std::string&)> Failer() const {
    return [this](const std::string& what) { Fail(what); };
  }

  Value Lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s) {
      const auto it = s->find(name);
      if (it != s->end()) return it->second;
    }
    return Value::Undefined(name);
  }

  void Bind(const std::vector<std::string>& targets, const Value& item) {
    if (targets.size() == 1) {
      scopes_.back()[targets[0]] = item;
      return;
    }
    if (item.kind != Value::kList || item.list->size() != targets.size())
      Fail("cannot unpack " + TypeName(item) + " into " + std::to_string(targets.size()) + " loop variables");
    for (size_t k = 0; k < targets.size(); ++k) scopes_.back()[targets[k]] = (*item.list)[k];
  }

  // Counts work against kMaxSteps, so that loops with empty bodies are bounded too.
  void Step(int64_t steps) {
    steps_ += steps;
    if (steps_ > kMaxSteps) Fail("the template runs over " + std::to_string(kMaxSteps) + " steps");
  }

  void ExecFor(const Node& n, std::string& out) {
    std::vector<Value> items;
    for (const Value& item : Iterate(Eval(*n.expr), Failer())) {
      if (n.filter) {
        scopes_.emplace_back();
        Bind(n.targets, item);
        const bool keep = Truthy(Eval(*n.filter));
        scopes_.pop_back();
        if (!keep) continue;
      }
      items.push_back(item);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      Step(kStepsPerIteration);
      scopes_.emplace_back();
      Bind(n.targets, items[k]);
      Dict loop = {{"index", Value::Int(k + 1)},
                   {"index0", Value::Int(k)},
                   {"revindex", Value::Int(len - k)},
                   {"revindex0", Value::Int(len - k - 1)},
                   {"first", Value::Bool(k == 0)},
                   {"last", Value::Bool(k == len - 1)},
                   {"length", Value::Int(len)},
                   {"depth", Value::Int(1)},
                   {"depth0", Value::Int(0)},
                   {"previtem", k > 0 ? items[k - 1] : Value::Undefined("loop.previtem")},
                   {"nextitem", k + 1 < len ? items[k + 1] : Value::Undefined("loop.nextitem")}};
      scopes_.back()["loop"] = Value::MakeDict(std::move(loop));
      const Flow f = Exec(n.body, out);
      scopes_.pop_back();
      if (f == Flow::kBreak) break;
    }
    if (len == 0) Exec(n.else_body, out);
  }

  void ExecSet(const Node& n) {
    Value v;
    if (n.expr) {
      v = Eval(*n.expr);
    } else {
      std::string captured;
      Exec(n.body, captured);
      v = Value::Str(captured);
    }
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = v;
      return;
    }
    const Value ns = Lookup(n.targets[0]);
    if (ns.kind != Value::kNamespace)
      Fail("cannot set attribute '" + n.targets[1] + "' of " + TypeName(ns) + " '" + n.targets[0] +
           "' (only a namespace() takes {% set ns.attr = ... %})");
    for (auto& [k, old] : *ns.dict) {
      if (k == n.targets[1]) {
        old = v;
        return;
      }
    }
    ns.dict->emplace_back(n.targets[1], v);
  }

  Value Eval(const Expr& e) {
    line_ = e.line != 0 ? e.line : line_;
    Step(1);
    switch (e.op) {
      case Expr::kLiteral:
        return e.value;
      case Expr::kName:
        return Lookup(e.name);
      case Expr::kAttr:
        return GetAttr(Eval(*e.args[0]), e.name, *e.args[0]);
      case Expr::kItem:
        return GetItem(Eval(*e.args[0]), Eval(*e.args[1]));
      case Expr::kSlice:
        return Slice(e);
      case Expr::kCall:
        return Call(e);
      case Expr::kFilter: {
        const Value in = Eval(*e.args[0]);
        std::vector<Value> args;
        for (size_t k = 1; k < e.args.size(); ++k) args.push_back(Eval(*e.args[k]));
        std::map<std::string, Value> kwargs;
        for (const auto& [k, v] : e.kwargs) kwargs[k] = Eval(*v);
        return ApplyFilter(e.name, in, args, kwargs, Failer());
      }
      case Expr::kTest: {
        const Value in = Eval(*e.args[0]);
        std::vector<Value> args;
        for (size_t k = 1; k < e.args.size(); ++k) args.push_back(Eval(*e.args[k]));
        return Value::Bool(ApplyTest(e.name, in, args, Failer()) != e.negate);
      }
      case Expr::kUnary:
        return Unary(e);
      case Expr::kBinary:
        return Binary(e);
      case Expr::kCond:
        if (Truthy(Eval(*e.args[1]))) return Eval(*e.args[0]);
        return e.args[2] ? Eval(*e.args[2]) : Value::Undefined("");
      case Expr::kList: {
        List l;
        for (const ExprPtr& a : e.args) l.push_back(Eval(*a));
        return Value::MakeList(std::move(l));
      }
      case Expr::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          const Value key = Eval(*e.args[k]);
          if (key.kind != Value::kString) Fail("dict keys must be strings here, not " + TypeName(key));
          d.emplace_back(key.s, Eval(*e.args[k + 1]));
        }
        return Value::MakeDict(std::move(d));
      }
    }
    return Value::None();
  }

  [[noreturn]] void FailUndefined(const Value& v) const {
    Fail("'" + (v.s.empty() ? std::string("value") : v.s) + "' is undefined");
  }

  Value GetAttr(const Value& obj, const std::string& name, const Expr& of) {
    if (obj.kind == Value::kUndefined) FailUndefined(obj);
    if (const Value* v = obj.Find(name)) return *v;
    (void)of;
    return Value::Undefined(name);
  }

  Value GetItem(const Value& obj, const Value& key) {
    if (obj.kind == Value::kUndefined) FailUndefined(obj);
    if (key.kind == Value::kString) {
      if (const Value* v = obj.Find(key.s)) return *v;
      return Value::Undefined(key.s);
    }
    if (key.kind != Value::kInt && key.kind != Value::kBool) return Value::Undefined("");
    const int64_t i = key.kind == Value::kBool ? key.b : key.i;
    if (obj.kind == Value::kList) {
      const int64_t n = static_cast<int64_t>(obj.list->size()), k = i < 0 ? i + n : i;
      return k >= 0 && k < n ? (*obj.list)[k] : Value::Undefined("[" + std::to_string(i) + "]");
    }
    if (obj.kind == Value::kString) {
      const std::vector<std::string> cps = CodePoints(obj.s);
      const int64_t n = static_cast<int64_t>(cps.size()), k = i < 0 ? i + n : i;
      return k >= 0 && k < n ? Value::Str(cps[k]) : Value::Undefined("[" + std::to_string(i) + "]");
    }
    return Value::Undefined("");
  }

  Value Slice(const Expr& e) {
    const Value obj = Eval(*e.args[0]);
    auto part = [&](int k, int64_t dflt) {
      if (!e.args[k]) return dflt;
      const Value v = Eval(*e.args[k]);
      if (v.kind == Value::kNone) return dflt;
      if (v.kind != Value::kInt) Fail("slice indices must be integers, not " + TypeName(v));
      return v.i;
    };
    std::vector<Value> items;
    const bool is_string = obj.kind == Value::kString;
    if (is_string) {
      for (std::string& c : CodePoints(obj.s)) items.push_back(Value::Str(std::move(c)));
    } else if (obj.kind == Value::kList) {
      items = *obj.list;
    } else {
      Fail("cannot slice " + TypeName(obj));
    }
    const int64_t n = static_cast<int64_t>(items.size()), step = part(3, 1);
    if (step == 0) Fail("slice step cannot be zero");
    auto clamp = [&](int64_t i, int64_t lo, int64_t hi) { return std::clamp(i < 0 ? i + n : i, lo, hi); };
    const int64_t start = step > 0 ? clamp(part(1, 0), 0, n) : clamp(part(1, n - 1), -1, n - 1);
    const int64_t stop = step > 0 ? clamp(part(2, n), 0, n) : (e.args[2] ? clamp(part(2, -n - 1), -1, n - 1) : -1);
    std::vector<Value> out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(items[i]);
    if (!is_string) return Value::MakeList(std::move(out));
    std::string s;
    for (const Value& c : out) s += c.s;
    return Value::Str(s);
  }

  Value Call(const Expr& e);
  Value Unary(const Expr& e);
  int64_t IntOp(const std::string& op, int64_t x, int64_t y);
  Value Binary(const Expr& e);
  Value Arith(const std::string& op, const Value& a, const Value& b);
  bool Less(const Value& a, const Value& b);

  std::vector<std::map<std::string, Value>> scopes_;
  const std::string& origin_;
  int line_ = 0;
  int64_t steps_ = 0;
};

Value Renderer::Call(const Expr& e) {
  std::vector<Value> args;
  for (size_t k = 1; k < e.args.size(); ++k) args.push_back(Eval(*e.args[k]));
  const Expr& callee = *e.args[0];
  if (callee.op == Expr::kAttr) {
    const Value self = Eval(*callee.args[0]);
    if (self.kind == Value::kUndefined) FailUndefined(self);
    if (self.kind == Value::kString || self.kind == Value::kDict) return CallMethod(self, callee.name, args, Failer());
    Fail("'" + callee.name + "' of " + TypeName(self) + " is not callable");
  }
  const Value f = Eval(callee);
  if (f.kind == Value::kUndefined) FailUndefined(f);
  if (f.kind != Value::kFunction) Fail("'" + TypeName(f) + "' object is not callable");
  const std::string& name = f.s;
  Dict kwargs;
  for (const auto& [k, v] : e.kwargs) kwargs.emplace_back(k, Eval(*v));
  line_ = e.line;
  if (name == "raise_exception") {
    Fail("the chat template raised an exception: " + (args.empty() ? std::string() : ToString(args[0])));
  }
  if (name == "namespace" || name == "dict") {
    if (!args.empty() && args[0].kind == Value::kDict)
      kwargs.insert(kwargs.begin(), args[0].dict->begin(), args[0].dict->end());
    return Value::MakeDict(std::move(kwargs), name == "namespace" ? Value::kNamespace : Value::kDict);
  }
  if (name == "range") {
    if (args.empty() || args.size() > 3) Fail("range() takes 1 to 3 integers, not " + std::to_string(args.size()));
    for (const Value& a : args)
      if (a.kind != Value::kInt) Fail("range() takes integers, not " + TypeName(a));
    const int64_t start = args.size() > 1 ? args[0].i : 0, stop = args.size() > 1 ? args[1].i : args[0].i;
    const int64_t step = args.size() > 2 ? args[2].i : 1;
    if (step == 0) Fail("range() step cannot be zero");
    const double n = (static_cast<double>(stop) - static_cast<double>(start)) / static_cast<double>(step);
    if (n > kMaxItems) Fail("range() of more than " + std::to_string(kMaxItems) + " items");
    List l;
    for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
      l.push_back(Value::Int(i));
      if (__builtin_add_overflow(i, step, &i)) break;  // past the int64 range is past stop
    }
    return Value::MakeList(std::move(l));
  }
  if (name == "strftime_now") {
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof(buf), args.empty() ? "" : ToString(args[0]).c_str(), &tm);
    return Value::Str(std::string(buf, n));
  }
  Fail("'" + name + "' is not callable here");
}

Value Renderer::Unary(const Expr& e) {
  const Value v = Eval(*e.args[0]);
  if (e.name == "not") return Value::Bool(!Truthy(v));
  if (v.kind == Value::kFloat) return Value::Float(e.name == "-" ? -v.f : v.f);
  if (v.kind == Value::kInt || v.kind == Value::kBool) {
    const int64_t i = v.kind == Value::kBool ? v.b : v.i;
    return Value::Int(e.name == "-" ? IntOp("-", 0, i) : i);
  }
  Fail("bad operand type for unary " + e.name + ": " + TypeName(v));
}

bool Renderer::Less(const Value& a, const Value& b) {
  const bool na = a.kind == Value::kInt || a.kind == Value::kFloat || a.kind == Value::kBool;
  const bool nb = b.kind == Value::kInt || b.kind == Value::kFloat || b.kind == Value::kBool;
  auto num = [](const Value& v) { return v.kind == Value::kFloat ? v.f : v.kind == Value::kBool ? v.b : v.i; };
  if (na && nb) {
    if (a.kind != Value::kFloat && b.kind != Value::kFloat)
      return (a.kind == Value::kBool ? a.b : a.i) < (b.kind == Value::kBool ? b.b : b.i);
    return num(a) < num(b);
  }
  if (a.kind == Value::kString && b.kind == Value::kString) return a.s < b.s;
  if (a.kind == Value::kList && b.kind == Value::kList) {
    for (size_t k = 0; k < std::min(a.list->size(), b.list->size()); ++k) {
      if (Less((*a.list)[k], (*b.list)[k])) return true;
      if (Less((*b.list)[k], (*a.list)[k])) return false;
    }
    return a.list->size() < b.list->size();
  }
  Fail("'<' is not supported between " + TypeName(a) + " and " + TypeName(b));
}

Value Renderer::Binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and" || op == "or") {
    Value a = Eval(*e.args[0]);
    if (Truthy(a) == (op == "or")) return a;
    return Eval(*e.args[1]);
  }
  const Value a = Eval(*e.args[0]), b = Eval(*e.args[1]);
  line_ = e.line;
  if (op == "==") return Value::Bool(Equal(a, b));
  if (op == "!=") return Value::Bool(!Equal(a, b));
  if (op == "<") return Value::Bool(Less(a, b));
  if (op == ">") return Value::Bool(Less(b, a));
  if (op == "<=") return Value::Bool(!Less(b, a));
  if (op == ">=") return Value::Bool(!Less(a, b));
  if (op == "in" || op == "not in") return Value::Bool(ApplyTest("in", a, {b}, Failer()) == (op == "in"));
  const Value v = op == "~" ? Value::Str(ToString(a) + ToString(b)) : Arith(op, a, b);
  if ((v.kind == Value::kString && v.s.size() > kMaxTextBytes) ||
      (v.kind == Value::kList && static_cast<int64_t>(v.list->size()) > kMaxItems))
    Fail("'" + op + "' builds a value over the bounds of a template (" + std::to_string(kMaxTextBytes) + " bytes, " +
         std::to_string(kMaxItems) + " items)");
  return v;
}

// Python's integer + - * // % ** (y > 0 for // and %, y >= 0 for **) in 64
// bits: a result past them fails instead of wrapping (Python's are unbounded).
int64_t Renderer::IntOp(const std::string& op, int64_t x, int64_t y) {
  int64_t r = 0;
  bool over = false;
  if (op == "+") {
    over = __builtin_add_overflow(x, y, &r);
  } else if (op == "-") {
    over = __builtin_sub_overflow(x, y, &r);
  } else if (op == "*") {
    over = __builtin_mul_overflow(x, y, &r);
  } else if (op == "**") {
    r = 1;
    for (int64_t base = x, n = y; n > 0 && !over; n >>= 1) {  // by squaring: y may be huge
      if (n & 1) over = __builtin_mul_overflow(r, base, &r);
      if (n > 1 && !over) over = __builtin_mul_overflow(base, base, &base);
    }
  } else if (x == INT64_MIN && y == -1) {
    over = op == "//";  // the one quotient past the range; its remainder is 0
  } else {
    const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)));  // Python floors
    r = op == "//" ? q : x - q * y;
  }
  if (over)
    Fail("integer " + std::to_string(x) + " " + op + " " + std::to_string(y) +
         " is past the 64-bit integers templates compute with here");
  return r;
}

Value Renderer::Arith(const std::string& op, const Value& a, const Value& b) {
  if (op == "+" && a.kind == Value::kString && b.kind == Value::kString) return Value::Str(a.s + b.s);
  if (op == "+" && a.kind == Value::kList && b.kind == Value::kList) {
    List l = *a.list;
    l.insert(l.end(), b.list->begin(), b.list->end());
    return Value::MakeList(std::move(l));
  }
  if (op == "*" && a.kind == Value::kString && b.kind == Value::kInt) {
    if (b.i > 0 && a.s.size() * static_cast<uint64_t>(b.i) > kMaxTextBytes) Fail("'*' builds a string over the bounds");
    std::string s;
    for (int64_t k = 0; k < b.i; ++k) s += a.s;
    return Value::Str(s);
  }
  auto is_num = [](const Value& v) {
    return v.kind == Value::kInt || v.kind == Value::kFloat || v.kind == Value::kBool;
  };
  if (!is_num(a) || !is_num(b))
    Fail("unsupported operand types for " + op + ": " + TypeName(a) + " and " + TypeName(b));
  auto as_int = [](const Value& v) { return v.kind == Value::kBool ? int64_t{v.b} : v.i; };
  auto as_double = [&](const Value& v) { return v.kind == Value::kFloat ? v.f : static_cast<double>(as_int(v)); };
  if (op == "/") {
    if (as_double(b) == 0) Fail("division by zero");
    return Value::Float(as_double(a) / as_double(b));
  }
  if (a.kind != Value::kFloat && b.kind != Value::kFloat) {
    const int64_t x = as_int(a), y = as_int(b);
    if ((op == "//" || op == "%") && y == 0) Fail("integer division or modulo by zero");
    if (op != "**" || y >= 0) return Value::Int(IntOp(op, x, y));
  }
  const double x = as_double(a), y = as_double(b);
  if ((op == "//" || op == "%") && y == 0) Fail("float division or modulo by zero");
  if (op == "+") return Value::Float(x + y);
  if (op == "-") return Value::Float(x - y);
  if (op == "*") return Value::Float(x * y);
  if (op == "//") return Value::Float(std::floor(x / y));
  if (op == "%") return Value::Float(x - std::floor(x / y) * y);
  return Value::Float(std::pow(x, y));
}

}  // namespace

std::string Render(const Body& body, const std::map<std::string, Value>& globals, const std::string& origin) {
  Renderer r(globals, origin);
  std::string out;
  r.Exec(body, out);
  return out;
}

}  // namespace shardtrain::examples::llama::jinja
