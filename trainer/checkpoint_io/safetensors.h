// Hugging Face safetensors files, read and written without Python.
//
// The format: 8 bytes little-endian N, then N bytes of JSON — an object
// mapping each tensor's name to {"dtype", "shape", "data_offsets": [begin,
// end]} (byte offsets into the data that follows the header), plus an
// optional "__metadata__" object of strings — then the data, every tensor's
// bytes in row-major order, little-endian, with no gaps between them.
//
// SafetensorsFile maps the file and hands out tensors that are zero-copy
// views of the mapping (only the pages a reader touches are read), or any
// element range of a tensor, so a rank reads only the bytes of its shards.
// Every malformed header stops with an error naming the file, the tensor and
// what was wrong. WriteSafetensors streams tensors into a file.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_SAFETENSORS_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_SAFETENSORS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::trainer {

class MappedFile;

// One tensor of a safetensors file.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
  int64_t numel() const;
};

// The parsed header of a safetensors file whose size is `file_size` bytes;
// `file` names it in errors. Throws shardtrain::Error for a header that is
// truncated, longer than the file, not JSON, or whose entries have an
// unknown dtype, a bad shape, offsets outside the data, overlapping or
// leaving gaps, or a byte count that disagrees with dtype and shape.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // where the data section starts in the file
};
SafetensorsHeader ParseSafetensorsHeader(const std::string& file, const uint8_t* bytes, uint64_t file_size);

// The safetensors dtype name ("F32", "BF16", ...) of a scalar type, and back;
// both throw naming the valid ones.
std::string SafetensorsDtypeName(at::ScalarType dtype);
at::ScalarType SafetensorsDtype(const std::string& name, const std::string& context);

class SafetensorsFile {
 public:
  // Maps `path` and parses its header (throws shardtrain::Error naming it).
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;

  const std::string& path() const;
  const std::vector<SafetensorsEntry>& entries() const { return header_.entries; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  bool Has(const std::string& name) const { return index_.count(name) > 0; }
  // Throws shardtrain::Error naming the file and the tensor when absent.
  const SafetensorsEntry& Entry(const std::string& name) const;
  // The whole tensor, a view of the mapping (a copy only when its bytes are
  // not aligned to its element size). Writing into it never changes the file.
  at::Tensor Tensor(const std::string& name) const;
  // Elements [first, first + count) of the tensor in row-major order, 1-D:
  // only those bytes are read.
  at::Tensor Range(const std::string& name, int64_t first, int64_t count) const;

 private:
  std::unique_ptr<MappedFile> file_;
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;
};

// Writes a safetensors file at `path` (atomically, through the checkpoint
// files' FileSink: a temporary beside it, O_DIRECT where the file system
// allows, fsynced and renamed into place) holding tensors of the given names, dtypes and shapes in that
// order; `fill(i)` returns the i-th tensor when its bytes are due, so a caller
// can gather, convert and drop them one at a time. Each must match its entry's
// dtype and shape (throws shardtrain::InvalidArgumentError naming it).
void WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& layout,
                      const std::function<at::Tensor(size_t)>& fill,
                      const std::map<std::string, std::string>& metadata = {});

// A safetensors file whose tensors arrive in any order, each exactly once
// (e.g. as a sharded model's units are gathered): the header is written
// first from the layout, each tensor's bytes at their own offset in a
// temporary beside `path`. Commit() checks that every tensor arrived, fsyncs
// and renames the file into place; destroyed uncommitted, it removes the
// temporary and `path` is untouched.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> layout,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  bool Has(const std::string& name) const { return index_.count(name) > 0; }
  // Writes tensor `name` (converted to its entry's dtype; its shape must
  // match). Throws InvalidArgumentError for an unknown name, another shape
  // or a second write; shardtrain::Error when the file cannot be written.
  void Write(const std::string& name, const at::Tensor& t);
  void Commit();

 private:
  void WriteAt(const void* data, size_t n, uint64_t offset);
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> layout_;
  std::map<std::string, size_t> index_;
  std::vector<bool> written_;
  bool committed_ = false;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_SAFETENSORS_H_
