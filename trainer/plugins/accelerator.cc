#include "trainer/plugins/accelerator.h"

#include <ATen/ATen.h>

#include <cctype>
#include <string>

#include "base/errors.h"

// BuildHasCuda, CudaDeviceCount, SetCurrentDevice and CreateNcclCommunicator are
// in accelerator_cpu.cc or accelerator_cuda.cc (the build's choice), so that this
// file compiles the same with and without --config=cuda.

namespace shardtrain::trainer {

const std::vector<std::string>& AcceleratorNames() {
  static const std::vector<std::string> names = {"cpu", "cuda", "gpu", "auto"};
  return names;
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

}  // namespace shardtrain::trainer
