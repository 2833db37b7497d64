// One rank of tests/cluster/hosts_test.sh: finds its place from the launcher's
// environment (torchrun, Open MPI, SLURM; launch/cluster_environment.h), joins the
// rendezvous, connects a GlooCommunicator world and HYBRID_SHARD's groups
// (shard = the ranks of this node, replicate = one rank of each node), moves
// known values through each, checks them exactly, and prints one line per group:
//
//   rank R/W host=<hostname> group=<name> size=<n> shm=<0|1> bytes=<sent> calls=<n>
//
// shm is GlooCommunicator::uses_shared_memory(); bytes are the group's
// CommStats (bytes this rank sent). Exchanged per group (float32):
//   world      one all-reduce (SUM) of 1024 floats
//   shard      one reduce-scatter (SUM) of 1024 * shard size floats
//   replicate  one all-reduce (SUM) of 1024 floats
// Exit codes: 0 ok; 1 a value was wrong; 2 an error (message on stderr).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"

namespace {

using shardtrain::ClusterInfo;
using shardtrain::comm::CommunicatorPtr;
using shardtrain::comm::GlooCommunicator;

constexpr int64_t kBlock = 1024;

std::string HostName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

void Report(const ClusterInfo& info, const CommunicatorPtr& group) {
  auto gloo = std::dynamic_pointer_cast<GlooCommunicator>(group);
  const auto stats = group->stats();
  int64_t calls = 0;
  for (auto c : stats.calls) calls += c;
  std::printf("rank %d/%d host=%s group=%s size=%d shm=%d bytes=%lld calls=%lld\n", info.rank, info.world_size,
              HostName().c_str(), group->name().c_str(), group->size(), gloo && gloo->uses_shared_memory() ? 1 : 0,
              static_cast<long long>(stats.TotalBytesSent()), static_cast<long long>(calls));
}

// SUM all-reduce of `group`'s ranks' (rank + 1) values: size*(size+1)/2 everywhere.
bool CheckAllReduce(const CommunicatorPtr& group) {
  at::Tensor t = at::full({kBlock}, static_cast<float>(group->rank() + 1));
  group->AllReduce(t)->Wait();
  const int n = group->size();
  return at::equal(t, at::full({kBlock}, static_cast<float>(n * (n + 1) / 2)));
}

// SUM reduce-scatter: rank r contributes (r + 1) * (block index + 1); block b
// of the result is (b + 1) * size*(size+1)/2.
bool CheckReduceScatter(const CommunicatorPtr& group) {
  const int n = group->size();
  at::Tensor in = at::empty({n * kBlock});
  for (int b = 0; b < n; ++b) in.narrow(0, b * kBlock, kBlock).fill_(static_cast<float>((group->rank() + 1) * (b + 1)));
  at::Tensor out = at::zeros({kBlock});
  group->ReduceScatter(in, out)->Wait();
  return at::equal(out, at::full({kBlock}, static_cast<float>((group->rank() + 1) * n * (n + 1) / 2)));
}

int Run() {
  const ClusterInfo info = shardtrain::DetectClusterEnvironment();
  auto store = shardtrain::comm::CreateStore(shardtrain::RendezvousOptionsFor(info));
  CommunicatorPtr world = GlooCommunicator::Create(store, info.rank, info.world_size);
  auto hybrid = world->SplitHybrid(info.local_world_size);
  bool ok = CheckAllReduce(world);
  ok = CheckReduceScatter(hybrid.shard) && ok;
  ok = CheckAllReduce(hybrid.replicate) && ok;
  world->Barrier()->Wait();
  Report(info, world);
  Report(info, hybrid.shard);
  Report(info, hybrid.replicate);
  std::fflush(stdout);
  if (!ok) std::fprintf(stderr, "rank %d: a collective gave wrong values\n", info.rank);
  world->Barrier()->Wait();
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return Run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shm_probe: %s\n", e.what());
    return 2;
  }
}
