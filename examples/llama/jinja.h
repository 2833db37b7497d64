// The subset of Jinja that chat templates use, as transformers compiles them
// (jinja2 with trim_blocks, lstrip_blocks and loop controls): the parsed form
// of a template and the values it computes with. Internal to chat_template.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_JINJA_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_JINJA_H_

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::examples::llama::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict

// A template value: Python's None, bool, int, float, str, list and dict,
// Jinja's undefined and namespace (a dict that `set ns.x = ...` changes).
struct Value {
  enum Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kFunction };
  Kind kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // kString; kFunction: the global's name; kUndefined: the name looked up
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;  // kDict and kNamespace

  static Value None() { return Of(kNone); }
  static Value Bool(bool v) {
    return Of(kBool, [&](Value& x) { x.b = v; });
  }
  static Value Int(int64_t v) {
    return Of(kInt, [&](Value& x) { x.i = v; });
  }
  static Value Float(double v) {
    return Of(kFloat, [&](Value& x) { x.f = v; });
  }
  static Value Str(std::string v) {
    return Of(kString, [&](Value& x) { x.s = std::move(v); });
  }
  static Value Function(std::string name) {
    return Of(kFunction, [&](Value& x) { x.s = std::move(name); });
  }
  static Value Undefined(std::string name) {
    return Of(kUndefined, [&](Value& x) { x.s = std::move(name); });
  }
  static Value MakeList(List v) {
    return Of(kList, [&](Value& x) { x.list = std::make_shared<List>(std::move(v)); });
  }
  static Value MakeDict(Dict v, Kind kind = kDict) {
    return Of(kind, [&](Value& x) { x.dict = std::make_shared<Dict>(std::move(v)); });
  }
  // The member `key` of a dict or namespace, or nullptr.
  const Value* Find(const std::string& key) const;

 private:
  template <typename F>
  static Value Of(Kind k, F set) {
    Value v;
    v.kind = k;
    set(v);
    return v;
  }
  static Value Of(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

// An expression. `name` is the variable, attribute, filter, test or operator.
struct Expr {
  enum Op {
    kLiteral,  // value
    kName,     // name
    kAttr,     // args[0].name
    kItem,     // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]] (null parts absent)
    kCall,     // args[0](args[1:], kwargs)
    kFilter,   // args[0] | name(args[1:], kwargs)
    kTest,     // args[0] is [not] name(args[1:]); negate
    kUnary,    // name ("not", "-", "+") args[0]
    kBinary,   // args[0] name args[1]
    kCond,     // args[0] if args[1] else args[2] (args[2] may be null)
    kList,     // [args...] or (args...)
    kDict,     // {args[0]: args[1], ...}
  };
  Op op = kLiteral;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  bool negate = false;
  int line = 0;
  int depth = 1;  // of the tree under it (the parser bounds it: see kMaxDepth)
};

// How deeply statements and expressions may nest, and how much a rendering
// may build: bounds that keep a hostile template from exhausting the stack,
// the memory or the time (real chat templates stay far below them).
inline constexpr int kMaxDepth = 100;
inline constexpr int64_t kMaxItems = 1'000'000;     // of a range() or a list
inline constexpr size_t kMaxTextBytes = 64u << 20;  // of a string and of the output
inline constexpr int64_t kMaxSteps = 10'000'000;    // expressions evaluated, loop iterations weighted
inline constexpr int64_t kStepsPerIteration = 10;   // a loop iteration builds its 11-entry `loop`

struct Node;
using Body = std::vector<Node>;

// A statement or a run of text.
struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet, kBreak, kContinue };
  Kind kind = kText;
  int line = 0;
  std::string text;                                // kText
  ExprPtr expr;                                    // kOutput, kFor (iterable), kSet (value; null: block set)
  std::vector<std::pair<ExprPtr, Body>> branches;  // kIf: (condition, body); the else branch has no condition
  std::vector<std::string> targets;                // kFor loop variables; kSet: {name} or {namespace, attribute}
  ExprPtr filter;                                  // kFor: `for x in xs if filter`
  Body body, else_body;                            // kFor, kSet (block set)
};

// The lexer's output: runs of text, and the tokens of {{ }} and {% %} tags
// (comments dropped, whitespace control and trim/lstrip_blocks applied).
struct Token {
  enum Kind { kName, kInt, kFloat, kString, kOp, kEnd };
  Kind kind = kEnd;
  std::string text;  // the name, operator or unescaped string
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

// A piece of the template: text, or the tokens of a {{ }} or {% %} tag.
struct Item {
  enum Kind { kText, kVar, kBlock };
  Kind kind;
  int line;
  std::string text;
  std::vector<Token> tokens;  // ends with kEnd
};

// Splits a template into items; throws InvalidArgumentError naming `origin`
// and the line.
std::vector<Item> Lex(const std::string& source, const std::string& origin);

// Parses a template; throws InvalidArgumentError naming `origin`, the line and
// what is wrong (including constructs outside the subset, by name).
Body Parse(const std::string& source, const std::string& origin);

// Renders `body` with the global variables `globals`; throws
// InvalidArgumentError naming `origin` and the line (raise_exception's message
// as the template gives it).
std::string Render(const Body& body, const std::map<std::string, Value>& globals, const std::string& origin);

// Reports a template error (throws; the renderer adds origin and line).
using FailFn = std::function<void(const std::string&)>;
[[noreturn]] inline void Raise(const FailFn& fail, const std::string& what) {
  fail(what);
  std::abort();
}

// Filters, tests, methods of str and dict, and Python's semantics of values
// (jinja_builtins.cc).
Value ApplyFilter(const std::string& name, const Value& in, const std::vector<Value>& args,
                  const std::map<std::string, Value>& kwargs, const FailFn& fail);
bool ApplyTest(const std::string& name, const Value& in, const std::vector<Value>& args, const FailFn& fail);
Value CallMethod(const Value& self, const std::string& name, const std::vector<Value>& args, const FailFn& fail);
bool Truthy(const Value& v);
bool Equal(const Value& a, const Value& b);
std::vector<Value> Iterate(const Value& v, const FailFn& fail);
std::string TypeName(const Value& v);
std::vector<std::string> CodePoints(const std::string& s);

// Python's str() of a value (Jinja's output of it), and json.dumps (tojson).
std::string ToString(const Value& v);
std::string ToJson(const Value& v, int indent, int depth = 0);

}  // namespace shardtrain::examples::llama::jinja

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_JINJA_H_
