#include "trainer/checkpoint_io/archive.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "base/errors.h"
#include "trainer/checkpoint_io/internal/zip_writer.h"
#include "trainer/checkpoint_io/pickle_scan.h"

namespace shardtrain::trainer {
namespace {

// A tensor with dtype, shape and a storage of the right size but no data:
// what the pickler needs to describe a record already written.
at::Tensor Placeholder(c10::ScalarType dtype, c10::IntArrayRef sizes, size_t nbytes) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, c10::Device(c10::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                     c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

// A read-only private mapping of a whole file; unmapped when the last
// storage that points into it goes.
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, size);
  }
};

// Bytes [offset, offset + length) of a mapping, as the zip reader sees them.
class MappingReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  MappingReader(std::shared_ptr<Mapping> m, size_t offset, size_t length)
      : m_(std::move(m)), offset_(offset), length_(length) {}
  size_t size() const override { return length_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= length_) return 0;
    n = std::min<size_t>(n, length_ - pos);
    std::memcpy(buf, static_cast<const char*>(m_->base) + offset_ + pos, n);
    return n;
  }

 private:
  std::shared_ptr<Mapping> m_;
  size_t offset_, length_;
};

void ReleaseMapping(void* ctx) { delete static_cast<std::shared_ptr<Mapping>*>(ctx); }

// The first non-empty `check(tensor)` over the tensors in `v` (lists, dicts,
// tuples walked), else "".
std::string FirstBadTensor(const c10::IValue& v, const std::function<std::string(const at::Tensor&)>& check) {
  if (v.isTensor()) return check(v.toTensor());
  std::string bad;
  if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (!(bad = FirstBadTensor(e, check)).empty()) return bad;
    }
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      if (!(bad = FirstBadTensor(e.key(), check)).empty()) return bad;
      if (!(bad = FirstBadTensor(e.value(), check)).empty()) return bad;
    }
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      if (!(bad = FirstBadTensor(e, check)).empty()) return bad;
    }
  }
  return bad;
}

// Placeholder dtypes (torch.uint1-7, int1-7, bits*) load but have no
// kernels: the first copy would throw from deep inside LibTorch (fuzzer finding).
std::string UnloadableDtype(const at::Tensor& t) {
  if (!t.defined()) return "";
  const at::ScalarType st = t.scalar_type();
  if (c10::isFloatingType(st) || c10::isComplexType(st) || c10::isIntegralType(st, /*includeBool=*/true) ||
      c10::isQIntType(st)) {
    return "";
  }
  return std::string("a tensor of dtype ") + c10::toString(st) +
         " (valid: floating, complex, integer, bool and quantized dtypes)";
}

// A pickle names each storage's element count itself: a tensor whose storage
// or view reaches past its record's bytes (a corrupt or crafted file) would
// read outside the mapping. `records` maps each record's first byte to its
// size. Returns "" when every tensor in `v` stays inside its record and has a
// dtype with kernels, else what is wrong.
std::string CheckTensorsInRecords(const c10::IValue& v, const std::unordered_map<const void*, size_t>& records) {
  return FirstBadTensor(v, [&](const at::Tensor& t) -> std::string {
    if (const std::string bad = UnloadableDtype(t); !bad.empty()) return bad;
    if (!t.defined() || !t.has_storage()) return "";
    const size_t nbytes = t.storage().nbytes();
    auto it = records.find(t.storage().data());
    if (nbytes > 0 && (it == records.end() || nbytes > it->second)) {
      return "a tensor storage of " + std::to_string(nbytes) + " bytes over a record of " +
             (it == records.end() ? std::string("unknown size") : std::to_string(it->second) + " bytes");
    }
    if (t.numel() == 0) return "";
    // The last element's byte end: (offset + sum((size_i - 1) * stride_i) + 1) * itemsize.
    int64_t last = t.storage_offset();
    bool bad = last < 0;
    for (int64_t d = 0; d < t.dim() && !bad; ++d) {
      int64_t step = 0;
      bad = t.stride(d) < 0 || __builtin_mul_overflow(t.size(d) - 1, t.stride(d), &step) ||
            __builtin_add_overflow(last, step, &last);
    }
    int64_t end = 0;
    if (bad || __builtin_mul_overflow(last + 1, static_cast<int64_t>(t.itemsize()), &end) ||
        static_cast<uint64_t>(end) > nbytes) {
      return "a tensor of shape " + c10::str(t.sizes()) + " that reaches past its storage of " +
             std::to_string(nbytes) + " bytes";
    }
    return "";
  });
}

