#include "trainer/loggers/logger.h"

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "base/errors.h"
#include "base/file_util.h"
#include "base/numbers.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

std::string MakeVersionedLogDir(const std::string& logger, const std::string& root_dir, const std::string& name,
                                int* version) {
  fs::path base = fs::path(root_dir) / name;
  std::error_code ec;
  fs::create_directories(base, ec);
  ST_CHECK_ARG(!ec, logger, ": cannot create '", base.string(), "': ", ec.message());
  if (*version < 0) {
    *version = 0;
    for (const auto& e : fs::directory_iterator(base)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("version_", 0) == 0) {
        try {
          *version = std::max(*version, std::stoi(n.substr(8)) + 1);
        } catch (const std::exception&) {
        }
      }
    }
  }
  const std::string dir = (base / ("version_" + std::to_string(*version))).string();
  fs::create_directories(dir, ec);
  ST_CHECK_ARG(!ec, logger, ": cannot create '", dir, "': ", ec.message());
  return dir;
}

void WriteHparamsYaml(const std::string& log_dir, const std::map<std::string, std::string>& hparams) {
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
  WriteFileAtomically((fs::path(log_dir) / "hparams.yaml").string(), os.str());
}

std::string HparamValue(double value) { return ShortestDecimal(value); }

}  // namespace shardtrain::trainer
