// OptionTable: one table per strategy for its string options.
//
// Each row names a key, the values it takes, a one-line doc and the field it
// sets: a field of the strategy's typed options (e.g. FsdpNativeOptions), or
// directly a field of the sharding::ShardingOptions those options carry for
// the core (Field<O, T>). The one table gives
//   - the valid keys (StrategyRegistry checks them; the error lists them),
//   - the parsing (the strategy's FromStrings is table.Parse),
//   - the option reference, docs/strategy_options.md (generated from the
//     tables; tests/strategies checks that the file matches them).
//
//   const OptionTable<DdpOptions>& Table() {
//     static const OptionTable<DdpOptions> t({
//         OptionDouble("bucket_cap_mb", &DdpOptions::bucket_cap_mb, "gradient bucket size in MiB (default 25)"),
//     });
//     return t;
//   }
#ifndef SHARDTRAIN_STRATEGIES_OPTION_TABLE_H_
#define SHARDTRAIN_STRATEGIES_OPTION_TABLE_H_

#include <c10/core/ScalarType.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::strategies {

using StrategyOptions = std::map<std::string, std::string>;

// A row without its setter: what the registry and the docs need.
struct OptionDoc {
  std::string key;
  std::string values;  // what it takes, e.g. "true|false", "FULL_SHARD|SHARD_GRAD_OP"
  std::string doc;     // one line
};

// Throws InvalidArgumentError "strategy '<strategy>': unknown option <key>;
// valid options: <keys, sorted>".
[[noreturn]] void ThrowUnknownOption(const std::string& strategy, const std::string& key,
                                     std::vector<std::string> valid);
// The keys of `docs`, sorted.
std::vector<std::string> OptionKeys(const std::vector<OptionDoc>& docs);
// `text` as one Markdown table cell: '|' escaped as "\|", newlines as spaces.
std::string MarkdownCell(const std::string& text);
// The Markdown table of `docs` (header row, one row per option, table order;
// every cell through MarkdownCell).
std::string OptionDocsMarkdown(const std::vector<OptionDoc>& docs);

template <typename Options>
struct OptionRow {
  OptionDoc doc;
  // Sets the target field(s) of `o` from `value`; errors name the strategy and the key.
  std::function<void(Options& o, const std::string& strategy, const std::string& key, const std::string& value)> set;
};

template <typename Options>
class OptionTable {
 public:
  explicit OptionTable(std::vector<OptionRow<Options>> rows) : rows_(std::move(rows)) {}

  std::vector<OptionDoc> Docs() const {
    std::vector<OptionDoc> out;
    for (const auto& r : rows_) out.push_back(r.doc);
    return out;
  }
  std::vector<std::string> Keys() const { return OptionKeys(Docs()); }

  // Default options with every given key applied, in key order. Unknown keys
  // throw (ThrowUnknownOption).
  Options Parse(const StrategyOptions& in, const std::string& strategy) const {
    Options o;
    for (const auto& [k, v] : in) {
      const OptionRow<Options>* row = nullptr;
      for (const auto& r : rows_) {
        if (r.doc.key == k) row = &r;
      }
      if (!row) ThrowUnknownOption(strategy, k, Keys());
      row->set(o, strategy, k, v);
    }
    return o;
  }

 private:
  std::vector<OptionRow<Options>> rows_;
};

// Typed reads of string options, with messages naming the strategy and key.
// Booleans: true/false/1/0/yes/no (case-insensitive).
namespace option_parsing {
bool ParseBool(const std::string& strategy, const std::string& key, const std::string& value);
int64_t ParseInt(const std::string& strategy, const std::string& key, const std::string& value);
double ParseDouble(const std::string& strategy, const std::string& key, const std::string& value);
// "bf16"/"bfloat16", "fp16"/"float16"/"half", "fp32"/"float32"/"float".
c10::ScalarType ParseDtype(const std::string& strategy, const std::string& key, const std::string& value);
std::string DtypeName(c10::ScalarType t);
}  // namespace option_parsing

// Where a row stores its value: a field of Options (`&O::x`), or a field of a
// struct inside Options (`Field<O, T>(&O::sharding, &sharding::ShardingOptions::x)`),
// so a row can set the core's ShardingOptions directly instead of a copy.
template <typename O, typename T>
class Field {
 public:
  Field(T O::*field) : get_([field](O& o) -> T& { return o.*field; }) {}  // NOLINT: implicit on purpose
  template <typename Inner>
  Field(Inner O::*outer, T Inner::*field) : get_([outer, field](O& o) -> T& { return (o.*outer).*field; }) {}
  T& operator()(O& o) const { return get_(o); }

 private:
  std::function<T&(O&)> get_;
};

// Rows for plain fields: the value is parsed and stored into `field`.
template <typename O>
OptionRow<O> OptionBool(std::string key, Field<O, bool> field, std::string doc) {
  return {{std::move(key), "true|false", std::move(doc)},
          [field](O& o, const std::string& s, const std::string& k, const std::string& v) {
            field(o) = option_parsing::ParseBool(s, k, v);
          }};
}
template <typename O, typename Int>
OptionRow<O> OptionInt(std::string key, Field<O, Int> field, std::string doc) {
  return {{std::move(key), "integer", std::move(doc)},
          [field](O& o, const std::string& s, const std::string& k, const std::string& v) {
            field(o) = static_cast<Int>(option_parsing::ParseInt(s, k, v));
          }};
}
template <typename O>
OptionRow<O> OptionDouble(std::string key, Field<O, double> field, std::string doc) {
  return {{std::move(key), "number", std::move(doc)},
          [field](O& o, const std::string& s, const std::string& k, const std::string& v) {
            field(o) = option_parsing::ParseDouble(s, k, v);
          }};
}
template <typename O>
OptionRow<O> OptionDtype(std::string key, Field<O, std::optional<c10::ScalarType>> field, std::string doc) {
  return {{std::move(key), "bf16|fp16|fp32", std::move(doc)},
          [field](O& o, const std::string& s, const std::string& k, const std::string& v) {
            field(o) = option_parsing::ParseDtype(s, k, v);
          }};
}
template <typename O>
OptionRow<O> OptionString(std::string key, std::string values, Field<O, std::string> field, std::string doc) {
  return {{std::move(key), std::move(values), std::move(doc)},
          [field](O& o, const std::string&, const std::string&, const std::string& v) { field(o) = v; }};
}

// The same for a field of Options itself (`&O::x`; the template argument O is
// deduced from the member pointer, which Field<O, T> alone cannot do).
template <typename O>
OptionRow<O> OptionBool(std::string key, bool O::*field, std::string doc) {
  return OptionBool(std::move(key), Field<O, bool>(field), std::move(doc));
}
template <typename O, typename Int>
OptionRow<O> OptionInt(std::string key, Int O::*field, std::string doc) {
  return OptionInt(std::move(key), Field<O, Int>(field), std::move(doc));
}
template <typename O>
OptionRow<O> OptionDouble(std::string key, double O::*field, std::string doc) {
  return OptionDouble(std::move(key), Field<O, double>(field), std::move(doc));
}
template <typename O>
OptionRow<O> OptionDtype(std::string key, std::optional<c10::ScalarType> O::*field, std::string doc) {
  return OptionDtype(std::move(key), Field<O, std::optional<c10::ScalarType>>(field), std::move(doc));
}
template <typename O>
OptionRow<O> OptionString(std::string key, std::string values, std::string O::*field, std::string doc) {
  return OptionString(std::move(key), std::move(values), Field<O, std::string>(field), std::move(doc));
}

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_OPTION_TABLE_H_
