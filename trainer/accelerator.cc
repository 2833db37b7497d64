#include "trainer/accelerator.h"

#include <ATen/ATen.h>

#include <cctype>
#include <string>

#include "base/errors.h"

#ifdef SHARDTRAIN_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include "comm/nccl_communicator.h"
#endif

namespace shardtrain::trainer {

bool BuildHasCuda() {
#ifdef SHARDTRAIN_CUDA
  return true;
#else
  return false;
#endif
}

int CudaDeviceCount() {
#ifdef SHARDTRAIN_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

std::string ResolveAccelerator(const std::string& requested) {
  if (requested == "cpu") return "cpu";
  if (requested == "auto") return BuildHasCuda() && CudaDeviceCount() > 0 ? "cuda" : "cpu";
  ST_CHECK_ARG(requested == "cuda" || requested == "gpu", "unknown accelerator '", requested,
               "'; valid: cpu, cuda, gpu (= cuda), auto (cuda when available, else cpu)");
  ST_CHECK_ARG(BuildHasCuda(), "accelerator '", requested,
               "' is not available: this build has no CUDA support (build with --config=cuda); valid here: cpu, "
               "auto (= cpu in this build)");
  ST_CHECK_ARG(CudaDeviceCount() > 0, "accelerator '", requested,
               "' is not available: no CUDA device is visible to this process (no GPU or driver, or "
               "CUDA_VISIBLE_DEVICES hides them); valid here: cpu, auto (= cpu on this machine)");
  return "cuda";
}

int ResolveDevices(int devices, const std::string& accelerator) {
  ST_CHECK_ARG(devices == kAutoDevices || devices >= 1, "devices must be >= 1 or kAutoDevices (\"auto\"), got ",
               devices);
  if (accelerator != "cuda") return devices == kAutoDevices ? 1 : devices;
  const int visible = CudaDeviceCount();
  if (devices == kAutoDevices) return visible;
  ST_CHECK_ARG(devices <= visible, "devices=", devices, " with accelerator cuda, but only ", visible,
               " CUDA device(s) are visible (one rank per device)");
  return devices;
}

int ParseDevices(const std::string& text, const std::string& flag) {
  if (text == "auto") return kAutoDevices;
  bool digits = !text.empty();
  for (char c : text) digits = digits && std::isdigit(static_cast<unsigned char>(c));
  ST_CHECK_ARG(digits && text.size() < 9 && std::stoi(text) >= 1, "--", flag,
               " must be a number of ranks >= 1 or 'auto', got '", text, "'");
  return std::stoi(text);
}

c10::Device RankDevice(const std::string& accelerator, int local_rank) {
  if (accelerator != "cuda") return c10::Device(c10::kCPU);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

void SetCurrentDevice(const c10::Device& device) {
  if (!device.is_cuda()) return;
#ifdef SHARDTRAIN_CUDA
  c10::cuda::set_device(device.index());
#else
  ST_THROW(InvalidArgumentError, "device ", device.str(), " needs a build with CUDA support (--config=cuda)");
#endif
}

comm::CommunicatorPtr CreateNcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                             int device_index, const CommLimits& limits) {
#ifdef SHARDTRAIN_CUDA
  comm::NcclOptions o;
  o.device = device_index;
  o.timeout = limits.timeout;
  o.stall_warning = limits.stall_warning;
  o.stall_timeout = limits.stall_timeout;
  return comm::NcclCommunicator::Create(std::move(store), rank, size, o);
#else
  ST_THROW(InvalidArgumentError, "the NCCL communicator needs a build with CUDA support (--config=cuda)");
#endif
}

}  // namespace shardtrain::trainer
