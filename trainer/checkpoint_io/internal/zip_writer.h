// The bytes of checkpoint files, written cheaply: a file sink that bypasses
// the page cache and a writer of stored zip archives in the layout torch.save
// uses. Plain C++ (no torch); archive.cc builds torch.save archives on them.
//
// Why not LibTorch's PyTorchStreamWriter: it checksums at about 1 GB/s and
// every byte then goes through the page cache, whose fresh pages cost more
// CPU than the copy itself (1.4 s per 600 MB on the project's 2-core VM), CPU
// that a save in the background takes from training. Here the CRC-32 is
// ISA-L's (about 12 GB/s) and the data of a record goes from the tensor to
// the disk without a copy (O_DIRECT).
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_INTERNAL_ZIP_WRITER_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_INTERNAL_ZIP_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain::trainer {

// CRC-32 as zip and zlib define it, continued from `crc` (0 to start).
uint32_t Crc32(uint32_t crc, const void* data, size_t n);

// A file written once, front to back, to a temporary name beside `path`, and
// renamed into place by Commit() (after fsync); destroyed uncommitted, it
// removes the temporary. Writes bypass the page cache (O_DIRECT) where the
// file system allows: bytes are gathered into an aligned block buffer, and a
// run of bytes whose address and file offset agree modulo kBlock goes to the
// disk from where it lies. Where O_DIRECT is refused (tmpfs, some network
// file systems; or SHARDTRAIN_CHECKPOINT_DIRECT_IO=0) writes are plain.
// Errors throw shardtrain::Error naming the file.
class FileSink {
 public:
  static constexpr size_t kBlock = 4096;

  explicit FileSink(const std::string& path);
  ~FileSink();
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  void Write(const void* data, size_t n);
  // Flushes, fsyncs and renames the file into place.
  void Commit();

  uint64_t position() const { return position_; }
  bool committed() const { return committed_; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }

 private:
  void WriteOut(const char* p, size_t n);  // to the file at the current end
  void FlushStaged();                      // all staged bytes (a multiple of kBlock while direct)
  void StopDirect();

  std::string path_, tmp_;
  int fd_ = -1;
  bool direct_ = false;
  bool committed_ = false;
  uint64_t position_ = 0;  // bytes written or staged
  char* stage_ = nullptr;  // kStage bytes, kBlock-aligned; holds the bytes from the last block boundary
  size_t staged_ = 0;
};

// One stored (uncompressed) zip archive in torch.save's layout, appended to
// a FileSink at its current position: each record's data 64-byte aligned
// (and, for large records, at the file offset that lets FileSink write it
// without a copy), CRC-32 in every header, zip64 fields where sizes or
// offsets need them. Offsets inside the archive count from where it starts,
// so archives can follow each other in one file (a DCP rank file).
class ZipWriter {
 public:
  // Records are named "<archive_name>/<name>".
  ZipWriter(FileSink* sink, std::string archive_name = "archive");

  // `crc`: the data's CRC-32 when the caller computed it already (else computed here).
  void WriteRecord(const std::string& name, const void* data, size_t size, std::optional<uint32_t> crc = {});
  // Writes the records torch.save adds ("version", "byteorder",
  // ".data/serialization_id") and the central directory.
  void Finish();

  // Tests: write every entry with zip64 fields, as a record over 4 GiB would.
  void ForceZip64ForTesting() { force_zip64_ = true; }

 private:
  struct Entry {
    std::string name;
    uint64_t offset, size;  // of the local header, from the archive's start; of the data
    uint32_t crc;
  };
  void WriteCentralDirectory();

  FileSink* sink_;
  std::string prefix_;
  uint64_t start_;
  std::vector<Entry> entries_;
  bool force_zip64_ = false;
  bool finished_ = false;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_INTERNAL_ZIP_WRITER_H_
