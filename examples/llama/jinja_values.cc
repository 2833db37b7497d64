// Values of the Jinja subset: Python's str(), repr() and json.dumps of them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "examples/llama/jinja.h"

namespace shardtrain::examples::llama::jinja {
namespace {

// Python's repr of a float: the shortest digits that read back, positional
// between 1e-4 and 1e16, with ".0" on whole numbers.
std::string FloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  int p = 1;
  for (; p < 17; ++p) {
    std::snprintf(buf, sizeof(buf), "%.*e", p - 1, f);
    if (std::strtod(buf, nullptr) == f) break;
  }
  std::snprintf(buf, sizeof(buf), "%.*e", p - 1, f);
  const int exp = f == 0 ? 0 : std::atoi(std::strchr(buf, 'e') + 1);
  if (exp < -4 || exp >= 16) {  // mantissa without trailing zeros, exponent as e+XX
    std::string s = buf;
    const size_t e = s.find('e');
    std::string mant = s.substr(0, e);
    if (mant.find('.') != std::string::npos) {
      while (mant.back() == '0') mant.pop_back();
      if (mant.back() == '.') mant.pop_back();
    }
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return mant + ebuf;
  }
  std::snprintf(buf, sizeof(buf), "%.*f", std::max(0, p - 1 - exp), f);
  std::string s = buf;
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

std::string Repr(const Value& v) {
  if (v.kind != Value::kString) return ToString(v);
  const char quote = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (const char c : v.s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + quote;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace

const Value* Value::Find(const std::string& key) const {
  if (!dict) return nullptr;
  for (const auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}

std::string ToString(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "";
    case Value::kNone:
      return "None";
    case Value::kFunction:
      return "<function " + v.s + ">";
    case Value::kBool:
      return v.b ? "True" : "False";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat:
      return FloatRepr(v.f);
    case Value::kString:
      return v.s;
    case Value::kList: {
      std::string s = "[";
      for (size_t k = 0; k < v.list->size(); ++k) s += (k ? ", " : "") + Repr((*v.list)[k]);
      return s + "]";
    }
    case Value::kDict:
    case Value::kNamespace: {
      std::string s = v.kind == Value::kNamespace ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        s += (k ? ", " : "") + Repr(Value::Str((*v.dict)[k].first)) + ": " + Repr((*v.dict)[k].second);
      return s + (v.kind == Value::kNamespace ? "}>" : "}");
    }
  }
  return "";
}

std::string ToJson(const Value& v, int indent, int depth) {
  const std::string nl = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent) * (depth + 1), ' ');
  const std::string close_nl = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent) * depth, ' ');
  const std::string sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
    case Value::kFunction:
      return "null";
    case Value::kBool:
      return v.b ? "true" : "false";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat:
      return std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : FloatRepr(v.f);
    case Value::kString:
      return JsonString(v.s);
    case Value::kList: {
      if (v.list->empty()) return "[]";
      std::string s = "[";
      for (size_t k = 0; k < v.list->size(); ++k) s += (k ? sep : "") + nl + ToJson((*v.list)[k], indent, depth + 1);
      return s + close_nl + "]";
    }
    case Value::kDict:
    case Value::kNamespace: {
      if (v.dict->empty()) return "{}";
      std::string s = "{";
      for (size_t k = 0; k < v.dict->size(); ++k) {
        s += (k ? sep : "") + nl + JsonString((*v.dict)[k].first) + ": " +
             ToJson((*v.dict)[k].second, indent, depth + 1);
      }
      return s + close_nl + "}";
    }
  }
  return "null";
}

}  // namespace shardtrain::examples::llama::jinja
