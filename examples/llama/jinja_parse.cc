// Parsing of the Jinja subset: the statement tree of the lexed items, and
// expressions with jinja2's operator precedence.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>

#include "base/errors.h"
#include "examples/llama/jinja.h"

namespace shardtrain::examples::llama::jinja {
namespace {

const std::set<std::string> kFilters = {"abs",   "capitalize", "count",   "d",       "default", "first",      "float",
                                        "int",   "items",      "join",    "last",    "length",  "list",       "lower",
                                        "map",   "rejectattr", "replace", "reverse", "safe",    "selectattr", "string",
                                        "title", "tojson",     "trim",    "unique",  "upper",   "dictsort"};
const std::set<std::string> kTests = {"boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
                                      "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
                                      "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
                                      "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper"};

std::string Join(const std::set<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

class Parser {
 public:
  Parser(std::vector<Item> items, const std::string& origin) : items_(std::move(items)), origin_(origin) {}

  Body Run() {
    Body body = ParseBody({});
    if (at_ < items_.size()) Fail(items_[at_].line, "unexpected {% " + items_[at_].tokens[0].text + " %}");
    return body;
  }

 private:
  [[noreturn]] void Fail(int line, const std::string& what) const {
    ST_THROW(InvalidArgumentError, origin_, ": line ", line, ": ", what);
  }

  // Statements up to a block tag named in `ends` (left unconsumed) or the end.
  Body ParseBody(const std::set<std::string>& ends) {
    const Nesting nesting(this, at_ < items_.size() ? items_[at_].line : 0);
    Body body;
    while (at_ < items_.size()) {
      Item& item = items_[at_];
      if (item.kind == Item::kText) {
        body.push_back({Node::kText, item.line, item.text});
        ++at_;
        continue;
      }
      toks_ = &item.tokens;
      pos_ = 0;
      if (item.kind == Item::kVar) {
        Node n{Node::kOutput, item.line};
        n.expr = ParseExpr();
        ExpectEnd();
        body.push_back(std::move(n));
        ++at_;
        continue;
      }
      const Token& head = Peek();
      if (head.kind != Token::kName) Fail(item.line, "a block tag must start with a statement name");
      if (ends.count(head.text)) return body;
      ++at_;
      ++pos_;
      ParseStatement(head.text, item.line, body);
    }
    for (const std::string& end : ends) {
      if (end.rfind("end", 0) == 0) Fail(items_.empty() ? 1 : items_.back().line, "missing {% " + end + " %}");
    }
    return body;
  }

  void ParseStatement(const std::string& name, int line, Body& body) {
    if (name == "if") return body.push_back(ParseIf(line));
    if (name == "for") return body.push_back(ParseFor(line));
    if (name == "set") return body.push_back(ParseSet(line));
    if (name == "break" || name == "continue") {
      ExpectEnd();
      return body.push_back({name == "break" ? Node::kBreak : Node::kContinue, line});
    }
    if (name.rfind("end", 0) == 0 || name == "elif" || name == "else") {
      Fail(line, "unexpected {% " + name + " %}: no open block takes it");
    }
    if (name == "generation") {  // transformers' assistant-mask marker: renders its body
      ExpectEnd();
      for (Node& n : ParseBody({"endgeneration"})) body.push_back(std::move(n));
      return EndTag("endgeneration");
    }
    Fail(line, "{% " + name +
                   " %} is not supported (supported statements: if/elif/else, for/else with loop, break and "
                   "continue, set, raw, generation)");
  }

  void EndTag(const std::string& name) {
    toks_ = &items_[at_].tokens;
    pos_ = 1;
    ExpectEnd();
    ++at_;
  }

  Node ParseIf(int line) {
    Node n{Node::kIf, line};
    ExprPtr cond = ParseExpr();
    ExpectEnd();
    while (true) {
      Body b = ParseBody({"elif", "else", "endif"});
      n.branches.emplace_back(cond, std::move(b));
      const std::string tag = items_[at_].tokens[0].text;
      toks_ = &items_[at_].tokens;
      pos_ = 1;
      ++at_;
      if (tag == "endif") break;
      if (!cond) Fail(items_[at_ - 1].line, "{% " + tag + " %} after {% else %}");
      cond = tag == "elif" ? ParseExpr() : nullptr;
      ExpectEnd();
    }
    ExpectEnd();
    return n;
  }

  Node ParseFor(int line) {
    Node n{Node::kFor, line};
    const bool paren = Accept("(");
    do {
      n.targets.push_back(ExpectName());
    } while (Accept(","));
    if (paren) Expect(")");
    if (Peek().kind != Token::kName || Peek().text != "in") Fail(line, "expected 'in' in {% for %}");
    ++pos_;
    n.expr = ParseTupleNoCond();
    if (Peek().kind == Token::kName && Peek().text == "if") {
      ++pos_;
      n.filter = ParseOr();
    }
    if (Peek().kind == Token::kName && Peek().text == "recursive") Fail(line, "recursive loops are not supported");
    ExpectEnd();
    n.body = ParseBody({"else", "endfor"});
    if (items_[at_].tokens[0].text == "else") {
      EndTag("else");
      n.else_body = ParseBody({"endfor"});
    }
    EndTag("endfor");
    return n;
  }

  Node ParseSet(int line) {
    Node n{Node::kSet, line};
    n.targets.push_back(ExpectName());
    if (Accept(".")) n.targets.push_back(ExpectName());
    if (Peek().kind == Token::kOp && Peek().text == ",") Fail(line, "{% set a, b = ... %} is not supported");
    if (Accept("=")) {
      n.expr = ParseTupleNoCond(true);
      ExpectEnd();
      return n;
    }
    ExpectEnd();
    n.body = ParseBody({"endset"});
    EndTag("endset");
    return n;
  }

  // ---- expressions ----
  const Token& Peek(size_t ahead = 0) const { return (*toks_)[std::min(pos_ + ahead, toks_->size() - 1)]; }
  bool IsOp(const char* op, size_t ahead = 0) const { return Peek(ahead).kind == Token::kOp && Peek(ahead).text == op; }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::kName && Peek(ahead).text == name;
  }
  bool Accept(const char* op) {
    if (!IsOp(op)) return false;
    ++pos_;
    return true;
  }
  void Expect(const char* op) {
    if (!Accept(op)) Fail(Peek().line, std::string("expected '") + op + "', found " + Describe(Peek()));
  }
  std::string ExpectName() {
    if (Peek().kind != Token::kName) Fail(Peek().line, "expected a name, found " + Describe(Peek()));
    return (*toks_)[pos_++].text;
  }
  void ExpectEnd() {
    if (Peek().kind != Token::kEnd) Fail(Peek().line, "unexpected " + Describe(Peek()) + " (expected the tag's end)");
  }
  static std::string Describe(const Token& t) {
    return t.kind == Token::kEnd      ? "end of tag"
           : t.kind == Token::kString ? "string '" + t.text + "'"
                                      : "'" + t.text + "'";
  }
  ExprPtr Make(Expr::Op op, std::string name, std::vector<ExprPtr> args, int line) const {
    auto e = std::make_shared<Expr>();
    for (const ExprPtr& a : args) {
      if (a) e->depth = std::max(e->depth, a->depth + 1);
    }
    if (e->depth > kMaxDepth) Fail(line, "an expression nested deeper than " + std::to_string(kMaxDepth) + " levels");
    e->op = op;
    e->name = std::move(name);
    e->args = std::move(args);
    e->line = line;
    return e;
  }

 public:
  ExprPtr ParseExpr() {
    ExprPtr e = ParseOr();
    while (IsName("if")) {
      const int line = Peek().line;
      ++pos_;
      ExprPtr cond = ParseOr();
      ExprPtr other;
      if (IsName("else")) {
        ++pos_;
        other = ParseExpr();
      }
      e = Make(Expr::kCond, "", {e, cond, other}, line);
    }
    return e;
  }

 private:
  // A value, or a tuple of them without parentheses (`for` iterables, `set`).
  ExprPtr ParseTupleNoCond(bool with_cond = false) {
    const int line = Peek().line;
    ExprPtr first = with_cond ? ParseExpr() : ParseOr();
    if (!IsOp(",")) return first;
    std::vector<ExprPtr> items{first};
    while (Accept(",") && Peek().kind != Token::kEnd && !IsName("if"))
      items.push_back(with_cond ? ParseExpr() : ParseOr());
    return Make(Expr::kList, "", items, line);
  }
  ExprPtr ParseOr() {
    ExprPtr e = ParseAnd();
    while (IsName("or")) {
      const int line = Peek().line;
      ++pos_;
      e = Make(Expr::kBinary, "or", {e, ParseAnd()}, line);
    }
    return e;
  }
  ExprPtr ParseAnd() {
    ExprPtr e = ParseNot();
    while (IsName("and")) {
      const int line = Peek().line;
      ++pos_;
      e = Make(Expr::kBinary, "and", {e, ParseNot()}, line);
    }
    return e;
  }
  ExprPtr ParseNot() {
    if (!IsName("not")) return ParseCompare();
    const Nesting nesting(this, Peek().line);
    const int line = Peek().line;
    ++pos_;
    return Make(Expr::kUnary, "not", {ParseNot()}, line);
  }
  ExprPtr ParseCompare() {
    ExprPtr e = ParseBinary(0);
    while (true) {
      const int line = Peek().line;
      std::string op;
      if (Peek().kind == Token::kOp &&
          (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">="))) {
        op = (*toks_)[pos_++].text;
      } else if (IsName("in")) {
        ++pos_;
        op = "in";
      } else if (IsName("not") && IsName("in", 1)) {
        pos_ += 2;
        op = "not in";
      } else {
        return e;
      }
      e = Make(Expr::kBinary, op, {e, ParseBinary(0)}, line);
    }
  }
  // Levels: + -, then ~, then * / // %, then **.
  ExprPtr ParseBinary(int level) {
    static const std::vector<std::vector<std::string>> kLevels = {{"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
    if (level == static_cast<int>(kLevels.size())) return ParseUnary(true);
    ExprPtr e = ParseBinary(level + 1);
    while (Peek().kind == Token::kOp) {
      const auto& ops = kLevels[level];
      const std::string t = Peek().text;
      if (std::find(ops.begin(), ops.end(), t) == ops.end()) break;
      const int line = Peek().line;
      ++pos_;
      e = Make(Expr::kBinary, t, {e, ParseBinary(level + 1)}, line);
    }
    return e;
  }
  ExprPtr ParseUnary(bool with_filter) {
    const int line = Peek().line;
    const Nesting nesting(this, line);
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      const std::string op = (*toks_)[pos_++].text;
      e = Make(Expr::kUnary, op, {ParseUnary(false)}, line);
    } else {
      e = ParsePostfix(ParsePrimary());
    }
    return with_filter ? ParseFilters(e) : e;
  }
  ExprPtr ParsePrimary();
  ExprPtr ParsePostfix(ExprPtr e);
  ExprPtr ParseFilters(ExprPtr e);
  void ParseArgs(Expr& call);

  // Counts the parser's recursion; fails past kMaxDepth.
  struct Nesting {
    Nesting(Parser* p, int line) : parser(p) {
      if (++parser->depth_ > kMaxDepth)
        parser->Fail(line, "statements or expressions nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    ~Nesting() { --parser->depth_; }
    Parser* parser;
  };

  std::vector<Item> items_;
  const std::string& origin_;
  int depth_ = 0;
  size_t at_ = 0;
  const std::vector<Token>* toks_ = nullptr;
  size_t pos_ = 0;
};

ExprPtr Parser::ParsePrimary() {
  const Token t = Peek();
  auto lit = std::make_shared<Expr>();
  lit->line = t.line;
  ++pos_;
  switch (t.kind) {
    case Token::kString:
      lit->value = Value::Str(t.text);
      while (Peek().kind == Token::kString) lit->value.s += (*toks_)[pos_++].text;  // adjacent literals join
      return lit;
    case Token::kInt:
      lit->value = Value::Int(t.i);
      return lit;
    case Token::kFloat:
      lit->value = Value::Float(t.f);
      return lit;
    case Token::kName:
      if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
        lit->value = Value::Bool(t.text[0] == 't' || t.text[0] == 'T');
      } else if (t.text == "none" || t.text == "None") {
        lit->value = Value::None();
      } else {
        return Make(Expr::kName, t.text, {}, t.line);
      }
      return lit;
    case Token::kOp:
      break;
    case Token::kEnd:
      Fail(t.line, "expected an expression, found the tag's end");
  }
  const bool paren = t.text == "(", bracket = t.text == "[", brace = t.text == "{";
  if (!paren && !bracket && !brace) Fail(t.line, "unexpected '" + t.text + "' in an expression");
  const char* close = paren ? ")" : bracket ? "]" : "}";
  std::vector<ExprPtr> items;
  bool comma = false;
  while (!IsOp(close)) {
    items.push_back(ParseExpr());
    if (brace) {
      Expect(":");
      items.push_back(ParseExpr());
    }
    if (!Accept(",")) break;
    comma = true;
  }
  Expect(close);
  if (paren && items.size() == 1 && !comma) return items[0];
  return Make(brace ? Expr::kDict : Expr::kList, "", items, t.line);
}

ExprPtr Parser::ParsePostfix(ExprPtr e) {
  while (true) {
    const int line = Peek().line;
    if (Accept(".")) {
      if (Peek().kind == Token::kInt) {
        auto idx = std::make_shared<Expr>();
        idx->value = Value::Int((*toks_)[pos_++].i);
        e = Make(Expr::kItem, "", {e, idx}, line);
      } else {
        e = Make(Expr::kAttr, ExpectName(), {e}, line);
      }
    } else if (Accept("[")) {
      std::vector<ExprPtr> parts{e};
      bool slice = false;
      for (int k = 0; k < 3; ++k) {
        parts.push_back(IsOp(":") || IsOp("]") ? nullptr : ParseExpr());
        if (!Accept(":")) break;
        slice = true;
      }
      Expect("]");
      while (parts.size() < 4) parts.push_back(nullptr);
      if (!slice) parts.resize(2);
      e = Make(slice ? Expr::kSlice : Expr::kItem, "", parts, line);
    } else if (IsOp("(")) {
      auto call = std::make_shared<Expr>(*Make(Expr::kCall, "", {e}, line));
      ParseArgs(*call);
      e = call;
    } else {
      return e;
    }
  }
}

void Parser::ParseArgs(Expr& call) {
  Expect("(");
  while (!IsOp(")")) {
    if (Peek().kind == Token::kName && IsOp("=", 1)) {
      const std::string key = ExpectName();
      ++pos_;
      call.kwargs.emplace_back(key, ParseExpr());
    } else {
      if (!call.kwargs.empty()) Fail(Peek().line, "a positional argument after a keyword argument");
      call.args.push_back(ParseExpr());
    }
    if (!Accept(",")) break;
  }
  Expect(")");
}

ExprPtr Parser::ParseFilters(ExprPtr e) {
  while (true) {
    const int line = Peek().line;
    if (Accept("|")) {
      const std::string name = ExpectName();
      if (!kFilters.count(name))
        Fail(line, "filter '" + name + "' is not supported (supported: " + Join(kFilters) + ")");
      auto f = std::make_shared<Expr>(*Make(Expr::kFilter, name, {e}, line));
      if (IsOp("(")) ParseArgs(*f);
      e = f;
    } else if (IsName("is")) {
      ++pos_;
      const bool negate = IsName("not");
      if (negate) ++pos_;
      std::string name = Peek().kind == Token::kOp && (IsOp("==") || IsOp("!=")) ? (*toks_)[pos_++].text : ExpectName();
      if (name == "==") name = "eq";
      if (name == "!=") name = "ne";
      if (!kTests.count(name)) Fail(line, "test '" + name + "' is not supported (supported: " + Join(kTests) + ")");
      auto t = std::make_shared<Expr>(*Make(Expr::kTest, name, {e}, line));
      t->negate = negate;
      const Token& next = Peek();
      if (IsOp("(")) {
        ParseArgs(*t);
      } else if (next.kind == Token::kString || next.kind == Token::kInt || next.kind == Token::kFloat ||
                 (next.kind == Token::kName && next.text != "else" && next.text != "or" && next.text != "and" &&
                  next.text != "if" && next.text != "in" && next.text != "not" && next.text != "is") ||
                 IsOp("[") || IsOp("{")) {
        t->args.push_back(ParsePostfix(ParsePrimary()));
      }
      e = t;
    } else if (IsOp("(")) {
      auto call = std::make_shared<Expr>(*Make(Expr::kCall, "", {e}, line));
      ParseArgs(*call);
      e = call;
    } else {
      return e;
    }
  }
}

}  // namespace

Body Parse(const std::string& source, const std::string& origin) { return Parser(Lex(source, origin), origin).Run(); }

}  // namespace shardtrain::examples::llama::jinja
