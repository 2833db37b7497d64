// torch.save-format archives without holding their tensors in memory.
//
// The format is the zip archive torch.save writes: one record per tensor
// storage ("<archive>/data/<key>", stored uncompressed, 64-byte aligned) and a
// pickle ("<archive>/data.pkl") of the root object whose tensors refer to
// those records by key. Lists and dicts are pickled without LibTorch's
// container type tags, so Python's torch.load(path, weights_only=True) reads
// the file, and so do torch::pickle_load and MapArchive.
//
// ArchiveWriter streams: each tensor's bytes go to the file when Add() is
// called, so a caller can gather, add and drop tensors one at a time.
// MapArchive maps a file and hands out tensors that are views of the mapping:
// only the pages a reader touches are read.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_ARCHIVE_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_ARCHIVE_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace c10 {
struct IValue;
}

namespace shardtrain::trainer {

// Streams a torch.save-format zip archive into a file: each tensor's bytes
// are written as a record when Add() is called; Finish() pickles the root
// object (whose tensors are the placeholders Add returned), writes data.pkl,
// the end of the archive, fsyncs and renames the temporary file into place.
// The file appears at `path` only when Finish() succeeds (a previous file
// there stays untouched until then). I/O errors throw shardtrain::Error
// naming the file.
class ArchiveWriter {
 public:
  explicit ArchiveWriter(std::string path);
  ~ArchiveWriter();  // without Finish(): removes the temporary file
  ArchiveWriter(const ArchiveWriter&) = delete;
  ArchiveWriter& operator=(const ArchiveWriter&) = delete;

  // Writes t's elements (not the rest of its storage; CUDA tensors are copied
  // to the CPU first) now; returns a data-less placeholder with t's dtype and
  // shape to put into the root object. Adding the same placeholder twice in
  // the root (e.g. a tied weight under two names) stores it once.
  at::Tensor Add(const at::Tensor& t);
  // Root may hold placeholders only (no other tensors); throws
  // shardtrain::InvalidArgumentError otherwise.
  void Finish(const c10::IValue& root);

  const std::string& path() const { return path_; }

 private:
  struct State;
  std::string path_;
  std::unique_ptr<State> state_;
};

// Several whole torch.save-format archives back to back in one file (PyTorch
// DCP's rank files: each tensor chunk and each other value is torch.save'd on
// its own and found by offset and length). Each archive starts on a 64-byte
// boundary of the file, so its records do too. Like ArchiveWriter, the file
// appears at `path` only when Finish() succeeds.
class ArchiveSequenceWriter {
 public:
  struct Span {
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  explicit ArchiveSequenceWriter(std::string path);
  ~ArchiveSequenceWriter();  // without Finish(): removes the temporary file
  ArchiveSequenceWriter(const ArchiveSequenceWriter&) = delete;
  ArchiveSequenceWriter& operator=(const ArchiveSequenceWriter&) = delete;

  // An archive whose root is a tensor of t's dtype and shape holding t's
  // elements (what torch.save(t.contiguous()) writes), written from t itself.
  // `crc`: TensorCrc32(t), when the caller computed it already (an
  // asynchronous save computes them at the save, beside training).
  Span AppendTensor(const at::Tensor& t, std::optional<uint32_t> crc = {});
  // An archive whose root is `v`, which holds no tensor (a number, string, list...).
  Span AppendObject(const c10::IValue& v);
  // Fsyncs, closes and renames the file into place.
  void Finish();

  const std::string& path() const { return path_; }

 private:
  struct State;
  std::string path_;
  std::unique_ptr<State> state_;
};

// A file mapped once (read-only, private), for reading several archives out
// of it (MapArchive reads a whole-file archive).
class MappedFile {
 public:
  // Throws shardtrain::Error naming the file when it is missing or empty.
  explicit MappedFile(const std::string& path);
  uint64_t size() const;
  const std::string& path() const { return path_; }
  // The archive in bytes [offset, offset + length) of the file, as
  // MapArchive reads a file: tensors are zero-copy views of the mapping.
  // `what` names the item in errors (e.g. "chunk of 'model.w' at offset 0").
  c10::IValue Archive(uint64_t offset, uint64_t length, const std::string& what) const;
  // Bytes [offset, offset + length) of the file as a zero-copy uint8 tensor
  // of the mapping (ReleaseMappedPages applies to it); `what` as above.
  at::Tensor Bytes(uint64_t offset, uint64_t length, const std::string& what) const;

 private:
  struct Mapped;
  std::string path_;
  std::shared_ptr<Mapped> m_;
};

// Opens a torch.save-format archive with every tensor a zero-copy view of
// the memory-mapped file: bytes are read (and count as resident) only when
// touched. The mapping lives as long as any of its tensors. The mapping is
// private: writing into a tensor never changes the file. Throws
// shardtrain::Error naming the file when it is missing or not such an archive.
c10::IValue MapArchive(const std::string& path);

// "" when every tensor in `v` has a dtype LibTorch has kernels for (floating,
// complex, integer, bool, quantized), else what the first other one is: a
// pickle may name placeholder dtypes (torch.int5...) that load but cannot be
// copied. MapArchive checks it; for values read by other means.
std::string UnloadableTensorIn(const c10::IValue& v);

// Drops from this process the whole pages of `t`'s bytes when `t` is a view
// of a MapArchive mapping (they stay in the page cache; a later read pages
// them in again from the file, so values written into the private mapping
// would be lost: only for records nobody wrote to); does nothing for any
// other tensor. For use
// once a load has copied what it needs from a mapped record
// (sharding::SourceReleaseScope), so a rank's resident memory does not grow
// by the whole file.
void ReleaseMappedPages(const at::Tensor& t);

// The CRC-32 of the bytes an archive record of t holds (its elements,
// contiguous), as ArchiveSequenceWriter::AppendTensor would compute it.
uint32_t TensorCrc32(const at::Tensor& t);

// `v` with every list and dict retyped to hold Any: LibTorch pickles lists of
// a specialized element type (int, tensor, ...) as torch.jit._pickle.build_*
// calls, which Python's weights_only unpickler rejects; plain ones it reads.
c10::IValue PlainForPickle(const c10::IValue& v);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_ARCHIVE_H_
