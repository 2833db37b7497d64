// Safetensors files (trainer/checkpoint_io/safetensors.h).
#include "trainer/checkpoint_io/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "base/errors.h"
#include "base/file_util.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/internal/zip_writer.h"

namespace shardtrain::trainer {
namespace {

// The Python library's own bound on the header (safetensors' MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const std::vector<std::pair<std::string, at::ScalarType>>& DtypeNames() {
  static const std::vector<std::pair<std::string, at::ScalarType>> kNames = {
      {"F64", at::kDouble},
      {"F32", at::kFloat},
      {"F16", at::kHalf},
      {"BF16", at::kBFloat16},
      {"I64", at::kLong},
      {"I32", at::kInt},
      {"I16", at::kShort},
      {"I8", at::kChar},
      {"U8", at::kByte},
      {"BOOL", at::kBool},
      {"U16", at::kUInt16},
      {"U32", at::kUInt32},
      {"U64", at::kUInt64},
      {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2},
  };
  return kNames;
}

std::string ValidDtypes() {
  std::string out;
  for (const auto& [name, type] : DtypeNames()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// numel of `shape`, or -1 when a dimension is negative or the product overflows.
int64_t NumelOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) return -1;
    n *= d;
  }
  return n;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

SafetensorsEntry ParseEntry(const std::string& where, const std::string& name, const nlohmann::json& v) {
  const std::string what = where + ": tensor '" + name + "'";
  if (!v.is_object()) ST_THROW(Error, what, ": its entry is ", v.type_name(), ", not an object");
  SafetensorsEntry e;
  e.name = name;
  auto dtype = v.find("dtype");
  if (dtype == v.end() || !dtype->is_string()) ST_THROW(Error, what, ": no \"dtype\" string");
  e.dtype = SafetensorsDtype(dtype->get<std::string>(), what);
  auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array()) ST_THROW(Error, what, ": no \"shape\" array");
  for (const auto& d : *shape) {
    if (!d.is_number_unsigned()) ST_THROW(Error, what, ": shape ", shape->dump(), " is not a list of sizes >= 0");
    e.shape.push_back(d.get<int64_t>());
  }
  auto offsets = v.find("data_offsets");
  if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    ST_THROW(Error, what, ": no \"data_offsets\" [begin, end] of byte offsets");
  }
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  if (e.end < e.begin) ST_THROW(Error, what, ": data_offsets [", e.begin, ", ", e.end, "] end before they begin");
  const int64_t numel = NumelOf(e.shape);
  const uint64_t element = c10::elementSize(e.dtype);
  if (numel < 0 || static_cast<uint64_t>(numel) > std::numeric_limits<uint64_t>::max() / element ||
      static_cast<uint64_t>(numel) * element != e.end - e.begin) {
    ST_THROW(Error, what, ": ", SafetensorsDtypeName(e.dtype), " of shape ", ShapeText(e.shape), " needs ",
             numel < 0 ? std::string("too many") : std::to_string(numel * element), " bytes but data_offsets [",
             e.begin, ", ", e.end, "] hold ", e.end - e.begin);
  }
  return e;
}

// Entries sorted by offset must tile the data section exactly, as the
// Python library requires.
void CheckTiling(const std::string& where, std::vector<SafetensorsEntry>& entries, uint64_t data_bytes) {
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t at = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& e = entries[i];
    if (e.end > data_bytes) {
      ST_THROW(Error, where, ": tensor '", e.name, "' lies at data bytes [", e.begin, ", ", e.end,
               ") but the data section has ", data_bytes, " bytes (truncated file?)");
    }
    if (e.begin < at) {
      ST_THROW(Error, where, ": tensor '", e.name, "' at data bytes [", e.begin, ", ", e.end, ") overlaps tensor '",
               entries[i - 1].name, "' (ends at ", at, ")");
    }
    if (e.begin > at) {
      ST_THROW(Error, where, ": data bytes [", at, ", ", e.begin, ") before tensor '", e.name,
               "' belong to no tensor (a gap: not a valid safetensors file)");
    }
    at = e.end;
  }
  if (at != data_bytes) {
    ST_THROW(Error, where, ": the data section has ", data_bytes, " bytes but its tensors cover ", at,
             " (trailing bytes belong to no tensor)");
  }
}

}  // namespace

int64_t SafetensorsEntry::numel() const { return NumelOf(shape); }

