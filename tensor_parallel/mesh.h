// DeviceMesh: the world seen as a data_parallel_size x tensor_parallel_size
// grid (PyTorch's init_device_mesh(..., mesh_dim_names=("dp", "tp"))).
//
// Tensor-parallel groups are consecutive ranks ({0,1}, {2,3} for a 2x2 mesh),
// so that with a launcher that numbers a host's ranks consecutively a
// tensor-parallel group stays inside one host (its traffic is per layer and
// on the critical path); data-parallel groups are the ranks with the same
// index in their tensor-parallel group ({0,2}, {1,3}). A dimension of size 1
// has a group of one rank (its collectives are identities); a single process
// (world nullptr or of size 1) has `world` as both groups.
#ifndef SHARDTRAIN_TENSOR_PARALLEL_MESH_H_
#define SHARDTRAIN_TENSOR_PARALLEL_MESH_H_

#include <string>

#include "comm/communicator.h"

namespace shardtrain::tensor_parallel {

struct DeviceMesh {
  comm::CommunicatorPtr world;  // nullptr for a single process
  comm::CommunicatorPtr dp;     // this rank's data-parallel group
  comm::CommunicatorPtr tp;     // this rank's tensor-parallel group
  int dp_size = 1;
  int tp_size = 1;
  int dp_rank = 0;
  int tp_rank = 0;
  // "2x2 (data_parallel x tensor_parallel)".
  std::string ToString() const;
};

// Builds the mesh over `world` (nullptr or size 1: a 1x1 mesh). A size of 0
// means "what the other leaves" (world size / the other; both 0: all ranks in
// tensor parallel). Every rank calls it with the same sizes. Throws
// InvalidArgumentError, naming the world size and its valid splits, when the
// product is not the world size or a size is negative.
DeviceMesh MakeDeviceMesh(const comm::CommunicatorPtr& world, int data_parallel_size, int tensor_parallel_size);

}  // namespace shardtrain::tensor_parallel

#endif  // SHARDTRAIN_TENSOR_PARALLEL_MESH_H_
