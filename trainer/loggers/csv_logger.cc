#include "trainer/loggers/csv_logger.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "base/file_util.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

CsvLogger::CsvLogger(std::string root_dir, std::string name, int version) {
  log_dir_ = MakeVersionedLogDir("CsvLogger", root_dir, name, &version);
  version_ = version;
}

void CsvLogger::LogHyperparams(const std::map<std::string, std::string>& hparams) {
  WriteHparamsYaml(log_dir_, hparams);
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
  WriteFileAtomically((fs::path(log_dir_) / "metrics.csv").string(), os.str());
}

}  // namespace shardtrain::trainer
