#include "trainer/checkpoint_io/internal/zip_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#if __has_include(<isa-l/crc.h>)
#include <isa-l/crc.h>
#define SHARDTRAIN_HAVE_ISAL 1
#endif

#include "base/errors.h"
#include "base/file_util.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;
namespace {

constexpr size_t kStage = size_t{1} << 20;  // FileSink's block buffer (a multiple of kBlock)
constexpr uint32_t kMax32 = 0xFFFFFFFFu;
constexpr uint16_t kDosDate = (1 << 5) | 1;  // 1980-01-01, the earliest a zip header can say
constexpr uint16_t kPaddingId = 0x5453;      // "ST": an unregistered extra field; readers skip it
constexpr uint16_t kZip64Id = 0x0001;

bool DirectIoWanted() {
  const char* v = std::getenv("SHARDTRAIN_CHECKPOINT_DIRECT_IO");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

void Put16(std::string& b, uint64_t v) {
  b.push_back(static_cast<char>(v & 0xff));
  b.push_back(static_cast<char>((v >> 8) & 0xff));
}
void Put32(std::string& b, uint64_t v) {
  Put16(b, v & 0xffff);
  Put16(b, (v >> 16) & 0xffff);
}
void Put64(std::string& b, uint64_t v) {
  Put32(b, v & kMax32);
  Put32(b, v >> 32);
}

// 64 bits from the records' checksums and sizes, for the serialization id.
uint64_t Fingerprint(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ull;  // FNV-1a
  return h;
}

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
#ifdef SHARDTRAIN_HAVE_ISAL
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
#else  // a build without ISA-L (bench/gpu's CMake fallback): byte at a time
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
#endif
}

FileSink::FileSink(const std::string& path) : path_(path) {
  static std::atomic<int64_t> counter{0};
  fs::path p(path_);
  ST_CHECK_ARG(p.has_filename(), "'", path_, "' names no file (give a file path, not a directory)");
  std::error_code ec;
  fs::create_directories(p.has_parent_path() ? p.parent_path() : fs::path("."), ec);
  tmp_ = TemporaryBeside(path_, std::to_string(counter++));
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (DirectIoWanted()) {
    stage_ = static_cast<char*>(std::aligned_alloc(kBlock, kStage));
    if (stage_ != nullptr) fd_ = ::open(tmp_.c_str(), flags | O_DIRECT, 0644);
    direct_ = fd_ >= 0;
  }
  if (!direct_) {
    std::free(stage_);  // plain writes need no stage (and a throw below skips the destructor)
    stage_ = nullptr;
    fd_ = ::open(tmp_.c_str(), flags, 0644);
  }
  if (fd_ < 0) ST_THROW(Error, "cannot create '", tmp_, "': ", std::strerror(errno));
}

FileSink::~FileSink() {
  if (!committed_) {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(tmp_.c_str());
  }
  std::free(stage_);
}

void FileSink::StopDirect() {
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT);
  direct_ = false;
}

void FileSink::WriteOut(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && direct_) {  // the file system wants another alignment: write plainly
      StopDirect();
      continue;
    }
    if (w <= 0) ST_THROW(Error, "failed writing '", tmp_, "': ", w < 0 ? std::strerror(errno) : "short write");
    if (direct_ && static_cast<size_t>(w) % kBlock != 0) StopDirect();  // the offset is unaligned from here on
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void FileSink::FlushStaged() {
  WriteOut(stage_, staged_);
  staged_ = 0;
}

void FileSink::Write(const void* data, size_t n) {
  ST_CHECK_ARG(!committed_, "writing '", path_, "' after it was committed");
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!direct_) {
      if (staged_ > 0) FlushStaged();
      WriteOut(p, n);
      position_ += n;
      return;
    }
    // The staged bytes start at a block boundary of the file; with none
    // staged, an aligned run goes straight from memory.
    const size_t misaligned = reinterpret_cast<uintptr_t>(p) % kBlock;
    if (staged_ == 0 && misaligned == 0 && n >= kBlock) {
      const size_t m = n / kBlock * kBlock;
      WriteOut(p, m);
      p += m;
      n -= m;
      position_ += m;
      continue;
    }
    size_t c = std::min(n, kStage - staged_);
    if (misaligned == position_ % kBlock) {  // address and offset agree: stage up to the boundary, then go direct
      const size_t head = (kBlock - misaligned) % kBlock;
      if (n >= head + kBlock) c = std::min(c, head);
    }
    if (c == 0) {  // the stage is full, or ends where an aligned run starts
      FlushStaged();
      continue;
    }
    std::memcpy(stage_ + staged_, p, c);
    staged_ += c;
    p += c;
    n -= c;
    position_ += c;
  }
}

void FileSink::Commit() {
  ST_CHECK_ARG(!committed_, "committing '", path_, "' twice");
  if (staged_ > 0) {
    const size_t whole = direct_ ? staged_ / kBlock * kBlock : staged_;
    WriteOut(stage_, whole);
    if (whole < staged_) {  // the last partial block: O_DIRECT cannot write it
      StopDirect();
      WriteOut(stage_ + whole, staged_ - whole);
    }
    staged_ = 0;
  }
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    fd_ = -1;
    ST_THROW(Error, "failed flushing '", tmp_, "': ", std::strerror(errno));
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    ST_THROW(Error, "cannot rename '", tmp_, "' to '", path_, "': ", std::strerror(errno));
  }
  committed_ = true;
  fs::path p(path_);
  SyncDirectory(p.has_parent_path() ? p.parent_path().string() : ".");
}

ZipWriter::ZipWriter(FileSink* sink, std::string archive_name)
    : sink_(sink), prefix_(std::move(archive_name) + "/"), start_(sink->position()) {}