std::string FirstLine(const std::exception& e) {
  std::string what = e.what();
  return what.substr(0, what.find('\n'));
}

}  // namespace

// Lists with a specialized element type (int, tensor, ...) are pickled as
// torch.jit._pickle.build_* calls even without type tags, which Python's
// weights_only unpickler rejects; as lists of Any they are plain pickle lists.
// Dicts are plain once untagged.
c10::IValue PlainForPickle(const c10::IValue& v) {
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const c10::IValue& e : v.toListRef()) out.push_back(PlainForPickle(e));
    return out;
  }
  if (v.isGenericDict()) {
    const auto in = v.toGenericDict();
    c10::impl::GenericDict out(in.keyType(), c10::AnyType::get());
    for (const auto& e : in) out.insert(e.key(), PlainForPickle(e.value()));
    return out;
  }
  return v;
}

namespace {

// t's elements as a record of `zip` under `key`; the data-less placeholder that stands for it.
// t's elements, contiguous, on the CPU (t itself when it is so already).
at::Tensor RecordBytes(const at::Tensor& t, const std::string& path) {
  ST_CHECK_ARG(t.defined(), "writing '", path, "': undefined tensor");
  ST_CHECK_ARG(t.layout() == at::kStrided && !t.is_quantized(), "writing '", path,
               "': only dense (strided, not quantized) tensors can be written, got layout ", t.layout());
  at::Tensor c = t.detach();
  if (!c.device().is_cpu()) c = c.cpu();
  return c.resolve_conj().resolve_neg().contiguous();
}

at::Tensor WriteTensorRecord(ZipWriter& zip, const at::Tensor& t, const std::string& key, const std::string& path,
                             std::optional<uint32_t> crc = {}) {
  const at::Tensor c = RecordBytes(t, path);
  const size_t nbytes = static_cast<size_t>(c.numel()) * c.element_size();
  zip.WriteRecord("data/" + key, c.data_ptr(), nbytes, crc);
  return Placeholder(c.scalar_type(), c.sizes(), nbytes);
}

// Pickles `root` as data.pkl (tensors by their record keys) and ends the archive.
void FinishZip(ZipWriter& zip, const c10::IValue& root, const std::function<std::string(const at::Tensor&)>& key_of) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* data, size_t n) { pickled.insert(pickled.end(), data, data + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              key_of, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(PlainForPickle(root));
  pickler.stop();
  zip.WriteRecord("data.pkl", pickled.data(), pickled.size());
  zip.Finish();
}

}  // namespace

struct ArchiveWriter::State {
  std::unique_ptr<FileSink> sink;
  std::unique_ptr<ZipWriter> zip;
  std::unordered_map<const void*, std::string> keys;  // placeholder storage -> record key
  std::vector<at::Tensor> placeholders;               // keeps the keys' storages unique
};

ArchiveWriter::ArchiveWriter(std::string path) : path_(std::move(path)), state_(std::make_unique<State>()) {
  state_->sink = std::make_unique<FileSink>(path_);
  state_->zip = std::make_unique<ZipWriter>(state_->sink.get());
}

ArchiveWriter::~ArchiveWriter() = default;  // uncommitted, the sink removes its temporary file

at::Tensor ArchiveWriter::Add(const at::Tensor& t) {
  ST_CHECK_ARG(!state_->sink->committed(), "ArchiveWriter::Add after Finish ('", path_, "')");
  const std::string key = std::to_string(state_->placeholders.size());
  at::Tensor ph = WriteTensorRecord(*state_->zip, t, key, path_);
  state_->keys[ph.storage().unsafeGetStorageImpl()] = key;
  state_->placeholders.push_back(ph);
  return ph;
}

