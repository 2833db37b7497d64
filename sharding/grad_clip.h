// Clipping gradients by their global norm, where a group may hold them in
// disjoint pieces (shards, use_orig_params views), without a host read on a
// GPU. The sharding core (ShardedModel::ClipGradNorm) and every strategy's
// ClipGradNorm use this one routine.
#ifndef SHARDTRAIN_SHARDING_GRAD_CLIP_H_
#define SHARDTRAIN_SHARDING_GRAD_CLIP_H_

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm/communicator.h"

namespace shardtrain::sharding {

// Scales `grads` (undefined ones skipped) so that their global norm
// (norm_type 2 or infinity) is at most max_norm, and returns the norm before
// clipping as a 0-dim float64 tensor. The sum of squares (or the max) is
// accumulated on the gradients' device in float64, in the order given; with
// `group` (the pieces are disjoint across its ranks) it is all-reduced there
// on the communicator's device, so the norm is the unsharded one.
//   - Gradients on the CPU (offloaded ones too): the norm is read on the host
//     and the gradients are scaled only when it exceeds max_norm (coefficient
//     max_norm / (norm + 1e-6)).
//   - On a device (CUDA) the coefficient min(1, max_norm / (norm + 1e-6)) is
//     computed and applied there: nothing waits for the device, and the
//     returned norm stays on it (read it only when it is needed).
// InvalidArgumentError for max_norm <= 0 or another norm_type.
at::Tensor ClipGradNorm(const std::vector<at::Tensor>& grads, double max_norm, double norm_type,
                        const comm::CommunicatorPtr& group = nullptr);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_GRAD_CLIP_H_
