// trainer/checkpoint_io/internal/zip_writer.h: FileSink and ZipWriter, read
// back by LibTorch's zip reader (the one torch.load uses) with and without
// O_DIRECT and zip64 fields. archive_python_test checks the same files with
// Python's zipfile, which verifies every CRC-32 (`archive_test zip <dir>`).
#include "trainer/checkpoint_io/internal/zip_writer.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/trainer/zip_fixture.h"

namespace shardtrain::trainer {

// The records of the test archives; byte i of record r is (i * 31 + r * 7) & 255
// (archive_check.py builds the same). Their addresses: one page-aligned, one
// 64 bytes past a page (FileSink writes both from memory), one unaligned.
ZipFixture::ZipFixture() : buffer_(static_cast<char*>(std::aligned_alloc(4096, kBytes)), &std::free) {
  const struct {
    const char* name;
    size_t at, size;
  } layout[] = {{"empty", 0, 0},
                {"tiny", 8192, 5},
                {"unaligned", 3 * 4096 + 3, 5000},
                {"page_aligned", 8 * 4096, (3 << 20) + 5},
                {"offset_by_64", (4 << 20) + 64, (1 << 20) + 4096}};
  for (size_t r = 0; r < std::size(layout); ++r) {
    char* p = buffer_.get() + layout[r].at;
    for (size_t i = 0; i < layout[r].size; ++i) p[i] = static_cast<char>((i * 31 + r * 7) & 255);
    records_.push_back({layout[r].name, p, layout[r].size});
  }
}

void ZipFixture::WriteArchive(FileSink* sink, bool zip64) const {
  ZipWriter zip(sink);
  if (zip64) zip.ForceZip64ForTesting();
  for (const Record& r : records_) zip.WriteRecord(r.name, r.data, r.size);
  zip.Finish();
}

std::unique_ptr<FileSink> ZipFixture::OpenSink(const std::string& path, bool direct) {
  ::setenv("SHARDTRAIN_CHECKPOINT_DIRECT_IO", direct ? "1" : "0", 1);
  auto sink = std::make_unique<FileSink>(path);
  ::unsetenv("SHARDTRAIN_CHECKPOINT_DIRECT_IO");
  return sink;
}

void ZipFixture::WriteFile(const std::string& path, bool direct, bool zip64) const {
  const std::unique_ptr<FileSink> sink = OpenSink(path, direct);
  WriteArchive(sink.get(), zip64);
  sink->Commit();
}

namespace {
namespace fs = std::filesystem;

// Bytes [offset, offset + size) of a file image, as one archive.
class SliceReader : public caffe2::serialize::ReadAdapterInterface {
 public:
  SliceReader(const std::string* bytes, size_t offset, size_t size) : bytes_(bytes), offset_(offset), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = std::min<size_t>(n, size_ - pos);
    std::memcpy(buf, bytes_->data() + offset_ + pos, n);
    return n;
  }

 private:
  const std::string* bytes_;
  size_t offset_, size_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string Tmp(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return (fs::path(dir ? dir : "/tmp") / name).string();
}

// Whether the test's file system takes O_DIRECT (ext4 does; tmpfs and some
// overlay file systems refuse it, and FileSink then writes plainly).
bool FileSystemTakesDirectIo() {
  const std::string probe = Tmp("direct_probe");
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

TEST(ZipWriterTest, Crc32IsZipsChecksumAndContinues) {
  EXPECT_EQ(Crc32(0, "123456789", 9), 0xCBF43926u);  // the standard check value
  EXPECT_EQ(Crc32(Crc32(0, "1234", 4), "56789", 5), 0xCBF43926u);
  EXPECT_EQ(Crc32(0, "", 0), 0u);
}

// Two archives in one file after 64 bytes of other data (a DCP rank file),
// every record read back byte for byte at a 64-byte aligned offset, large
// aligned ones at the offset that agrees with their address (O_DIRECT).
TEST(ZipWriterTest, ArchivesReadBackWithAndWithoutDirectIoAndZip64) {
  const ZipFixture fixture;
  const bool direct_io = FileSystemTakesDirectIo();
  if (!direct_io) std::printf("skipped: the O_DIRECT cases write plainly (the test's file system refuses O_DIRECT)\n");
  for (bool direct : {true, false}) {
    for (bool zip64 : {false, true}) {
      SCOPED_TRACE(std::string(direct ? "O_DIRECT" : "plain") + (zip64 ? ", zip64" : ""));
      const std::string path = Tmp("two_archives.bin");
      const std::unique_ptr<FileSink> owned = ZipFixture::OpenSink(path, direct);
      FileSink& sink = *owned;
      EXPECT_EQ(sink.direct(), direct && direct_io);
      const std::string head(64, 'x');
      sink.Write(head.data(), head.size());
      const uint64_t first = sink.position();
      fixture.WriteArchive(&sink, zip64);
      const std::string pad((64 - sink.position() % 64) % 64, '\0');
      sink.Write(pad.data(), pad.size());
      const uint64_t second = sink.position();
      fixture.WriteArchive(&sink, zip64);
      const uint64_t end = sink.position();
      sink.Commit();
      const std::string bytes = ReadFile(path);
      ASSERT_EQ(bytes.size(), end);
      EXPECT_EQ(bytes.substr(0, 64), head);
      for (auto [at, size] :
           {std::pair<uint64_t, uint64_t>{first, second - pad.size() - first}, {second, end - second}}) {
        caffe2::serialize::PyTorchStreamReader reader(std::make_shared<SliceReader>(&bytes, at, size));
        for (const ZipFixture::Record& r : fixture.records()) {
          SCOPED_TRACE(r.name);
          auto [data, n] = reader.getRecord(r.name);
          ASSERT_EQ(n, r.size);
          if (n > 0) {
            EXPECT_EQ(std::memcmp(data.get(), r.data, n), 0);
          }
          const uint64_t offset = at + reader.getRecordOffset(r.name);
          EXPECT_EQ(offset % 64, 0u);
          const auto addr = reinterpret_cast<uintptr_t>(r.data);
          if (r.size >= FileSink::kBlock && addr % 64 == 0) {
            EXPECT_EQ(offset % 4096, addr % 4096);  // either way
          }
        }
        EXPECT_EQ(std::get<1>(reader.getRecord("version")), 2u);
        EXPECT_EQ(reader.serializationId().size(), 40u);
      }
    }
  }
}

TEST(ZipWriterTest, UncommittedSinkLeavesNoFileAndErrorsNameTheFile) {
  const std::string dir = Tmp("uncommitted");
  fs::remove_all(dir);
  {
    FileSink sink(dir + "/a.bin");
    sink.Write("abc", 3);
  }
  EXPECT_TRUE(fs::is_empty(dir));
  std::ofstream(dir + "/plain") << "x";
  try {
    FileSink sink(dir + "/plain/a.bin");  // a file where a directory should be
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("plain"), std::string::npos) << e.what();
  }
  FileSink sink(dir + "/b.bin");
  ZipWriter zip(&sink);
  zip.Finish();
  EXPECT_THROW(zip.WriteRecord("late", "x", 1), InvalidArgumentError);
}

}  // namespace
}  // namespace shardtrain::trainer
