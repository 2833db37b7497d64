// Accelerator: what TrainerOptions::accelerator and ::devices mean in this
// build (Lightning's accelerator="cpu" | "cuda" | "gpu" | "auto" and
// devices=N | "auto"), and the CUDA pieces the Trainer needs: the device of a
// rank, the NCCL communicator, and collectives on CPU tensors that also work
// over NCCL.
//
// CUDA support is compiled in with --config=cuda (Bazel define
// shardtrain_cuda=1, which links //comm:nccl and LibTorch's CUDA library).
// Without it, or without a visible CUDA device, asking for "cuda" is an
// InvalidArgumentError that says which of the two is missing.
#ifndef SHARDTRAIN_TRAINER_PLUGINS_ACCELERATOR_H_
#define SHARDTRAIN_TRAINER_PLUGINS_ACCELERATOR_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/host_collectives.h"
#include "comm/rendezvous.h"

namespace shardtrain::trainer {

// TrainerOptions::devices = kAutoDevices: Lightning's devices="auto" — every
// visible CUDA device with accelerator cuda, 1 process on cpu.
inline constexpr int kAutoDevices = -1;

// Whether this binary was built with CUDA support (--config=cuda).
bool BuildHasCuda();
// CUDA devices this process sees (0 in a build without CUDA support).
int CudaDeviceCount();

// Resolves an accelerator name: "cpu" -> "cpu"; "cuda" or "gpu" -> "cuda" when
// available; "auto" -> "cuda" when the build has CUDA and a device is
// visible, else "cpu". Throws InvalidArgumentError for unknown names and for
// "cuda"/"gpu" when CUDA is not available, saying why (no CUDA in this build,
// or no device visible) and what is valid.
std::string ResolveAccelerator(const std::string& requested);
// The names ResolveAccelerator takes: cpu, cuda, gpu, auto.
const std::vector<std::string>& AcceleratorNames();

// Ranks per node for `devices` (kAutoDevices or >= 1) on the resolved
// accelerator. Throws InvalidArgumentError for other values and for more
// CUDA ranks than visible devices.
int ResolveDevices(int devices, const std::string& resolved_accelerator);

// Parses a --devices flag: "auto" (kAutoDevices) or an integer >= 1.
// Throws InvalidArgumentError naming `flag` otherwise.
int ParseDevices(const std::string& text, const std::string& flag = "devices");

// The device of a rank: CPU, or cuda:<local_rank>.
c10::Device RankDevice(const std::string& resolved_accelerator, int local_rank);

// Makes `device` the calling thread's current CUDA device (no-op for CPU).
void SetCurrentDevice(const c10::Device& device);

// The time limits of a communicator: one struct for every backend (comm/communicator.h).
using comm::CommLimits;

// The NCCL communicator of the job for a rank on CUDA device `device_index`,
// with `limits` (NcclOptions' timeout, stall_warning, stall_timeout).
// Throws InvalidArgumentError in a build without CUDA support.
comm::CommunicatorPtr CreateNcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                             int device_index, const CommLimits& limits);

// Collectives on CPU tensors over any backend (comm/host_collectives.h).
using comm::HostAllGather;
using comm::HostAllReduce;

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_PLUGINS_ACCELERATOR_H_
