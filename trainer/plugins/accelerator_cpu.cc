// The accelerator functions of a build without CUDA support (the default; see
// accelerator_cuda.cc for --config=cuda). Declared in accelerator.h.
#include <c10/core/Device.h>

#include <chrono>

#include "base/errors.h"
#include "trainer/plugins/accelerator.h"

namespace shardtrain::trainer {

bool BuildHasCuda() { return false; }

int CudaDeviceCount() { return 0; }

void SetCurrentDevice(const c10::Device& device) {
  if (!device.is_cuda()) return;
  ST_THROW(InvalidArgumentError, "device ", device.str(), " needs a build with CUDA support (--config=cuda)");
}

comm::CommunicatorPtr CreateNcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                             int device_index, const CommLimits&) {
  ST_THROW(InvalidArgumentError, "the NCCL communicator needs a build with CUDA support (--config=cuda)");
}

}  // namespace shardtrain::trainer
