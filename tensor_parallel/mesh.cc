#include "tensor_parallel/mesh.h"

#include <sstream>
#include <vector>

#include "base/errors.h"

namespace shardtrain::tensor_parallel {
namespace {

// "1x4, 2x2, 4x1" for a world of 4.
std::string ValidSplits(int world_size) {
  std::ostringstream os;
  for (int dp = 1; dp <= world_size; ++dp) {
    if (world_size % dp != 0) continue;
    if (dp > 1) os << ", ";
    os << dp << "x" << world_size / dp;
  }
  return os.str();
}

}  // namespace

std::string DeviceMesh::ToString() const {
  std::ostringstream os;
  os << dp_size << "x" << tp_size << " (data_parallel x tensor_parallel)";
  return os.str();
}

DeviceMesh MakeDeviceMesh(const comm::CommunicatorPtr& world, int data_parallel_size, int tensor_parallel_size) {
  const int w = world ? world->size() : 1;
  ST_CHECK_ARG(data_parallel_size >= 0 && tensor_parallel_size >= 0,
               "model_parallel: data_parallel_size and tensor_parallel_size must be >= 0 (0: what the other leaves); "
               "got ",
               data_parallel_size, " and ", tensor_parallel_size);
  int dp = data_parallel_size, tp = tensor_parallel_size;
  if (dp == 0 && tp == 0) tp = w;
  if (dp == 0 && tp > 0 && w % tp == 0) dp = w / tp;
  if (tp == 0 && dp > 0 && w % dp == 0) tp = w / dp;
  ST_CHECK_ARG(dp > 0 && tp > 0 && dp * tp == w, "model_parallel: data_parallel_size (", data_parallel_size,
               ") x tensor_parallel_size (", tensor_parallel_size, ") must equal the world size ", w,
               "; valid meshes (data_parallel x tensor_parallel): ", ValidSplits(w));
  DeviceMesh mesh;
  mesh.world = world;
  mesh.dp_size = dp;
  mesh.tp_size = tp;
  if (w == 1) {
    mesh.dp = mesh.tp = world;
    return mesh;
  }
  mesh.tp_rank = world->rank() % tp;
  mesh.dp_rank = world->rank() / tp;
  // Every rank creates every group, in the same order (Communicator::NewGroup).
  for (int g = 0; g < dp; ++g) {
    std::vector<int> ranks;
    for (int i = 0; i < tp; ++i) ranks.push_back(g * tp + i);
    if (auto c = world->NewGroup(ranks, "tp" + std::to_string(g))) mesh.tp = c;
  }
  for (int i = 0; i < tp; ++i) {
    std::vector<int> ranks;
    for (int g = 0; g < dp; ++g) ranks.push_back(g * tp + i);
    if (auto c = world->NewGroup(ranks, "dp" + std::to_string(i))) mesh.dp = c;
  }
  return mesh;
}

}  // namespace shardtrain::tensor_parallel
