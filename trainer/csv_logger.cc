#include "trainer/csv_logger.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

CsvLogger::CsvLogger(std::string root_dir, std::string name, int version) {
  log_dir_ = MakeVersionedLogDir("CsvLogger", root_dir, name, &version);
  version_ = version;
}

namespace {
void WriteAtomically(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ST_CHECK_ARG(out.good(), "cannot write '", tmp, "'");
    out << content;
    out.flush();
    ST_CHECK_ARG(out.good(), "failed writing '", tmp, "'");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  ST_CHECK_ARG(!ec, "cannot rename '", tmp, "' to '", path, "': ", ec.message());
}
}  // namespace

void CsvLogger::LogHyperparams(const std::map<std::string, std::string>& hparams) {
  std::ostringstream os;
  for (const auto& [k, v] : hparams) {
    const bool quote = v.empty() || v.find_first_of(":#{}[],&*?|<>=!%@`'\"\n") != std::string::npos;
    os << k << ": " << (quote ? "'" : "");
    for (char c : v) {
      if (quote && c == '\'') os << "''";
      else os << c;
    }
    os << (quote ? "'" : "") << "\n";
  }
  WriteAtomically((fs::path(log_dir_) / "hparams.yaml").string(), os.str());
}

void CsvLogger::LogMetrics(const std::map<std::string, double>& metrics, int64_t step) {
  auto row = metrics;
  row["step"] = static_cast<double>(step);
  rows_.push_back(std::move(row));
}

void CsvLogger::Save() {
  std::set<std::string> keys;
  for (const auto& r : rows_)
    for (const auto& [k, v] : r) keys.insert(k);
  std::ostringstream os;
  bool first = true;
  for (const auto& k : keys) {
    os << (first ? "" : ",") << k;
    first = false;
  }
  os << "\n";
  for (const auto& r : rows_) {
    first = true;
    for (const auto& k : keys) {
      if (!first) os << ",";
      first = false;
      auto it = r.find(k);
      if (it == r.end()) continue;
      if ((k == "step" || k == "epoch") && it->second == static_cast<double>(static_cast<int64_t>(it->second))) {
        os << static_cast<int64_t>(it->second);
      } else {
        os << std::setprecision(9) << it->second;
      }
    }
    os << "\n";
  }
  WriteAtomically((fs::path(log_dir_) / "metrics.csv").string(), os.str());
}

}  // namespace shardtrain::trainer
