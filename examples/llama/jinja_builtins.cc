// The filters, tests and str/dict methods chat templates call, with Python's
// truth, equality and iteration of values.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>

#include "examples/llama/jinja.h"

namespace shardtrain::examples::llama::jinja {
namespace {

const char* const kSpace = " \t\n\r\f\v";

std::string Strip(const std::string& s, const std::string& chars, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) b = s.find_first_not_of(chars);
  if (b == std::string::npos) return "";
  if (right) e = s.find_last_not_of(chars) + 1;
  return s.substr(b, e - b);
}

std::string MapChars(std::string s, int (*f)(int)) {
  for (char& c : s) c = static_cast<char>(f(static_cast<unsigned char>(c)));
  return s;
}

std::string Capitalize(const std::string& s) {
  std::string out = MapChars(s, ::tolower);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

std::string Title(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (char& c : out) {
    const unsigned char u = static_cast<unsigned char>(c);
    c = static_cast<char>(start ? std::toupper(u) : std::tolower(u));
    start = !std::isalnum(u);
  }
  return out;
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0, hit;
  for (int64_t n = 0; (count < 0 || n < count) && (hit = s.find(from, pos)) != std::string::npos; ++n) {
    out += s.substr(pos, hit - pos) + to;
    pos = hit + from.size();
  }
  return out + s.substr(pos);
}

List Split(const std::string& s, const Value* sep, int64_t maxsplit) {
  List out;
  if (sep == nullptr || sep->kind == Value::kNone) {  // runs of whitespace, none at the ends
    size_t pos = s.find_first_not_of(kSpace);
    while (pos != std::string::npos) {
      size_t end = s.find_first_of(kSpace, pos);
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) end = std::string::npos;
      out.push_back(Value::Str(s.substr(pos, end == std::string::npos ? std::string::npos : end - pos)));
      if (end == std::string::npos) break;
      pos = s.find_first_not_of(kSpace, end);
    }
    return out;
  }
  size_t pos = 0, hit;
  while ((maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) &&
         (hit = s.find(sep->s, pos)) != std::string::npos) {
    out.push_back(Value::Str(s.substr(pos, hit - pos)));
    pos = hit + sep->s.size();
  }
  out.push_back(Value::Str(s.substr(pos)));
  return out;
}

int64_t Length(const Value& v, const FailFn& fail) {
  switch (v.kind) {
    case Value::kString:
      return static_cast<int64_t>(CodePoints(v.s).size());
    case Value::kList:
      return static_cast<int64_t>(v.list->size());
    case Value::kDict:
    case Value::kNamespace:
      return static_cast<int64_t>(v.dict->size());
    case Value::kUndefined:
      return 0;
    default:
      Raise(fail, "object of type " + TypeName(v) + " has no length");
  }
}

const Value& Arg(const std::vector<Value>& args, const std::map<std::string, Value>& kwargs, size_t k,
                 const std::string& name, const Value& dflt) {
  if (k < args.size()) return args[k];
  const auto it = kwargs.find(name);
  return it == kwargs.end() ? dflt : it->second;
}

Value Attribute(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (true) {
    const size_t dot = path.find('.', pos);
    const Value* next = cur.Find(path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos));
    if (next == nullptr) return Value::Undefined(path);
    cur = *next;
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
  }
}

Value SelectAttr(const std::string& name, const Value& in, const std::vector<Value>& args, const FailFn& fail) {
  if (args.empty() || args[0].kind != Value::kString) Raise(fail, name + " needs an attribute name");
  List out;
  for (const Value& item : Iterate(in, fail)) {
    const Value attr = Attribute(item, args[0].s);
    const bool hit =
        args.size() < 2 ? Truthy(attr) : ApplyTest(ToString(args[1]), attr, {args.begin() + 2, args.end()}, fail);
    if (hit == (name == "selectattr")) out.push_back(item);
  }
  return Value::MakeList(std::move(out));
}

Value Map(const Value& in, const std::vector<Value>& args, const std::map<std::string, Value>& kwargs,
          const FailFn& fail) {
  List out;
  const auto attr = kwargs.find("attribute");
  for (const Value& item : Iterate(in, fail)) {
    if (attr != kwargs.end()) {
      Value v = Attribute(item, ToString(attr->second));
      const auto dflt = kwargs.find("default");
      out.push_back(v.kind == Value::kUndefined && dflt != kwargs.end() ? dflt->second : v);
    } else if (!args.empty()) {
      out.push_back(ApplyFilter(ToString(args[0]), item, {args.begin() + 1, args.end()}, {}, fail));
    } else {
      Raise(fail, "map needs a filter name or attribute=");
    }
  }
  return Value::MakeList(std::move(out));
}

