#include "trainer/loggers/tensorboard_logger.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

namespace tensorboard {
namespace {

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void PutFixed(std::string& out, T v) {  // little endian (x86, ARM)
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

void PutTag(std::string& out, int field, int wire_type) { PutVarint(out, (static_cast<uint64_t>(field) << 3) | wire_type); }

void PutBytes(std::string& out, int field, const std::string& bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out += bytes;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = MakeTable();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(const void* data, size_t n) {
  const uint32_t c = Crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string TfRecord(const std::string& data) {
  std::string out;
  const uint64_t len = data.size();
  PutFixed(out, len);
  PutFixed(out, MaskedCrc32c(out.data(), 8));
  out += data;
  PutFixed(out, MaskedCrc32c(data.data(), data.size()));
  return out;
}

std::string FileVersionEvent(double wall_time) {
  std::string e;
  PutTag(e, 1, 1);
  PutFixed(e, wall_time);
  PutTag(e, 2, 0);
  PutVarint(e, 0);
  PutBytes(e, 3, "brain.Event:2");
  return e;
}

std::string ScalarsEvent(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    PutBytes(v, 1, tag);
    PutTag(v, 2, 5);
    PutFixed(v, value);
    PutBytes(summary, 1, v);
  }
  std::string e;
  PutTag(e, 1, 1);
  PutFixed(e, wall_time);
  PutTag(e, 2, 0);
  PutVarint(e, static_cast<uint64_t>(step));  // int64: negative steps as 10-byte varints
  PutBytes(e, 5, summary);
  return e;
}

}  // namespace tensorboard

namespace {
double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

TensorBoardLogger::TensorBoardLogger(std::string root_dir, std::string name, int version) {
  log_dir_ = MakeVersionedLogDir("TensorBoardLogger", root_dir, name, &version);
  version_ = version;
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const double now = Now();
  // TensorBoard's writer names files events.out.tfevents.<seconds>.<host>;
  // a counter keeps two loggers started in the same second apart.
  std::string file = (fs::path(log_dir_) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." +
                                            host)).string();
  for (int i = 1; fs::exists(file); ++i) {
    file = (fs::path(log_dir_) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host +
                                  "." + std::to_string(i))).string();
  }
  event_file_ = file;
  file_ = std::fopen(event_file_.c_str(), "wb");
  ST_CHECK_ARG(file_ != nullptr, "TensorBoardLogger: cannot create '", event_file_, "': ", std::strerror(errno));
  Write(tensorboard::FileVersionEvent(now));
  Save();
}

TensorBoardLogger::~TensorBoardLogger() {
  if (file_) std::fclose(file_);
}

void TensorBoardLogger::Write(const std::string& event) {
  const std::string rec = tensorboard::TfRecord(event);
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size()) {
    ST_THROW(Error, "TensorBoardLogger: failed writing '", event_file_, "': ", std::strerror(errno));
  }
}

void TensorBoardLogger::LogHyperparams(const std::map<std::string, std::string>& hparams) {
  WriteHparamsYaml(log_dir_, hparams);
}

void TensorBoardLogger::LogMetrics(const std::map<std::string, double>& metrics, int64_t step) {
  std::vector<std::pair<std::string, float>> scalars;
  for (const auto& [k, v] : metrics) scalars.emplace_back(k, static_cast<float>(v));
  if (!scalars.empty()) Write(tensorboard::ScalarsEvent(Now(), step, scalars));
}

void TensorBoardLogger::AddScalar(const std::string& tag, double value, int64_t step) { LogMetrics({{tag, value}}, step); }

void TensorBoardLogger::Save() {
  if (file_ && std::fflush(file_) != 0) {
    ST_THROW(Error, "TensorBoardLogger: failed flushing '", event_file_, "': ", std::strerror(errno));
  }
}

}  // namespace shardtrain::trainer
