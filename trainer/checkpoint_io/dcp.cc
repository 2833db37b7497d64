#include "trainer/checkpoint_io/dcp.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>

#include "base/errors.h"
#include "base/file_util.h"
#include "trainer/checkpoint_io/py_pickle.h"

namespace shardtrain::trainer::dcp {
namespace fs = std::filesystem;
namespace {

using py::PyArena;
using py::PyPtr;
using py::PyValue;
using K = PyValue::Kind;

constexpr const char* kMetaModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kFsModule = "torch.distributed.checkpoint.filesystem";

// torch's dtype attribute names for the dtypes a checkpoint holds.
constexpr std::array<std::pair<const char*, at::ScalarType>, 11> kDtypes = {{
    {"float32", at::kFloat},
    {"float64", at::kDouble},
    {"float16", at::kHalf},
    {"bfloat16", at::kBFloat16},
    {"int64", at::kLong},
    {"int32", at::kInt},
    {"int16", at::kShort},
    {"int8", at::kChar},
    {"uint8", at::kByte},
    {"bool", at::kBool},
    {"complex64", at::kComplexFloat},
}};

std::string DtypeNames() {
  std::string s;
  for (const auto& [n, t] : kDtypes) s += (s.empty() ? "torch." : ", torch.") + std::string(n);
  return s;
}

// ---- Writing: the Metadata object graph ----

class MetadataBuilder {
 public:
  PyPtr Size(const std::vector<int64_t>& dims) {
    std::vector<PyPtr> items;
    for (int64_t d : dims) items.push_back(a_.Int(d));
    return a_.Object(a_.Global("torch", "Size"), a_.Tuple({a_.Tuple(std::move(items))}), false);
  }
  PyPtr Dataclass(const char* module, const char* cls, PyPtr state) {
    return a_.Object(a_.Global(module, cls), a_.Tuple({}), true, state);
  }
  PyPtr Fields(std::vector<std::pair<const char*, PyPtr>> fields) {
    std::vector<std::pair<PyPtr, PyPtr>> entries;
    for (auto& [k, v] : fields) entries.emplace_back(a_.Str(k), v);
    return a_.Dict(std::move(entries));
  }
  PyPtr Properties(at::ScalarType dtype) {
    const char* name = nullptr;
    for (const auto& [n, t] : kDtypes) {
      if (t == dtype) name = n;
    }
    ST_CHECK_ARG(name, "a DCP checkpoint cannot hold dtype ", dtype, "; valid: ", DtypeNames());
    // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format encoding, pin_memory)
    PyPtr layout =
        a_.Object(a_.Global("torch.serialization", "_get_layout"), a_.Tuple({a_.Str("torch.strided")}), false);
    PyPtr mem = a_.Object(a_.Global(kMetaModule, "_MEM_FORMAT_ENCODING"), a_.Tuple({a_.Int(0)}), false);
    return Dataclass(kMetaModule, "TensorProperties",
                     a_.Tuple({a_.Global("torch", name), layout, a_.Bool(false), mem, a_.Bool(false)}));
  }
  PyPtr Index(const std::string& fqn, const std::vector<int64_t>* offsets, int64_t index) {
    std::vector<std::pair<const char*, PyPtr>> f = {{"fqn", a_.Str(fqn)}, {"index", a_.None()}};
    if (offsets) {  // a tensor chunk; values have no offset (the frozen dataclass leaves it unset)
      f[1].second = a_.Int(index);
      f.emplace_back("offset", Size(*offsets));
    }
    return Dataclass(kMetaModule, "MetadataIndex", Fields(std::move(f)));
  }
  PyPtr Storage(const Location& l) {
    return Dataclass(kFsModule, "_StorageInfo",
                     Fields({{"relative_path", a_.Str(l.file)},
                             {"offset", a_.Int(static_cast<int64_t>(l.offset))},
                             {"length", a_.Int(static_cast<int64_t>(l.length))}}));
  }