std::string SafetensorsDtypeName(at::ScalarType dtype) {
  for (const auto& [name, type] : DtypeNames()) {
    if (type == dtype) return name;
  }
  ST_THROW(InvalidArgumentError, "safetensors has no dtype for ", dtype, "; valid: ", ValidDtypes());
}

at::ScalarType SafetensorsDtype(const std::string& name, const std::string& context) {
  for (const auto& [n, type] : DtypeNames()) {
    if (n == name) return type;
  }
  ST_THROW(Error, context, ": dtype '", name, "' is not supported; valid: ", ValidDtypes());
}

SafetensorsHeader ParseSafetensorsHeader(const std::string& file, const uint8_t* bytes, uint64_t file_size) {
  const std::string where = "safetensors file '" + file + "'";
  if (file_size < 8) {
    ST_THROW(Error, where, " has ", file_size, " bytes: too short for the 8-byte header length (truncated?)");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > file_size - 8) {
    ST_THROW(Error, where, ": the header length says ", n, " bytes but the file has ", file_size - 8,
             " after it (truncated, or not a safetensors file)");
  }
  if (n > kMaxHeaderBytes) ST_THROW(Error, where, ": a header of ", n, " bytes is over the limit of ", kMaxHeaderBytes);
  const auto* text = reinterpret_cast<const char*>(bytes + 8);
  nlohmann::json header = nlohmann::json::parse(text, text + n, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) ST_THROW(Error, where, ": its ", n, "-byte header is not valid JSON");
  if (!header.is_object()) ST_THROW(Error, where, ": its header is a JSON ", header.type_name(), ", not an object");
  SafetensorsHeader out;
  out.data_offset = 8 + n;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) ST_THROW(Error, where, ": \"__metadata__\" is not an object of strings");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) ST_THROW(Error, where, ": \"__metadata__\" value '", mk, "' is not a string");
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(ParseEntry(where, key, value));
  }
  CheckTiling(where, out.entries, file_size - out.data_offset);
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    ST_THROW(Error, "cannot open safetensors file '", path, "': ", std::strerror(errno));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) ParseSafetensorsHeader(path, nullptr, size);  // throws: too short
  file_ = std::make_unique<MappedFile>(path);
  const at::Tensor all = file_->Bytes(0, file_->size(), "the whole file");
  header_ = ParseSafetensorsHeader(path, all.data_ptr<uint8_t>(), file_->size());
  for (size_t i = 0; i < header_.entries.size(); ++i) index_[header_.entries[i].name] = i;
}

SafetensorsFile::~SafetensorsFile() = default;
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;

const std::string& SafetensorsFile::path() const { return file_->path(); }

const SafetensorsEntry& SafetensorsFile::Entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    ST_THROW(Error, "safetensors file '", path(), "' has no tensor '", name, "' (it has ", header_.entries.size(),
             " tensors", header_.entries.empty() ? "" : ", e.g. '" + header_.entries.front().name + "'", ")");
  }
  return header_.entries[it->second];
}

at::Tensor SafetensorsFile::Tensor(const std::string& name) const {
  const SafetensorsEntry& e = Entry(name);
  return Range(name, 0, e.numel()).view(e.shape);
}

at::Tensor SafetensorsFile::Range(const std::string& name, int64_t first, int64_t count) const {
  const SafetensorsEntry& e = Entry(name);
  ST_CHECK_ARG(first >= 0 && count >= 0 && first <= e.numel() - count, "safetensors file '", path(), "': tensor '",
               name, "' has ", e.numel(), " elements; elements [", first, ", ", first + count, ") are out of range");
  const uint64_t element = c10::elementSize(e.dtype);
  const uint64_t offset = header_.data_offset + e.begin + static_cast<uint64_t>(first) * element;
  const at::Tensor bytes = file_->Bytes(offset, static_cast<uint64_t>(count) * element, "tensor '" + name + "'");
  if (offset % element == 0) return bytes.view(e.dtype);  // the mapping is page-aligned
  at::Tensor copy = at::empty({count}, at::TensorOptions().dtype(e.dtype));
  if (count > 0) std::memcpy(copy.data_ptr(), bytes.data_ptr(), static_cast<size_t>(count) * element);
  return copy;
}