void ArchiveWriter::Finish(const c10::IValue& root) {
  ST_CHECK_ARG(!state_->sink->committed(), "ArchiveWriter::Finish called twice ('", path_, "')");
  FinishZip(*state_->zip, root, [&](const at::Tensor& t) -> std::string {
    auto it = state_->keys.find(t.storage().unsafeGetStorageImpl());
    if (it == state_->keys.end()) {
      ST_THROW(InvalidArgumentError, "ArchiveWriter::Finish: the root object holds a tensor (", t.scalar_type(), " ",
               t.sizes(), ") that Add() did not return; pass only the placeholders Add() returns ('", path_, "')");
    }
    return it->second;
  });
  state_->sink->Commit();
}

struct ArchiveSequenceWriter::State {
  std::unique_ptr<FileSink> sink;
};

ArchiveSequenceWriter::ArchiveSequenceWriter(std::string path)
    : path_(std::move(path)), state_(std::make_unique<State>()) {
  state_->sink = std::make_unique<FileSink>(path_);
}

ArchiveSequenceWriter::~ArchiveSequenceWriter() = default;

namespace {

// Pads the sink to a 64-byte boundary, writes one archive with `body`, and
// returns where it lies.
ArchiveSequenceWriter::Span AppendArchive(FileSink& sink, const std::string& path,
                                          const std::function<void(ZipWriter&)>& body) {
  ST_CHECK_ARG(!sink.committed(), "ArchiveSequenceWriter: append after Finish ('", path, "')");
  static const char kZeros[64] = {};
  sink.Write(kZeros, (64 - sink.position() % 64) % 64);
  ArchiveSequenceWriter::Span span{sink.position(), 0};
  ZipWriter zip(&sink);
  body(zip);
  span.length = sink.position() - span.offset;
  return span;
}

}  // namespace

ArchiveSequenceWriter::Span ArchiveSequenceWriter::AppendTensor(const at::Tensor& t, std::optional<uint32_t> crc) {
  return AppendArchive(*state_->sink, path_, [&](ZipWriter& zip) {
    at::Tensor ph = WriteTensorRecord(zip, t, "0", path_, crc);
    FinishZip(zip, ph, [](const at::Tensor&) { return std::string("0"); });
  });
}

ArchiveSequenceWriter::Span ArchiveSequenceWriter::AppendObject(const c10::IValue& v) {
  return AppendArchive(*state_->sink, path_, [&](ZipWriter& zip) {
    FinishZip(zip, v, [&](const at::Tensor&) -> std::string {
      ST_THROW(InvalidArgumentError, "ArchiveSequenceWriter::AppendObject: the value holds a tensor ('", path_,
               "'); use AppendTensor");
    });
  });
}

void ArchiveSequenceWriter::Finish() { state_->sink->Commit(); }

void ReleaseMappedPages(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cpu()) return;
  const at::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &ReleaseMapping || dp.get_context() == nullptr) return;
  const auto& m = *static_cast<std::shared_ptr<Mapping>*>(dp.get_context());
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t base = reinterpret_cast<uintptr_t>(m->base);
  uintptr_t lo = reinterpret_cast<uintptr_t>(dp.get());  // the whole record
  uintptr_t hi = lo + t.storage().nbytes();
  lo = std::max(lo, base);
  hi = std::min(hi, base + m->size);
  lo = (lo + page - 1) / page * page;  // whole pages inside the tensor's bytes only
  hi = hi / page * page;
  if (lo < hi) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

struct MappedFile::Mapped {
  std::shared_ptr<Mapping> m;
};

MappedFile::MappedFile(const std::string& path) : path_(path), m_(std::make_shared<Mapped>()) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) ST_THROW(Error, "cannot open checkpoint '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    ST_THROW(Error, "cannot stat '", path, "': ", std::strerror(err));
  }
  auto m = std::make_shared<Mapping>();
  m->size = static_cast<size_t>(st.st_size);
  if (m->size > 0) m->base = ::mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (m->size == 0) ST_THROW(Error, "checkpoint '", path, "' is empty (0 bytes; not a torch.save archive)");
  if (m->base == MAP_FAILED) ST_THROW(Error, "cannot map '", path, "': ", std::strerror(map_err));
  m_->m = std::move(m);
}

uint64_t MappedFile::size() const { return m_->m->size; }