Value FilterOnText(const std::string& name, const Value& in, const std::vector<Value>& args,
                   const std::map<std::string, Value>& kwargs, const FailFn& fail) {
  const std::string s = ToString(in);
  if (name == "trim") return Value::Str(Strip(s, args.empty() ? kSpace : ToString(args[0]), true, true));
  if (name == "upper") return Value::Str(MapChars(s, ::toupper));
  if (name == "lower") return Value::Str(MapChars(s, ::tolower));
  if (name == "capitalize") return Value::Str(Capitalize(s));
  if (name == "title") return Value::Str(Title(s));
  if (name == "string") return Value::Str(s);
  if (name == "replace") {
    if (args.size() < 2) Raise(fail, "replace needs the old and the new text");
    const Value count = Arg(args, kwargs, 2, "count", Value::Int(-1));
    return Value::Str(Replace(s, ToString(args[0]), ToString(args[1]), count.i));
  }
  if (name == "int" || name == "float") {
    char* end = nullptr;
    const double d = in.kind == Value::kInt     ? static_cast<double>(in.i)
                     : in.kind == Value::kFloat ? in.f
                     : in.kind == Value::kBool  ? in.b
                                                : std::strtod(s.c_str(), &end);
    const bool ok = in.kind != Value::kString || (end != nullptr && end != s.c_str());
    const Value dflt = Arg(args, kwargs, 0, "default", name == "int" ? Value::Int(0) : Value::Float(0));
    if (!ok || (name == "int" && std::isnan(d))) return dflt;
    constexpr double kTwo63 = 9223372036854775808.0;
    if (name == "int" && !(d >= -kTwo63 && d < kTwo63)) Raise(fail, "int of " + s + " is past the 64-bit integers");
    return name == "int" ? Value::Int(static_cast<int64_t>(d)) : Value::Float(d);
  }
  Raise(fail, "filter '" + name + "' is not supported");
}

}  // namespace

std::vector<std::string> CodePoints(const std::string& s) {
  std::vector<std::string> out;
  for (size_t k = 0; k < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[k]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    out.push_back(s.substr(k, n));
    k += n;
  }
  return out;
}

std::string TypeName(const Value& v) {
  static const char* const kNames[] = {"undefined", "NoneType", "bool", "int",       "float",
                                       "str",       "list",     "dict", "Namespace", "function"};
  return kNames[v.kind];
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return false;
    case Value::kBool:
      return v.b;
    case Value::kInt:
      return v.i != 0;
    case Value::kFloat:
      return v.f != 0;
    case Value::kString:
      return !v.s.empty();
    case Value::kList:
      return !v.list->empty();
    case Value::kDict:
      return !v.dict->empty();
    case Value::kNamespace:
    case Value::kFunction:
      return true;
  }
  return false;
}

bool Equal(const Value& a, const Value& b) {
  auto is_num = [](const Value& v) {
    return v.kind == Value::kInt || v.kind == Value::kFloat || v.kind == Value::kBool;
  };
  auto num = [](const Value& v) { return v.kind == Value::kFloat ? v.f : v.kind == Value::kBool ? v.b : v.i; };
  if (is_num(a) && is_num(b)) {
    if (a.kind != Value::kFloat && b.kind != Value::kFloat)
      return (a.kind == Value::kBool ? a.b : a.i) == (b.kind == Value::kBool ? b.b : b.i);
    return num(a) == num(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::kString:
      return a.s == b.s;
    case Value::kList:
      return a.list->size() == b.list->size() && std::equal(a.list->begin(), a.list->end(), b.list->begin(), Equal);
    case Value::kDict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* w = b.Find(k);
        if (w == nullptr || !Equal(v, *w)) return false;
      }
      return true;
    case Value::kNamespace:
      return a.dict == b.dict;
    case Value::kFunction:
      return a.s == b.s;
    default:
      return true;  // None, undefined
  }
}

std::vector<Value> Iterate(const Value& v, const FailFn& fail) {
  switch (v.kind) {
    case Value::kUndefined:
      return {};
    case Value::kList:
      return *v.list;
    case Value::kDict: {
      std::vector<Value> keys;
      for (const auto& kv : *v.dict) keys.push_back(Value::Str(kv.first));
      return keys;
    }
    case Value::kString: {
      std::vector<Value> chars;
      for (std::string& c : CodePoints(v.s)) chars.push_back(Value::Str(std::move(c)));
      return chars;
    }
    default:
      Raise(fail, "'" + TypeName(v) + "' object is not iterable");
  }
}

