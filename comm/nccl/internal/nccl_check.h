// ST_NCCL_CHECK / ST_CUDA_CHECK: the one place NCCL and CUDA status codes
// become ShardTrain's typed exceptions.
//
//   ST_NCCL_CHECK(ncclAllGather(...), "AllGather on nccl group 'world'");
//   ST_CUDA_CHECK(cudaEventRecord(ev, stream), "recording the completion event");
//
// A failing call throws CommError whose message names `what`, the failed
// expression, NCCL's error string and NCCL's last error message (or CUDA's
// error name and string), with file:line. ncclInProgress is not a failure:
// nonblocking communicators (ncclConfig_t::blocking = 0) return it for calls
// that are still being enqueued or initialized; the caller then polls
// ncclCommGetAsyncError (see NcclCommunicator).
#ifndef SHARDTRAIN_COMM_NCCL_INTERNAL_NCCL_CHECK_H_
#define SHARDTRAIN_COMM_NCCL_INTERNAL_NCCL_CHECK_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "base/errors.h"

namespace shardtrain::comm::internal {

[[noreturn]] inline void ThrowNcclError(ncclResult_t result, const char* expr, const std::string& what, const char* file,
                                        int line) {
  const char* last = ncclGetLastError(nullptr);
  throw CommError(::shardtrain::internal::StrCat(
      what, ": NCCL error ", static_cast<int>(result), " (", ncclGetErrorString(result), ")",
      (last && *last) ? std::string(": ") + last : std::string(), " [", expr, "] (", file, ":", line, ")"));
}

[[noreturn]] inline void ThrowCudaError(cudaError_t result, const char* expr, const std::string& what, const char* file,
                                        int line) {
  throw CommError(::shardtrain::internal::StrCat(what, ": CUDA error ", static_cast<int>(result), " (",
                                                 cudaGetErrorName(result), ": ", cudaGetErrorString(result), ") [",
                                                 expr, "] (", file, ":", line, ")"));
}

}  // namespace shardtrain::comm::internal

#define ST_NCCL_CHECK(expr, what)                                                                \
  do {                                                                                           \
    const ncclResult_t st_nccl_result_ = (expr);                                                 \
    if (st_nccl_result_ != ncclSuccess && st_nccl_result_ != ncclInProgress)                     \
      ::shardtrain::comm::internal::ThrowNcclError(st_nccl_result_, #expr, (what), __FILE__, __LINE__); \
  } while (0)

#define ST_CUDA_CHECK(expr, what)                                                                \
  do {                                                                                           \
    const cudaError_t st_cuda_result_ = (expr);                                                  \
    if (st_cuda_result_ != cudaSuccess) {                                                        \
      (void)cudaGetLastError(); /* clear the sticky-free error state */                          \
      ::shardtrain::comm::internal::ThrowCudaError(st_cuda_result_, #expr, (what), __FILE__, __LINE__); \
    }                                                                                            \
  } while (0)

#endif  // SHARDTRAIN_COMM_NCCL_INTERNAL_NCCL_CHECK_H_
