// comm_bench's self-check: the communicator's edge cases (in-place and
// aliased buffers, every float dtype, sizes of one element to several
// reduce-scatter pieces) checked bit for bit against reference arithmetic.
#ifndef SHARDTRAIN_BENCH_COMM_SELF_CHECK_H_
#define SHARDTRAIN_BENCH_COMM_SELF_CHECK_H_

#include "comm/gloo_communicator.h"

namespace shardtrain::bench {

// Collective: every rank of `c` calls. False (with the failures on stderr) if
// any result differs from the reference.
bool SelfCheck(comm::GlooCommunicator& c);

}  // namespace shardtrain::bench

#endif  // SHARDTRAIN_BENCH_COMM_SELF_CHECK_H_
