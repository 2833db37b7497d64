// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed.
//
// Layout: a 4-byte magic (0, 0, type, number of dimensions), then each
// dimension as a big-endian uint32, then the data in row-major order. Only
// type 0x08 (unsigned byte) is read — it is what (Fashion-)MNIST uses.
#ifndef SHARDTRAIN_EXAMPLES_FASHION_MNIST_IDX_H_
#define SHARDTRAIN_EXAMPLES_FASHION_MNIST_IDX_H_

#include <ATen/core/Tensor.h>

#include <string>

namespace shardtrain::examples {

// Reads `path` (gzip or plain; zlib tells them apart) into a uint8 tensor of
// the file's dimensions. `expected_dims` > 0 checks the number of dimensions.
// A missing, truncated or malformed file throws InvalidArgumentError naming
// the path and what was wrong.
at::Tensor ReadIdxFile(const std::string& path, int expected_dims = 0);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_FASHION_MNIST_IDX_H_
