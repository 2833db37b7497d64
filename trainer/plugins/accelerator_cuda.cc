// The accelerator functions of a build with CUDA support (--config=cuda; see
// accelerator_cpu.cc for the default). Declared in accelerator.h. The only
// trainer file that sees CUDA's and NCCL's headers.
#include <c10/core/Device.h>
#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <utility>

#include "comm/nccl_communicator.h"
#include "trainer/plugins/accelerator.h"

namespace shardtrain::trainer {

bool BuildHasCuda() { return true; }

int CudaDeviceCount() { return static_cast<int>(c10::cuda::device_count()); }

void SetCurrentDevice(const c10::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::set_device(device.index());
}

comm::CommunicatorPtr CreateNcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                             int device_index, const CommLimits& limits) {
  comm::NcclOptions o;
  o.device = device_index;
  static_cast<comm::CommLimits&>(o) = limits;
  return comm::NcclCommunicator::Create(std::move(store), rank, size, o);
}

}  // namespace shardtrain::trainer