namespace {

// The JSON header of `layout`, padded with spaces so the data starts 8-aligned.
std::string HeaderText(const std::string& path, const std::vector<SafetensorsEntry>& layout,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t at = 0;
  for (const SafetensorsEntry& e : layout) {
    ST_CHECK_ARG(!e.name.empty() && e.name != "__metadata__" && names.insert(e.name).second, "WriteSafetensors('", path,
                 "'): the tensor name '", e.name, "' is empty, reserved or repeated");
    const int64_t numel = e.numel();
    ST_CHECK_ARG(numel >= 0, "WriteSafetensors('", path, "'): tensor '", e.name, "' has a bad shape ",
                 ShapeText(e.shape));
    const uint64_t bytes = static_cast<uint64_t>(numel) * c10::elementSize(e.dtype);
    header[e.name] =
        nlohmann::ordered_json::object({{"dtype", SafetensorsDtypeName(e.dtype)},
                                        {"shape", e.shape},
                                        {"data_offsets", nlohmann::ordered_json::array({at, at + bytes})}});
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

void WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& layout,
                      const std::function<at::Tensor(size_t)>& fill,
                      const std::map<std::string, std::string>& metadata) {
  const std::string text = HeaderText(path, layout, metadata);
  FileSink sink(path);  // a temporary beside `path`, removed unless committed
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  sink.Write(length, sizeof length);
  sink.Write(text.data(), text.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    const SafetensorsEntry& e = layout[i];
    at::Tensor t = fill(i);
    ST_CHECK_ARG(t.defined() && t.scalar_type() == e.dtype && t.sizes().vec() == e.shape, "WriteSafetensors('", path,
                 "'): tensor '", e.name, "' should be ", SafetensorsDtypeName(e.dtype), " of shape ",
                 ShapeText(e.shape), ", got ", t.defined() ? c10::toString(t.scalar_type()) : "an undefined tensor",
                 t.defined() ? " of shape " + ShapeText(t.sizes().vec()) : "");
    t = t.to(at::kCPU).contiguous();
    sink.Write(t.data_ptr(), t.nbytes());
  }
  sink.Commit();
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> layout,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tmp_(TemporaryBeside(path, "st")), layout_(std::move(layout)), written_(layout_.size(), false) {
  const std::string text = HeaderText(path, layout_, metadata);
  uint64_t at = 0;
  for (size_t i = 0; i < layout_.size(); ++i) {
    index_[layout_[i].name] = i;
    layout_[i].begin = at;
    at += static_cast<uint64_t>(layout_[i].numel()) * c10::elementSize(layout_[i].dtype);
    layout_[i].end = at;
  }
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) ST_THROW(Error, "cannot create ", tmp_, " (for ", path, "): ", std::strerror(errno));
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>(static_cast<uint64_t>(text.size()) >> (8 * i));
  head += text;
  data_offset_ = head.size();
  WriteAt(head.data(), head.size(), 0);
  if (::ftruncate(fd_, static_cast<off_t>(data_offset_ + at)) != 0) {
    ST_THROW(Error, "cannot size ", tmp_, " (for ", path, "): ", std::strerror(errno));
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void SafetensorsWriter::WriteAt(const void* data, size_t n, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) ST_THROW(Error, "cannot write ", tmp_, " (for ", path_, "): ", std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void SafetensorsWriter::Write(const std::string& name, const at::Tensor& t) {
  auto it = index_.find(name);
  ST_CHECK_ARG(it != index_.end(), "SafetensorsWriter('", path_, "'): no tensor '", name, "' in its layout");
  const SafetensorsEntry& e = layout_[it->second];
  ST_CHECK_ARG(!written_[it->second], "SafetensorsWriter('", path_, "'): tensor '", name, "' written twice");
  ST_CHECK_ARG(t.defined() && t.sizes().vec() == e.shape, "SafetensorsWriter('", path_, "'): tensor '", name,
               "' should have shape ", ShapeText(e.shape), ", got ",
               t.defined() ? ShapeText(t.sizes().vec()) : "an undefined tensor");
  const at::Tensor bytes = t.detach().to(at::kCPU, e.dtype).contiguous();
  WriteAt(bytes.data_ptr(), bytes.nbytes(), data_offset_ + e.begin);
  written_[it->second] = true;
}

void SafetensorsWriter::Commit() {
  for (size_t i = 0; i < layout_.size(); ++i) {
    ST_CHECK_ARG(written_[i], "SafetensorsWriter('", path_, "'): tensor '", layout_[i].name, "' was never written");
  }
  if (::fsync(fd_) != 0) ST_THROW(Error, "cannot fsync ", tmp_, ": ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    ST_THROW(Error, "cannot rename ", tmp_, " to ", path_, ": ", std::strerror(errno));
  }
  committed_ = true;
  SyncDirectory(std::filesystem::path(path_).parent_path().string());
}

}  // namespace shardtrain::trainer
