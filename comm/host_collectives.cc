#include "comm/host_collectives.h"

#include <ATen/ops/empty.h>

namespace shardtrain::comm {
namespace {

// A host tensor the backend cannot take as it is.
bool NeedsStaging(const Communicator& c, const at::Tensor& t) { return c.backend() == "nccl" && !t.is_cuda(); }

}  // namespace

c10::Device CollectiveDevice(const Communicator& c) {
  return c.backend() == "nccl" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
}

void HostAllReduce(Communicator& c, const at::Tensor& tensor, ReduceOp op) {
  if (c.size() == 1) return;
  if (!NeedsStaging(c, tensor)) {
    c.AllReduce(tensor, {op})->Wait();
    return;
  }
  at::Tensor staged = tensor.to(CollectiveDevice(c));
  c.AllReduce(staged, {op})->Wait();
  tensor.copy_(staged);
}

void HostAllGather(Communicator& c, const at::Tensor& input, const at::Tensor& output) {
  if (!NeedsStaging(c, input)) {
    c.AllGather(input, output)->Wait();
    return;
  }
  at::Tensor staged = at::empty(output.sizes(), output.options().device(CollectiveDevice(c)));
  c.AllGather(input.to(CollectiveDevice(c)), staged)->Wait();
  output.copy_(staged);
}

void HostBroadcast(Communicator& c, const at::Tensor& tensor, int root) {
  if (c.size() == 1) return;
  if (!NeedsStaging(c, tensor)) {
    c.Broadcast(tensor, root)->Wait();
    return;
  }
  at::Tensor staged = tensor.to(CollectiveDevice(c));
  c.Broadcast(staged, root)->Wait();
  tensor.copy_(staged);
}

}  // namespace shardtrain::comm
