// A three-unit model whose units run a probe before their forward, and the
// probe that shows whether unit b1's all-gather completes while unit b0's
// forward still runs on the GPU (the forward overlap of
// sharding/internal/device_streams.h). Shared by cuda_fixes_test (forced
// collectives at W=1) and multi_gpu_test (W=2).
#ifndef SHARDTRAIN_TESTS_CUDA_OVERLAP_PROBE_H_
#define SHARDTRAIN_TESTS_CUDA_OVERLAP_PROBE_H_

#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "sharding/wrap_point.h"
#include "tests/testing/recording_communicator.h"

namespace shardtrain::sharding {

// A unit whose forward first runs `on_forward` (the test's probe).
class ProbeBlockImpl : public torch::nn::Module {
 public:
  ProbeBlockImpl() { fc = register_module("fc", torch::nn::Linear(64, 64)); }
  at::Tensor forward(const at::Tensor& x) {
    if (on_forward) on_forward();
    return at::relu(fc->forward(x));
  }
  torch::nn::Linear fc{nullptr};
  std::function<void()> on_forward;
};

class ProbeNetImpl : public torch::nn::Module {
 public:
  ProbeNetImpl() {
    b0 = register_module("b0", std::make_shared<Sharded<ProbeBlockImpl>>());
    b1 = register_module("b1", std::make_shared<Sharded<ProbeBlockImpl>>());
    b2 = register_module("b2", std::make_shared<Sharded<ProbeBlockImpl>>());
  }
  at::Tensor forward(const at::Tensor& x) { return b2->forward(b1->forward(b0->forward(x))); }
  std::shared_ptr<Sharded<ProbeBlockImpl>> b0, b1, b2;
};

// Armed on a net wrapped over `recording`, the net's next forward on `device`
// queues a spin kernel of `spin_cycles` GPU cycles and then an event in b0's
// forward; in b1's forward (the host gets there at once: nothing waits for
// the device) it polls b1's gather for up to `poll` and notes whether it
// completed while the event was still pending.
class OverlapProbe {
 public:
  OverlapProbe(ProbeNetImpl& net, std::shared_ptr<testing::RecordingCommunicator> recording, c10::Device device,
               int64_t spin_cycles, std::chrono::milliseconds poll)
      : b0_done_(c10::DeviceType::CUDA) {
    net.b0->on_forward = [this, device, spin_cycles] {
      at::cuda::sleep(spin_cycles);
      b0_done_.record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device));
    };
    net.b1->on_forward = [this, recording, poll] {
      const auto b1_gather = recording->last_all_gather();
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < poll) {
        if (b1_gather->IsCompleted()) {
          gather_done_ = true;
          b0_running_then_ = !b0_done_.query();
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      waited_ms_ =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    };
  }
  // b1's gather completed while b0's forward still ran.
  bool overlapped() const { return gather_done_ && b0_running_then_; }
  std::string Describe() const {
    std::ostringstream s;
    s << "b1's all-gather " << (gather_done_ ? "completed" : "did not complete") << " after " << waited_ms_
      << " ms, b0's forward " << (b0_running_then_ ? "still running" : "already done");
    return s.str();
  }

 private:
  c10::Event b0_done_;
  bool gather_done_ = false;
  bool b0_running_then_ = false;
  int64_t waited_ms_ = -1;
};

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_TESTS_CUDA_OVERLAP_PROBE_H_
