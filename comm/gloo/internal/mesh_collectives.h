// Internal to the Gloo backend (comm/gloo/); not part of the public API.
//
// Collectives through shared memory (GlooOptions::shared_memory): every rank
// streams to every peer at once (comm/gloo/shared_memory_mesh.h); sends are
// (W-1)/W of the full buffer for all-gather and reduce-scatter and 2(W-1)/W
// for all-reduce, as counted. They run on the communicator's issuing thread
// and return when done (or throw SharedMemoryError at `deadline` or when a
// peer failed). Reductions add in rank order, so every rank gets the same bits
// whatever order the bytes arrive in; at W=2 these are the TCP paths' bits.
#ifndef SHARDTRAIN_COMM_GLOO_INTERNAL_MESH_COLLECTIVES_H_
#define SHARDTRAIN_COMM_GLOO_INTERNAL_MESH_COLLECTIVES_H_

#include <ATen/core/Tensor.h>

#include <chrono>
#include <vector>

#include "comm/gloo/shared_memory_mesh.h"

namespace shardtrain::comm::gloo_internal {

void MeshAllGather(SharedMemoryMesh& mesh, const at::Tensor& input, const at::Tensor& output,
                   std::chrono::steady_clock::time_point deadline);

// Sum of the ranks' blocks of floating `input`, times `scale`, into `output`.
void MeshReduceScatter(SharedMemoryMesh& mesh, const at::Tensor& input, const at::Tensor& output, double scale,
                       std::chrono::steady_clock::time_point deadline);

// MeshReduceScatter of the concatenation of `pieces` (contiguous, of output's
// dtype, none sharing bytes with `output`), read where they lie.
void MeshReduceScatterPieces(SharedMemoryMesh& mesh, const std::vector<at::Tensor>& pieces, const at::Tensor& output,
                             double scale, std::chrono::steady_clock::time_point deadline);

// Sum of a floating `tensor` over the ranks, in place, then divided by `divide`.
void MeshAllReduce(SharedMemoryMesh& mesh, const at::Tensor& tensor, double divide,
                   std::chrono::steady_clock::time_point deadline);

}  // namespace shardtrain::comm::gloo_internal

#endif  // SHARDTRAIN_COMM_GLOO_INTERNAL_MESH_COLLECTIVES_H_