Value ApplyFilter(const std::string& name, const Value& in, const std::vector<Value>& args,
                  const std::map<std::string, Value>& kwargs, const FailFn& fail) {
  if (name == "length" || name == "count") return Value::Int(Length(in, fail));
  if (name == "default" || name == "d") {
    const bool boolean = Truthy(Arg(args, kwargs, 1, "boolean", Value::Bool(false)));
    const bool use = in.kind == Value::kUndefined || (boolean && !Truthy(in));
    return use ? Arg(args, kwargs, 0, "default_value", Value::Str("")) : in;
  }
  if (name == "tojson") {
    const Value indent = Arg(args, kwargs, 0, "indent", Value::None());
    return Value::Str(ToJson(in, indent.kind == Value::kInt ? static_cast<int>(indent.i) : -1));
  }
  if (name == "safe") return in;
  if (name == "abs") {
    if (in.kind == Value::kFloat) return Value::Float(std::abs(in.f));
    if (in.kind != Value::kInt || in.i == INT64_MIN) Raise(fail, "bad operand type for abs(): " + TypeName(in));
    return Value::Int(std::abs(in.i));
  }
  if (name == "selectattr" || name == "rejectattr") return SelectAttr(name, in, args, fail);
  if (name == "map") return Map(in, args, kwargs, fail);
  if (name == "items" || name == "dictsort") {
    if (in.kind != Value::kDict && in.kind != Value::kNamespace)
      Raise(fail, name + " needs a dict, not " + TypeName(in));
    List out;
    for (const auto& [k, v] : *in.dict) out.push_back(Value::MakeList({Value::Str(k), v}));
    if (name == "dictsort")
      std::stable_sort(out.begin(), out.end(),
                       [](const Value& a, const Value& b) { return (*a.list)[0].s < (*b.list)[0].s; });
    return Value::MakeList(std::move(out));
  }
  if (in.kind == Value::kString && (name == "first" || name == "last" || name == "reverse" || name == "list")) {
    std::vector<Value> chars = Iterate(in, fail);
    if (name == "reverse") {
      std::string s;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) s += it->s;
      return Value::Str(s);
    }
    return ApplyFilter(name, Value::MakeList(std::move(chars)), args, kwargs, fail);
  }
  if (name == "first" || name == "last" || name == "reverse" || name == "list" || name == "unique" || name == "join") {
    std::vector<Value> items = Iterate(in, fail);
    if (name == "first") return items.empty() ? Value::Undefined("first") : items.front();
    if (name == "last") return items.empty() ? Value::Undefined("last") : items.back();
    if (name == "reverse") std::reverse(items.begin(), items.end());
    if (name == "unique") {
      std::vector<Value> seen;
      for (const Value& v : items)
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return Equal(s, v); })) seen.push_back(v);
      items = seen;
    }
    if (name != "join") return Value::MakeList(std::move(items));
    const std::string sep = ToString(Arg(args, kwargs, 0, "d", Value::Str("")));
    const Value attr = Arg(args, kwargs, 1, "attribute", Value::None());
    std::string s;
    for (size_t k = 0; k < items.size(); ++k)
      s += (k ? sep : "") + ToString(attr.kind == Value::kString ? Attribute(items[k], attr.s) : items[k]);
    return Value::Str(s);
  }
  return FilterOnText(name, in, args, kwargs, fail);
}

