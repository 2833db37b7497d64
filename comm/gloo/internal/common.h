// Internal to the Gloo backend (comm/gloo/); not part of the public API.
//
// What the parts of GlooCommunicator share: the group a pending Work refers
// to, operation names, the dtype classes the fast paths take, chunked local
// loops, and the error text of a failed collective. The parts:
//   gloo_communicator.cc  public operations, construction, Work wrapping
//   call_issuer.cc        the issuing thread and the call-signature check
//   pair_exchange.cc      W=2 direct exchanges
//   mesh_collectives.cc   collectives through shared memory (ordered sums)
//   peer_monitor.cc       heartbeats and failure diagnosis (no torch header)
#ifndef SHARDTRAIN_COMM_GLOO_INTERNAL_COMMON_H_
#define SHARDTRAIN_COMM_GLOO_INTERNAL_COMMON_H_

#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/gloo/shared_memory_mesh.h"
#include "comm/gloo_communicator.h"

namespace shardtrain::comm {

// What a pending Work needs to know about its group, shared with the
// communicator so that Works outlive it safely.
struct GlooGroupRef {
  std::string name;
  int rank;
  int size;
  std::shared_ptr<GlooPeerMonitor> monitor;  // null: no heartbeats
  std::shared_ptr<PeerWatch> watch;          // null: no heartbeats or no stall options
};

namespace gloo_internal {

using SteadyClock = std::chrono::steady_clock;

// Operation names as they appear in errors (the public API's method names).
const char* OpTitle(CommOp op);

// An exception's message without c10's C++ backtrace, first line only.
std::string ErrorText(const std::exception& e);

// "AllGather on gloo group 'world' (rank 0/2)".
std::string Describe(const char* op, const GlooGroupRef& g);

// The error of collective `call` that failed (or timed out after `timeout`):
// the operation and group, the peers at fault (from heartbeats), then what the
// engine said.
std::string FailureText(const GlooGroupRef& g, CommOp op, IssuedCall call, bool timed_out,
                        std::chrono::milliseconds timeout, const char* engine, const std::string& detail);

// Copies what `peer` sends into output blocks: block p of `out` starts at
// byte `starts[p]`.
SharedMemoryMesh::Consumer CopyInto(uint8_t* out, std::vector<int64_t> starts);

inline bool IsFloating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline bool Is16Bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Runs f(offset, length) over [0, n) in pieces small enough for ATen to run
// each on the calling thread (so the OpenMP pool, whose spinning threads steal
// the cores Gloo's I/O needs on small machines, never wakes).
template <typename F>
void Serially(int64_t n, F&& f) {
  for (int64_t i = 0; i < n; i += at::internal::GRAIN_SIZE) f(i, std::min<int64_t>(at::internal::GRAIN_SIZE, n - i));
}

}  // namespace gloo_internal
}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_GLOO_INTERNAL_COMMON_H_
