#include "examples/fashion_mnist/idx.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "base/errors.h"

namespace shardtrain::examples {
namespace {

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

// Reads exactly n bytes; false at a premature end of file.
bool ReadExactly(gzFile f, void* dst, size_t n, const std::string& path) {
  auto* p = static_cast<unsigned char*>(dst);
  while (n > 0) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n, 1u << 30));
    const int got = gzread(f, p, chunk);
    if (got < 0) {
      int err = 0;
      const char* msg = gzerror(f, &err);
      ST_THROW(InvalidArgumentError, "reading IDX file '", path, "' failed: ", msg ? msg : "zlib error",
               " (corrupt gzip data?)");
    }
    if (got == 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

}  // namespace

at::Tensor ReadIdxFile(const std::string& path, int expected_dims) {
  std::unique_ptr<gzFile_s, GzCloser> f(gzopen(path.c_str(), "rb"));
  ST_CHECK_ARG(f != nullptr, "cannot open IDX file '", path, "'");
  unsigned char magic[4];
  ST_CHECK_ARG(ReadExactly(f.get(), magic, 4, path), "IDX file '", path, "' is empty or truncated (no header)");
  ST_CHECK_ARG(magic[0] == 0 && magic[1] == 0, "'", path, "' is not an IDX file (bad magic number)");
  ST_CHECK_ARG(magic[2] == 0x08, "IDX file '", path, "' has element type 0x", std::hex, int{magic[2]},
               "; only unsigned bytes (0x08) are supported");
  const int ndims = magic[3];
  ST_CHECK_ARG(ndims >= 1, "IDX file '", path, "' declares no dimensions");
  ST_CHECK_ARG(expected_dims <= 0 || ndims == expected_dims, "IDX file '", path, "' has ", ndims,
               " dimensions, expected ", expected_dims);
  std::vector<int64_t> dims(ndims);
  int64_t numel = 1;
  for (int d = 0; d < ndims; ++d) {
    unsigned char b[4];
    ST_CHECK_ARG(ReadExactly(f.get(), b, 4, path), "IDX file '", path, "' is truncated in its header");
    dims[d] = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | int64_t{b[3]};
    numel *= dims[d];
    ST_CHECK_ARG(numel <= (int64_t{1} << 34), "IDX file '", path, "' declares an implausible size");
  }
  at::Tensor out = at::empty(dims, at::kByte);
  ST_CHECK_ARG(ReadExactly(f.get(), out.data_ptr<uint8_t>(), static_cast<size_t>(numel), path), "IDX file '", path,
               "' is truncated: expected ", numel, " data bytes");
  unsigned char extra;
  ST_CHECK_ARG(gzread(f.get(), &extra, 1) == 0, "IDX file '", path, "' has trailing data after ", numel,
               " data bytes");
  return out;
}

}  // namespace shardtrain::examples