  std::string Build(const Metadata& md, const std::string& checkpoint_id) {
    std::vector<std::pair<PyPtr, PyPtr>> sdm, planner, storage;
    for (const auto& [key, e] : md.tensors) {
      std::vector<PyPtr> chunks;
      for (size_t c = 0; c < e.chunks.size(); ++c) {
        const Chunk& ch = e.chunks[c];
        chunks.push_back(Dataclass(kMetaModule, "ChunkStorageMetadata",
                                   Fields({{"offsets", Size(ch.box.offsets)}, {"sizes", Size(ch.box.sizes)}})));
        storage.emplace_back(Index(key, &ch.box.offsets, static_cast<int64_t>(c)), Storage(ch.where));
      }
      sdm.emplace_back(a_.Str(key), Dataclass(kMetaModule, "TensorStorageMetadata",
                                              Fields({{"properties", Properties(e.dtype)},
                                                      {"size", Size(e.shape)},
                                                      {"chunks", a_.List(std::move(chunks))}})));
    }
    for (const auto& [key, l] : md.objects) {
      sdm.emplace_back(a_.Str(key), Dataclass(kMetaModule, "BytesStorageMetadata", nullptr));
      storage.emplace_back(Index(key, nullptr, 0), Storage(l));
    }
    for (const auto& [key, path] : md.paths) {
      std::vector<PyPtr> parts;
      for (const auto& p : path) parts.push_back(p.index >= 0 ? a_.Int(p.index) : a_.Str(p.key));
      planner.emplace_back(a_.Str(key), a_.Tuple(std::move(parts)));
    }
    PyPtr storage_meta = Dataclass(kMetaModule, "StorageMeta",
                                   Fields({{"checkpoint_id", a_.Str(checkpoint_id)},
                                           {"save_id", a_.Str(NewId())},
                                           {"load_id", a_.None()},
                                           {"modules", a_.List({})}}));
    PyPtr root = Dataclass(kMetaModule, "Metadata",
                           Fields({{"state_dict_metadata", a_.Dict(std::move(sdm))},
                                   {"planner_data", a_.Dict(std::move(planner))},
                                   {"storage_data", a_.Dict(std::move(storage))},
                                   {"storage_meta", storage_meta},
                                   {"version", a_.Str(md.version)}}));
    return py::Dumps(*root);
  }

 private:
  static std::string NewId() {  // a random UUID4 string, as DCP's save_id
    std::random_device rd;
    std::string s;
    static const char* hex = "0123456789abcdef";
    for (int i = 0; i < 32; ++i) {
      if (i == 8 || i == 12 || i == 16 || i == 20) s += '-';
      int v = static_cast<int>(rd() & 15);
      if (i == 12) v = 4;
      if (i == 16) v = 8 | (v & 3);
      s += hex[v];
    }
    return s;
  }
  PyArena a_;
};

// ---- Reading ----

class MetadataParser {
 public:
  explicit MetadataParser(const std::string& file) : file_(file) {}