void ZipWriter::WriteRecord(const std::string& record, const void* data, size_t size,
                            std::optional<uint32_t> known_crc) {
  ST_CHECK_ARG(!finished_, "zip record '", record, "' written after the archive's end ('", sink_->path(), "')");
  static const char kEmpty = 0;
  if (size == 0) data = &kEmpty;
  const std::string name = prefix_ + record;
  const uint32_t crc = known_crc ? *known_crc : Crc32(0, data, size);
  const bool zip64 = force_zip64_ || size >= kMax32;
  const size_t extras = (zip64 ? 20 : 0) + 4;  // the zip64 sizes, the padding field's header
  // torch.save aligns records to 64 bytes; one of a block or more goes at the
  // file offset that agrees with its address modulo the block, so FileSink
  // writes it from memory.
  const uint64_t data_at = sink_->position() + 30 + name.size() + extras;
  const uint64_t addr = reinterpret_cast<uintptr_t>(data);
  const bool from_memory = size >= FileSink::kBlock && addr % 64 == 0;
  const uint64_t align = from_memory ? FileSink::kBlock : 64, want = from_memory ? addr % align : 0;
  const uint64_t pad = (want + align - data_at % align) % align;
  std::string h;
  Put32(h, 0x04034b50);
  Put16(h, zip64 ? 45 : 20);  // version needed: 4.5 for zip64
  Put16(h, 0);                // flags: sizes and CRC are here, not after the data
  Put16(h, 0);                // stored
  Put16(h, 0);
  Put16(h, kDosDate);
  Put32(h, crc);
  Put32(h, zip64 ? kMax32 : size);
  Put32(h, zip64 ? kMax32 : size);
  Put16(h, name.size());
  Put16(h, extras + pad);
  h += name;
  if (zip64) {
    Put16(h, kZip64Id);
    Put16(h, 16);
    Put64(h, size);
    Put64(h, size);
  }
  Put16(h, kPaddingId);
  Put16(h, pad);
  h.append(pad, 'Z');
  entries_.push_back({name, sink_->position() - start_, size, crc});
  sink_->Write(h.data(), h.size());
  sink_->Write(data, size);
}

void ZipWriter::Finish() {
  ST_CHECK_ARG(!finished_, "zip archive finished twice ('", sink_->path(), "')");
  WriteRecord("version", "3\n", 2);
  WriteRecord("byteorder", "little", 6);
  static std::atomic<uint64_t> counter{0};
  uint64_t content = 0xcbf29ce484222325ull, unique = content;
  for (const Entry& e : entries_) content = Fingerprint(Fingerprint(content, e.crc), e.size);
  unique = Fingerprint(unique, static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()));
  unique = Fingerprint(Fingerprint(unique, static_cast<uint64_t>(::getpid())), counter++);
  char id[41];
  std::snprintf(id, sizeof id, "%020llu%020llu", static_cast<unsigned long long>(content),
                static_cast<unsigned long long>(unique));
  WriteRecord(".data/serialization_id", id, 40);
  WriteCentralDirectory();
  finished_ = true;
}

void ZipWriter::WriteCentralDirectory() {
  const uint64_t cd_at = sink_->position() - start_;
  std::string c;
  for (const Entry& e : entries_) {
    const bool big_size = force_zip64_ || e.size >= kMax32;
    const bool big_offset = force_zip64_ || e.offset >= kMax32;
    std::string z64;  // only the fields whose 32-bit slot says 0xFFFFFFFF, in this order
    if (big_size) {
      Put64(z64, e.size);
      Put64(z64, e.size);
    }
    if (big_offset) Put64(z64, e.offset);
    Put32(c, 0x02014b50);
    Put16(c, 45);  // made by: zip 4.5, MS-DOS attributes
    Put16(c, z64.empty() ? 20 : 45);
    Put16(c, 0);
    Put16(c, 0);
    Put16(c, 0);
    Put16(c, kDosDate);
    Put32(c, e.crc);
    Put32(c, big_size ? kMax32 : e.size);
    Put32(c, big_size ? kMax32 : e.size);
    Put16(c, e.name.size());
    Put16(c, z64.empty() ? 0 : 4 + z64.size());
    Put16(c, 0);  // comment
    Put16(c, 0);  // disk
    Put16(c, 0);  // internal attributes
    Put32(c, 0);  // external attributes
    Put32(c, big_offset ? kMax32 : e.offset);
    c += e.name;
    if (!z64.empty()) {
      Put16(c, kZip64Id);
      Put16(c, z64.size());
      c += z64;
    }
  }
  const uint64_t cd_size = c.size(), n = entries_.size(), z64_end_at = cd_at + cd_size;
  Put32(c, 0x06064b50);  // zip64 end of central directory, as LibTorch's writer always adds
  Put64(c, 44);
  Put16(c, 45);
  Put16(c, 45);
  Put32(c, 0);
  Put32(c, 0);
  Put64(c, n);
  Put64(c, n);
  Put64(c, cd_size);
  Put64(c, cd_at);
  Put32(c, 0x07064b50);  // its locator
  Put32(c, 0);
  Put64(c, z64_end_at);
  Put32(c, 1);
  const bool big = force_zip64_ || z64_end_at >= kMax32;
  Put32(c, 0x06054b50);  // end of central directory
  Put16(c, 0);
  Put16(c, 0);
  Put16(c, std::min<uint64_t>(n, 0xFFFF));
  Put16(c, std::min<uint64_t>(n, 0xFFFF));
  Put32(c, big ? kMax32 : cd_size);
  Put32(c, big ? kMax32 : cd_at);
  Put16(c, 0);
  sink_->Write(c.data(), c.size());
}

}  // namespace shardtrain::trainer