bool ApplyTest(const std::string& name, const Value& in, const std::vector<Value>& args, const FailFn& fail) {
  const Value& arg = args.empty() ? in : args[0];
  const bool number = in.kind == Value::kInt || in.kind == Value::kFloat || in.kind == Value::kBool;
  if (name == "defined") return in.kind != Value::kUndefined;
  if (name == "undefined") return in.kind == Value::kUndefined;
  if (name == "none") return in.kind == Value::kNone;
  if (name == "boolean") return in.kind == Value::kBool;
  if (name == "true" || name == "false") return in.kind == Value::kBool && in.b == (name == "true");
  if (name == "integer") return in.kind == Value::kInt;
  if (name == "float") return in.kind == Value::kFloat;
  if (name == "number") return number;
  if (name == "string") return in.kind == Value::kString;
  if (name == "mapping") return in.kind == Value::kDict;
  if (name == "iterable" || name == "sequence")
    return in.kind == Value::kList || in.kind == Value::kDict || in.kind == Value::kString ||
           (name == "iterable" && in.kind == Value::kUndefined);
  if (name == "callable") return in.kind == Value::kFunction;
  if (name == "lower" || name == "upper")
    return in.kind == Value::kString && in.s == MapChars(in.s, name == "lower" ? ::tolower : ::toupper);
  if (name == "eq" || name == "equalto") return Equal(in, arg);
  if (name == "ne") return !Equal(in, arg);
  if (name == "sameas")
    return in.kind == arg.kind &&
           (in.kind == Value::kNone || in.kind == Value::kUndefined || (in.kind == Value::kBool && in.b == arg.b));
  if (name == "in") {
    if (arg.kind == Value::kString) {
      if (in.kind != Value::kString)
        Raise(fail, "'in <string>' requires a string as left operand, not " + TypeName(in));
      return arg.s.find(in.s) != std::string::npos;
    }
    if (arg.kind == Value::kDict || arg.kind == Value::kNamespace) return in.kind == Value::kString && arg.Find(in.s);
    if (arg.kind == Value::kUndefined) Raise(fail, "'" + arg.s + "' is undefined");
    const std::vector<Value> items = Iterate(arg, fail);
    return std::any_of(items.begin(), items.end(), [&](const Value& v) { return Equal(v, in); });
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (in.kind != Value::kInt || (name == "divisibleby" && (arg.kind != Value::kInt || arg.i == 0)))
      Raise(fail, "test '" + name + "' needs integers");
    if (name == "divisibleby") return in.i % arg.i == 0;
    return (in.i % 2 != 0) == (name == "odd");
  }
  if (name == "lt" || name == "gt" || name == "le" || name == "ge") {
    if (!number || !(arg.kind == Value::kInt || arg.kind == Value::kFloat))
      Raise(fail, "test '" + name + "' needs numbers");
    const double x = in.kind == Value::kFloat ? in.f : in.i, y = arg.kind == Value::kFloat ? arg.f : arg.i;
    return name == "lt" ? x < y : name == "gt" ? x > y : name == "le" ? x <= y : x >= y;
  }
  Raise(fail, "test '" + name + "' is not supported");
}

Value CallMethod(const Value& self, const std::string& name, const std::vector<Value>& args, const FailFn& fail) {
  if (self.kind == Value::kDict) {
    if (name == "items") return ApplyFilter("items", self, {}, {}, fail);
    if (name == "keys") return Value::MakeList(Iterate(self, fail));
    if (name == "values") {
      List out;
      for (const auto& kv : *self.dict) out.push_back(kv.second);
      return Value::MakeList(std::move(out));
    }
    if (name == "get") {
      const Value* v = args.empty() || args[0].kind != Value::kString ? nullptr : self.Find(args[0].s);
      return v != nullptr ? *v : args.size() > 1 ? args[1] : Value::None();
    }
    Raise(fail, "dict has no method '" + name + "' here (supported: items, keys, values, get)");
  }
  const std::string& s = self.s;
  auto text = [&](size_t k) {
    return k < args.size() && args[k].kind != Value::kNone ? ToString(args[k]) : std::string(kSpace);
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return Value::Str(Strip(s, text(0), name != "rstrip", name != "lstrip"));
  if (name == "startswith" || name == "endswith") {
    const std::vector<Value> options = args.empty()                   ? std::vector<Value>{}
                                       : args[0].kind == Value::kList ? *args[0].list
                                                                      : std::vector<Value>{args[0]};
    return Value::Bool(std::any_of(options.begin(), options.end(), [&](const Value& o) {
      const std::string p = ToString(o);
      return p.size() <= s.size() &&
             (name == "startswith" ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0);
    }));
  }
  if (name == "split")
    return Value::MakeList(Split(s, args.empty() ? nullptr : &args[0], args.size() > 1 ? args[1].i : -1));
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize")
    return FilterOnText(name, self, {}, {}, fail);
  if (name == "replace") return FilterOnText("replace", self, args, {}, fail);
  if (name == "find") {
    const size_t at = args.empty() ? std::string::npos : s.find(ToString(args[0]));
    return Value::Int(at == std::string::npos ? -1 : static_cast<int64_t>(CodePoints(s.substr(0, at)).size()));
  }
  if (name == "join") return ApplyFilter("join", args.empty() ? Value::MakeList({}) : args[0], {self}, {}, fail);
  Raise(fail, "str has no method '" + name +
                  "' here (supported: strip, lstrip, rstrip, startswith, endswith, split, upper, lower, title, "
                  "capitalize, replace, find, join)");
}

}  // namespace shardtrain::examples::llama::jinja