c10::IValue MappedFile::Archive(uint64_t offset, uint64_t length, const std::string& what) const {
  const std::shared_ptr<Mapping>& m = m_->m;
  const std::string& path = path_;
  if (offset > m->size || length > m->size - offset) {
    ST_THROW(Error, "checkpoint '", path, "': ", what, " lies at bytes [", offset, ", ", offset + length,
             ") but the file has ", m->size, " bytes (truncated?)");
  }
  const std::string name = what.empty() ? "checkpoint '" + path + "'" : "checkpoint '" + path + "' (" + what + ")";
  try {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MappingReader>(m, offset, length));
    auto record = reader.getRecord("data.pkl");
    const at::DataPtr& pickle_ptr = std::get<0>(record);
    const size_t pickle_size = std::get<1>(record);  // not a structured binding: clang 14 cannot capture those
    const char* pickle = static_cast<const char*>(pickle_ptr.get());
    // Scanned before LibTorch reserves its lengths; Python's OrderedDicts made plain dicts.
    const std::string plain = PlainDictsForLibTorch(pickle, pickle_size, name + " (data.pkl)");
    const size_t plain_size = plain.empty() ? pickle_size : plain.size();
    if (!plain.empty()) pickle = plain.data();
    size_t pos = 0;
    auto read = [&](char* buf, size_t n) -> size_t {
      n = std::min(n, plain_size - pos);
      if (n > 0) std::memcpy(buf, pickle + pos, n);  // an empty data.pkl has no buffer (fuzzer finding, UBSan)
      pos += n;
      return n;
    };
    std::unordered_map<const void*, size_t> records;  // first byte -> size, for CheckTensorsInRecords
    auto read_record = [&](const std::string& key) -> at::DataPtr {
      const std::string rec = "data/" + key;
      const size_t size = reader.getRecordSize(rec);
      const size_t rec_offset = reader.getRecordOffset(rec);
      if (rec_offset > length || size > length - rec_offset) {
        ST_THROW(Error, name, ": record '", rec, "' lies past the end of the file");
      }
      char* data = static_cast<char*>(m->base) + offset + rec_offset;
      records[data] = std::max(records[data], size);
      return at::DataPtr(data, new std::shared_ptr<Mapping>(m), &ReleaseMapping, c10::Device(c10::kCPU));
    };
    torch::jit::Unpickler unpickler(read, /*type_resolver=*/nullptr, /*obj_loader=*/nullptr, read_record,
                                    /*device=*/std::nullopt);
    unpickler.set_version(reader.version());
    c10::IValue root = unpickler.parse_ivalue();
    const std::string bad = CheckTensorsInRecords(root, records);
    if (!bad.empty()) ST_THROW(Error, name, " is corrupt: it holds ", bad);
    return root;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    ST_THROW(Error, name, " is truncated or corrupt (", length, " bytes; cannot be read: ", FirstLine(e), ")");
  }
}

at::Tensor MappedFile::Bytes(uint64_t offset, uint64_t length, const std::string& what) const {
  const std::shared_ptr<Mapping>& m = m_->m;
  if (offset > m->size || length > m->size - offset) {
    ST_THROW(Error, "'", path_, "': ", what, " lies at bytes [", offset, ", ", offset + length, ") but the file has ",
             m->size, " bytes (truncated?)");
  }
  char* data = static_cast<char*>(m->base) + offset;
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(length),
                       at::DataPtr(data, new std::shared_ptr<Mapping>(m), &ReleaseMapping, c10::Device(c10::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                    c10::scalarTypeToTypeMeta(at::kByte));
  t.unsafeGetTensorImpl()->set_sizes_contiguous({static_cast<int64_t>(length)});
  return t;
}

uint32_t TensorCrc32(const at::Tensor& t) {
  const at::Tensor c = RecordBytes(t, "a tensor's checksum");
  return Crc32(0, c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
}

std::string UnloadableTensorIn(const c10::IValue& v) { return FirstBadTensor(v, UnloadableDtype); }

c10::IValue MapArchive(const std::string& path) {
  MappedFile file(path);
  return file.Archive(0, file.size(), "");
}

}  // namespace shardtrain::trainer