  Metadata Parse(PyPtr root) {
    const PyPtr st = Dataclass(root, "Metadata", "the root");
    Metadata md;
    std::map<std::string, PyPtr> fields =
        Fields(st, "Metadata", {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"});
    if (PyPtr v = fields["version"]; v && !v->Is(K::kNone)) md.version = Want(v, K::kStr, "Metadata.version")->s;
    std::set<std::string> bytes_keys;
    for (const auto& [k, v] :
         Want(Need(fields, "state_dict_metadata", "Metadata"), K::kDict, "Metadata.state_dict_metadata")->entries) {
      const std::string key = Want(k, K::kStr, "a state_dict_metadata key")->s;
      const std::string cls = ClassOf(v, "state_dict_metadata['" + key + "']");
      if (cls == "BytesStorageMetadata") {
        bytes_keys.insert(key);
      } else if (cls == "TensorStorageMetadata") {
        md.tensors[key] = Tensor(key, v);
      } else {
        Unknown(cls, "state_dict_metadata['" + key + "']");
      }
    }
    if (PyPtr pd = fields["planner_data"]; pd && !pd->Is(K::kNone)) {
      for (const auto& [k, v] : Want(pd, K::kDict, "Metadata.planner_data")->entries) {
        const std::string key = Want(k, K::kStr, "a planner_data key")->s;
        std::vector<PathPart> path;
        for (PyPtr p : Want(v, K::kTuple, "planner_data['" + key + "']")->items) {
          if (p->Is(K::kInt)) {
            path.push_back({"", p->i});
          } else {
            path.push_back({Want(p, K::kStr, "a part of planner_data['" + key + "']")->s, -1});
          }
        }
        md.paths[key] = std::move(path);
      }
    }
    Storage(Want(Need(fields, "storage_data", "Metadata"), K::kDict, "Metadata.storage_data"), bytes_keys, &md);
    if (PyPtr sm = fields["storage_meta"]; sm && !sm->Is(K::kNone)) Dataclass(sm, "StorageMeta", "storage_meta");
    return md;
  }

 private:
  template <typename... A>
  [[noreturn]] void Bad(const A&... what) const {
    ST_THROW(Error, "DCP metadata '", file_, "': ", what...);
  }
  [[noreturn]] void Unknown(const std::string& name, const std::string& where) const {
    Bad(where, " is ", name, ", which torch ", kTorchVersion,
        "'s DCP does not write there (this build reads "
        "the DCP checkpoints of torch ",
        kTorchVersion, ")");
  }
  PyPtr Want(PyPtr v, K kind, const std::string& what) const {
    if (!v->Is(kind)) {
      PyValue want;
      want.kind = kind;
      Bad(what, " is a ", v->TypeName(), ", expected a ", want.TypeName());
    }
    return v;
  }
  // The torch.distributed.checkpoint class an object of `v` is (its module checked).
  std::string ClassOf(PyPtr v, const std::string& where) const {
    if (!v->Is(K::kObject) || !v->newobj) Bad(where, " is a ", v->TypeName(), ", expected a DCP dataclass");
    const PyValue& c = *v->callable;
    if (c.s != kMetaModule && c.s != kFsModule) Unknown(c.QualifiedName(), where);
    return c.name;
  }
  // The BUILD state of a dataclass object of class `cls`.
  PyPtr Dataclass(PyPtr v, const char* cls, const std::string& where) const {
    const std::string got = ClassOf(v, where);
    if (got != cls) Unknown(v->callable->QualifiedName(), where);
    if (!v->state) Bad(where, " (", cls, ") has no fields");
    return v->state;
  }
  // A dataclass's fields by name; a field outside `known` is an error.
  std::map<std::string, PyPtr> Fields(PyPtr state, const char* cls, std::set<std::string> known) const {
    std::map<std::string, PyPtr> out;
    for (const auto& [k, v] : Want(state, K::kDict, std::string(cls) + "'s fields")->entries) {
      const std::string name = Want(k, K::kStr, std::string("a field name of ") + cls)->s;
      if (!known.count(name)) {
        Bad(cls, " has a field '", name, "' that torch ", kTorchVersion, "'s ", cls,
            " does not have (this build reads "
            "the DCP checkpoints of torch ",
            kTorchVersion, ")");
      }
      out[name] = v;
    }
    return out;
  }
  PyPtr Need(std::map<std::string, PyPtr>& f, const char* name, const char* cls) const {
    if (!f[name]) Bad(cls, " has no field '", name, "'");
    return f[name];
  }
  std::vector<int64_t> Size(PyPtr v, const std::string& where) const {
    if (!v->Is(K::kObject) || v->QualifiedName() != "torch.Size" || v->args->items.size() != 1 ||
        !v->args->items[0]->Is(K::kTuple)) {
      Bad(where, " is a ", v->TypeName(), ", expected a torch.Size");
    }
    std::vector<int64_t> dims;
    for (PyPtr d : v->args->items[0]->items) {
      const int64_t n = Want(d, K::kInt, "a dimension of " + where)->i;
      if (n < 0) Bad(where, " has a negative dimension ", n);
      dims.push_back(n);
    }
    return dims;
  }
  at::ScalarType Dtype(PyPtr v, const std::string& where) const {
    if (v->Is(K::kGlobal) && v->s == "torch") {
      for (const auto& [n, t] : kDtypes) {
        if (v->name == n) return t;
      }
    }
    Bad(where, " has dtype ", v->TypeName(), "; valid: ", DtypeNames());
  }

  TensorEntry Tensor(const std::string& key, PyPtr v) const {
    const std::string where = "state_dict_metadata['" + key + "']";
    auto f =
        Fields(Dataclass(v, "TensorStorageMetadata", where), "TensorStorageMetadata", {"properties", "size", "chunks"});
    TensorEntry e;
    const PyPtr props = Dataclass(Need(f, "properties", "TensorStorageMetadata"), "TensorProperties", where);
    if (!props->Is(K::kTuple) || props->items.size() != 5) Bad(where, ".properties is not TensorProperties' 5-tuple");
    e.dtype = Dtype(props->items[0], where);
    e.shape = Size(Need(f, "size", "TensorStorageMetadata"), where + ".size");
    for (PyPtr c : Want(Need(f, "chunks", "TensorStorageMetadata"), K::kList, where + ".chunks")->items) {
      auto cf =
          Fields(Dataclass(c, "ChunkStorageMetadata", where + ".chunks"), "ChunkStorageMetadata", {"offsets", "sizes"});
      Chunk ch;
      ch.box.offsets = Size(Need(cf, "offsets", "ChunkStorageMetadata"), where + " chunk offsets");
      ch.box.sizes = Size(Need(cf, "sizes", "ChunkStorageMetadata"), where + " chunk sizes");
      if (ch.box.offsets.size() != e.shape.size() || ch.box.sizes.size() != e.shape.size()) {
        Bad(where, ": a chunk has ", ch.box.offsets.size(), " offsets and ", ch.box.sizes.size(),
            " sizes for a tensor of ", e.shape.size(), " dimensions");
      }
      for (size_t d = 0; d < e.shape.size(); ++d) {
        if (ch.box.offsets[d] > e.shape[d] || ch.box.sizes[d] > e.shape[d] - ch.box.offsets[d]) {
          Bad(where, ": a chunk at ", c10::IntArrayRef(ch.box.offsets), " of size ", c10::IntArrayRef(ch.box.sizes),
              " reaches outside the tensor's shape ", c10::IntArrayRef(e.shape));
        }
      }
      e.chunks.push_back(std::move(ch));
    }
    return e;
  }

  void Storage(PyPtr sd, const std::set<std::string>& bytes_keys, Metadata* md) const {
    for (const auto& [k, v] : sd->entries) {
      auto idx =
          Fields(Dataclass(k, "MetadataIndex", "a storage_data key"), "MetadataIndex", {"fqn", "offset", "index"});
      const std::string key = Want(Need(idx, "fqn", "MetadataIndex"), K::kStr, "MetadataIndex.fqn")->s;
      auto info = Fields(Dataclass(v, "_StorageInfo", "storage_data['" + key + "']"), "_StorageInfo",
                         {"relative_path", "offset", "length", "transform_descriptors"});
      if (PyPtr t = info["transform_descriptors"]; t && !t->Is(K::kNone) && !(t->Is(K::kList) && t->items.empty())) {
        Bad("storage_data['", key,
            "'] is stored through transforms (compression or encryption), which this build "
            "does not read; valid: DCP's plain torch.save storage");
      }
      Location l;
      l.file = Want(Need(info, "relative_path", "_StorageInfo"), K::kStr, "_StorageInfo.relative_path")->s;
      const int64_t off = Want(Need(info, "offset", "_StorageInfo"), K::kInt, "_StorageInfo.offset")->i;
      const int64_t len = Want(Need(info, "length", "_StorageInfo"), K::kInt, "_StorageInfo.length")->i;
      if (off < 0 || len <= 0) Bad("storage_data['", key, "'] lies at offset ", off, " with length ", len);
      if (l.file.empty() || l.file == "." || l.file == ".." || l.file.find('/') != std::string::npos ||
          l.file.find('\0') != std::string::npos) {
        Bad("storage_data['", key, "'] names the file '", l.file, "'; valid: a file name inside the directory");
      }
      l.offset = static_cast<uint64_t>(off);
      l.length = static_cast<uint64_t>(len);
      PyPtr offset = idx["offset"];
      if (!offset || offset->Is(K::kNone)) {
        if (!bytes_keys.count(key)) Bad("storage_data names '", key, "' without an offset, but it is not a value");
        md->objects[key] = l;
        continue;
      }
      auto it = md->tensors.find(key);
      if (it == md->tensors.end()) Bad("storage_data names a chunk of '", key, "', which is not a tensor");
      const std::vector<int64_t> at_offsets = Size(offset, "MetadataIndex.offset of '" + key + "'");
      bool found = false;
      for (auto& ch : it->second.chunks) {
        if (ch.box.offsets == at_offsets && ch.where.file.empty()) {
          ch.where = l;
          found = true;
          break;
        }
      }
      if (!found) {
        Bad("storage_data names a chunk of '", key, "' at ", c10::IntArrayRef(at_offsets),
            " that its TensorStorageMetadata does not list (or lists once and storage_data twice)");
      }
    }
    for (const auto& [key, e] : md->tensors) {
      for (const auto& ch : e.chunks) {
        if (ch.where.file.empty()) {
          Bad("the chunk of '", key, "' at ", c10::IntArrayRef(ch.box.offsets), " has no storage_data entry");
        }
      }
    }
    for (const auto& key : bytes_keys) {
      if (!md->objects.count(key)) Bad("the value '", key, "' has no storage_data entry");
    }
  }

  std::string file_;
};

// BoxesOfRange below dimension `dim`: the dimensions before it are fixed at `prefix`.
void SplitRange(const std::vector<int64_t>& shape, std::vector<int64_t>& prefix, int64_t begin, int64_t end,
                std::vector<Box>* out) {
  if (begin >= end) return;
  const size_t dim = prefix.size();
  auto box = [&](int64_t row, int64_t rows) {
    Box b;
    b.offsets = prefix;
    b.sizes.assign(prefix.size(), 1);
    if (dim < shape.size()) {
      b.offsets.push_back(row);
      b.sizes.push_back(rows);
      for (size_t d = dim + 1; d < shape.size(); ++d) {
        b.offsets.push_back(0);
        b.sizes.push_back(shape[d]);
      }
    }
    out->push_back(std::move(b));
  };
  if (dim == shape.size()) return box(0, 1);  // one element
  int64_t inner = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t first = begin / inner;
  const int64_t last = (end - 1) / inner;
  auto part = [&](int64_t row, int64_t b, int64_t e) {  // [b, e) inside one row
    if (b == 0 && e == inner) return box(row, 1);
    prefix.push_back(row);
    SplitRange(shape, prefix, b, e, out);
    prefix.pop_back();
  };
  if (first == last) return part(first, begin - first * inner, end - first * inner);
  int64_t whole_begin = first, whole_end = last + 1;
  if (begin % inner) {
    part(first, begin % inner, inner);
    ++whole_begin;
  }
  if (end % inner) --whole_end;
  if (whole_end > whole_begin) box(whole_begin, whole_end - whole_begin);
  if (end % inner) part(last, 0, end % inner);
}

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) ST_THROW(Error, "DCP checkpoint: '", path, "' cannot be opened (no such file?)");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

std::string RankFileName(int64_t rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::vector<Box> BoxesOfRange(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  ST_CHECK_ARG(0 <= begin && begin <= end && end <= numel, "BoxesOfRange: range [", begin, ", ", end,
               ") outside a tensor of shape ", c10::IntArrayRef(shape), " (", numel, " elements)");
  std::vector<Box> out;
  std::vector<int64_t> prefix;
  SplitRange(shape, prefix, begin, end, &out);
  return out;
}

int64_t FlatIndex(const std::vector<int64_t>& shape, const std::vector<int64_t>& offsets) {
  int64_t index = 0;
  for (size_t d = 0; d < shape.size(); ++d) index = index * shape[d] + offsets[d];
  return index;
}

void ForEachRun(const std::vector<int64_t>& shape, const Box& box,
                const std::function<void(int64_t at, int64_t in_box, int64_t len)>& fn) {
  const int64_t n = box.numel();
  if (n == 0) return;
  // k: the first dimension from which the box is whole to the end; a run spans dims k-1.. (or all).
  size_t k = shape.size();
  while (k > 0 && box.sizes[k - 1] == shape[k - 1]) --k;
  int64_t len = 1;
  for (size_t d = (k == 0 ? 0 : k - 1); d < shape.size(); ++d) len *= box.sizes[d];
  const size_t outer = k == 0 ? 0 : k - 1;  // dimensions enumerated one index at a time
  std::vector<int64_t> at = box.offsets;
  for (int64_t in_box = 0; in_box < n; in_box += len) {
    fn(FlatIndex(shape, at), in_box, len);
    for (size_t d = outer; d-- > 0;) {  // the next index of the outer dimensions (last fastest)
      if (++at[d] < box.offsets[d] + box.sizes[d]) break;
      at[d] = box.offsets[d];
    }
  }
}

std::string FlatKey(const std::vector<PathPart>& path) {
  std::string s;
  for (const auto& p : path) {
    if (!s.empty()) s += '.';
    s += p.index >= 0 ? std::to_string(p.index) : p.key;
  }
  return s;
}

std::string MetadataPickle(const Metadata& md, const std::string& checkpoint_id) {
  return MetadataBuilder().Build(md, checkpoint_id);
}

Metadata ParseMetadata(const char* data, size_t size, const std::string& file) {
  PyArena arena;
  PyPtr root = py::Loads(data, size, file, &arena);
  return MetadataParser(file).Parse(root);
}

void WriteMetadata(const std::string& dir, const Metadata& md) {
  WriteFileAtomically((fs::path(dir) / kMetadataFile).string(), MetadataPickle(md, dir));
}

Metadata ReadMetadata(const std::string& dir) { return ReadMetadataFile((fs::path(dir) / kMetadataFile).string()); }

Metadata ReadMetadataFile(const std::string& path) {
  const std::string bytes = ReadWhole(path);
  return ParseMetadata(bytes.data(), bytes.size(), path);
}

RankFileWriter::RankFileWriter(const std::string& dir, const std::string& file_name)
    : name_(file_name), writer_((fs::path(dir) / file_name).string()) {}

Location RankFileWriter::AddTensor(const at::Tensor& t, std::optional<uint32_t> crc) {
  const auto span = writer_.AppendTensor(t, crc);
  return {name_, span.offset, span.length};
}

Location RankFileWriter::AddObject(const c10::IValue& v) {
  const auto span = writer_.AppendObject(v);
  return {name_, span.offset, span.length};
}

void RankFileWriter::Finish() { writer_.Finish(); }

Reader::Reader(std::string dir) : dir_(std::move(dir)), md_(ReadMetadata(dir_)) {
  std::map<std::string, uint64_t> end;  // per file, the end of the last byte range it must hold
  auto need = [&](const Location& l) { end[l.file] = std::max(end[l.file], l.offset + l.length); };
  for (const auto& [k, e] : md_.tensors) {
    for (const auto& c : e.chunks) need(c.where);
  }
  for (const auto& [k, l] : md_.objects) need(l);
  for (const auto& [name, bytes] : end) {
    const fs::path p = fs::path(dir_) / name;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec)
      ST_THROW(Error, "DCP checkpoint '", dir_, "' is missing the file '", p.string(), "' that its metadata names");
    if (size < bytes) {
      ST_THROW(Error, "DCP checkpoint file '", p.string(), "' has ", size,
               " bytes but the metadata places data up to "
               "byte ",
               bytes, " (truncated?)");
    }
  }
}

const MappedFile& Reader::File(const std::string& name) const {
  auto& f = files_[name];
  if (!f) f = std::make_unique<MappedFile>((fs::path(dir_) / name).string());
  return *f;
}

at::Tensor Reader::ReadChunk(const std::string& key, const Chunk& chunk) const {
  const std::string what = "chunk of '" + key + "' at " + c10::str(c10::IntArrayRef(chunk.box.offsets));
  const c10::IValue v = File(chunk.where.file).Archive(chunk.where.offset, chunk.where.length, what);
  const TensorEntry& e = md_.tensors.at(key);
  const std::string file = (fs::path(dir_) / chunk.where.file).string();
  if (!v.isTensor())
    ST_THROW(Error, "DCP checkpoint file '", file, "': the ", what, " is a ", v.tagKind(), ", not a tensor");
  at::Tensor t = v.toTensor();
  if (t.scalar_type() != e.dtype || t.sizes() != c10::IntArrayRef(chunk.box.sizes)) {
    ST_THROW(Error, "DCP checkpoint file '", file, "': the ", what, " is a ", t.scalar_type(), " tensor of shape ",
             t.sizes(), "; the metadata says ", e.dtype, " of shape ", c10::IntArrayRef(chunk.box.sizes));
  }
  // DCP packs items back to back: a record may sit at any byte, and kernels want aligned elements.
  if (t.numel() > 0 && reinterpret_cast<uintptr_t>(t.storage().data()) % t.element_size() != 0) {
    at::Tensor copy = at::empty({static_cast<int64_t>(t.storage().nbytes())}, at::kByte);
    std::memcpy(copy.data_ptr(), t.storage().data(), t.storage().nbytes());
    t = at::empty({0}, t.options()).set_(copy.storage(), t.storage_offset(), t.sizes(), t.strides());
  }
  return t;
}

c10::IValue Reader::ReadObject(const std::string& key) const {
  auto it = md_.objects.find(key);
  ST_CHECK_ARG(it != md_.objects.end(), "DCP checkpoint '", dir_, "' has no value '", key, "'");
  return File(it->second.file).Archive(it->second.offset, it->second.length, "value '" + key + "'");
}

}  // namespace shardtrain::trainer::dcp
