// PyTorch Distributed Checkpoint (DCP) directories, as torch 2.11's
// FileSystemWriter writes them with one file per rank:
//
//   <dir>/.metadata         a Python pickle of torch.distributed.checkpoint's
//                           Metadata: for every flattened key of the state
//                           dict ("model.layers.0.weight",
//                           "optimizer_0.state.layers.0.weight.exp_avg"), a
//                           TensorStorageMetadata (dtype, global shape, the
//                           chunks: boxes of it) or a BytesStorageMetadata (a
//                           non-tensor value); planner_data: each key's path
//                           in the nested state dict; storage_data: where each
//                           chunk or value lies (file, offset, length)
//   <dir>/__<rank>_0.distcp each chunk and value torch.save'd on its own,
//                           back to back
//
// Python reads such a directory with torch.distributed.checkpoint.load and
// format_utils.dcp_to_torch_save; this code writes and reads the same bytes
// without Python. The pickle names torch's classes and their fields as torch
// 2.11 defines them (kTorchVersion, pinned in tools/bootstrap.sh); a
// .metadata naming a class or field this code does not know stops with a
// message naming it and the supported torch version. Model-free: what the
// keys mean (a model's parameters, an optimizer's state) is the caller's.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_DCP_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_DCP_H_

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainer/checkpoint_io/archive.h"

namespace c10 {
struct IValue;
}

namespace shardtrain::trainer::dcp {

inline constexpr const char* kTorchVersion = "2.11";  // the torch whose DCP classes .metadata names
inline constexpr const char* kDcpVersion = "1.0.0";   // Metadata.version that torch writes
inline constexpr const char* kMetadataFile = ".metadata";

// "__<rank>_0.distcp"
std::string RankFileName(int64_t rank);

// A box of a tensor (DCP's ChunkStorageMetadata): per dimension, where it
// starts and how long it is. A 0-d tensor's only box has no dimensions.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t numel() const;
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
};

// The few boxes that cover exactly the elements [begin, end) of a tensor of
// `shape` in row-major order (a flat shard's part of one parameter): a
// partial first row, whole rows, a partial last row, recursively. A 0-d
// tensor's range [0, 1) is one box with no dimensions.
std::vector<Box> BoxesOfRange(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

// The contiguous runs of a box in its tensor's row-major order, in the box's
// own order: fn(first element's index in the tensor, its index in the box,
// length). A box whose trailing dimensions are whole is one run; one cut
// along its last dimension (DTensor's Shard(1) of a matrix) is a run per row.
void ForEachRun(const std::vector<int64_t>& shape, const Box& box,
                const std::function<void(int64_t at, int64_t in_box, int64_t len)>& fn);
// The index in a tensor of `shape` (row-major) of the element at `offsets`.
int64_t FlatIndex(const std::vector<int64_t>& shape, const std::vector<int64_t>& offsets);

// Where a torch.save'd item lies: bytes [offset, offset + length) of `file`
// (a name inside the directory).
struct Location {
  std::string file;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct Chunk {
  Box box;
  Location where;
};

// A tensor of the state dict: dtype, global shape and its chunks (together
// they cover it, no two overlap).
struct TensorEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<Chunk> chunks;
};

// One step of a key's path in the nested state dict: a dict key, or a list
// position (index >= 0).
struct PathPart {
  std::string key;
  int64_t index = -1;
  bool operator==(const PathPart& o) const { return key == o.key && index == o.index; }
};

struct Metadata {
  std::map<std::string, TensorEntry> tensors;          // by flattened key
  std::map<std::string, Location> objects;             // non-tensor values, by flattened key
  std::map<std::string, std::vector<PathPart>> paths;  // planner_data: each key's path (every key has one)
  std::string version = kDcpVersion;
};

// The flattened key of a path, as DCP joins it ("optimizer_0.param_groups.0.lr").
std::string FlatKey(const std::vector<PathPart>& path);

// The .metadata pickle (Python's pickle.load builds torch's Metadata from
// it); `checkpoint_id` is the directory, recorded as StorageMeta.checkpoint_id.
std::string MetadataPickle(const Metadata& md, const std::string& checkpoint_id);
// Parses a .metadata pickle (after ScanPickle). Throws shardtrain::Error
// naming `file`: an unknown class or field (with kTorchVersion), a chunk
// outside its tensor's shape, a key without storage data, a file name that
// is not a plain name in the directory.
Metadata ParseMetadata(const char* data, size_t size, const std::string& file);

// Writes <dir>/.metadata atomically.
void WriteMetadata(const std::string& dir, const Metadata& md);
// Reads and parses <dir>/.metadata (shardtrain::Error naming it when missing).
Metadata ReadMetadata(const std::string& dir);
// The same for a metadata pickle at any path (a rank's part during a save).
Metadata ReadMetadataFile(const std::string& path);

// A rank's file: chunks and values appended as DCP stores them; their
// locations go into the Metadata the caller assembles.
class RankFileWriter {
 public:
  RankFileWriter(const std::string& dir, const std::string& file_name);
  // t (its elements, contiguous) as one chunk.
  Location AddTensor(const at::Tensor& t, std::optional<uint32_t> crc = {});  // crc: TensorCrc32(t), if known
  // A non-tensor value (number, string, bool, None, list, tuple, dict of those).
  Location AddObject(const c10::IValue& v);
  void Finish();

 private:
  std::string name_;
  ArchiveSequenceWriter writer_;
};

// Reads a DCP directory: its metadata, then chunks and values on demand from
// the rank files, each mapped once (zero-copy: a chunk is a view of the
// file's pages, read where touched).
class Reader {
 public:
  // Reads the metadata and checks that every file it names exists and holds
  // the byte ranges it names (shardtrain::Error naming the file otherwise).
  explicit Reader(std::string dir);
  const Metadata& metadata() const { return md_; }
  const std::string& dir() const { return dir_; }
  // The chunk's tensor (shaped like its box, of the entry's dtype); throws
  // shardtrain::Error naming the file and key when the stored tensor is not.
  at::Tensor ReadChunk(const std::string& key, const Chunk& chunk) const;
  // A non-tensor value.
  c10::IValue ReadObject(const std::string& key) const;

 private:
  const MappedFile& File(const std::string& name) const;
  std::string dir_;
  Metadata md_;
  mutable std::map<std::string, std::unique_ptr<MappedFile>> files_;
};

}  // namespace shardtrain::trainer::dcp

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_DCP_H_
