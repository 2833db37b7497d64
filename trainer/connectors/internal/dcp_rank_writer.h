// Internal to //trainer: one rank's part of a sharded save in PyTorch DCP's
// layout (trainer/checkpoint_io/dcp_checkpoint.h), planned at a step boundary
// and then written unit by unit: all at once for a synchronous save
// (WriteDcpRank), or on a background thread while training goes on
// (async_save.h). Planning reads the strategy and the optimizer (the
// training thread, no communication); writing reads only the tensors the
// plan holds — the live shards and optimizer state, or what CopyAside copied
// of them — and never communicates.
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_DCP_RANK_WRITER_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_DCP_RANK_WRITER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sharding/sharded_state.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp.h"

namespace torch::optim {
class Optimizer;
}
namespace shardtrain::strategies {
class Strategy;
}

namespace shardtrain::trainer::internal {

// One parameter's elements [begin, end) (the flat index of the tensor this
// rank stores, of `shape`), found at `at` in its unit's flat parameter. Under
// tensor parallelism the stored tensor is `piece` of the global one
// (`global_shape`); otherwise both shapes are the same.
struct ShardPart {
  std::string name;
  std::vector<int64_t> shape, global_shape;
  int64_t at = 0, begin = 0, end = 0;
  std::optional<sharding::GlobalPiece> piece;
};
// The parameters of unit `u` that this rank's shard holds elements of.
// `shapes`: the stored shapes (the module's).
std::vector<ShardPart> PartsInShard(const sharding::ShardedStateDict& sd, size_t u,
                                    const std::map<std::string, std::vector<int64_t>>& shapes);

// A box of a part's stored tensor and the box of the global tensor it is.
struct BoxPair {
  dcp::Box stored, global;
};
// The global boxes that the stored box `stored` of `p` covers (one, or one
// per block of a piece it crosses), each with its stored part.
std::vector<BoxPair> GlobalBoxes(const ShardPart& p, const dcp::Box& stored);
// The parts of the global box `global` that `p`'s stored tensor holds, each
// with its stored box.
std::vector<BoxPair> StoredBoxes(const ShardPart& p, const dcp::Box& global);

// Where a rank file holds the LibTorch archive of an optimizer other than
// Adam, AdamW and SGD (it loads at the same world size only).
std::vector<dcp::PathPart> DcpArchivePath(int64_t rank);

class DcpRankWriter {
 public:
  // Plans this rank's file in the temporary directory of `path` (which
  // rank 0's BeginShardedSave made): the boxes its shards cover of each
  // parameter and, for Adam, AdamW and SGD, of each optimizer state tensor;
  // other optimizers' LibTorch archive (serialized now); on rank 0 also a
  // copy of the buffers and `groups`. HYBRID_SHARD and NO_SHARD replicas
  // beyond the first write no units. `background`: WriteUnit will run on
  // another thread, so a unit's optimizer state laid out like its shard is
  // taken now — the optimizer's own tensors, or with use_orig_params a copy
  // of every unit's; otherwise WriteUnit makes each unit's copy in turn. And
  // the CRC-32 of every chunk is computed now, on every rank at once, so
  // that the writer threads beside training only move bytes.
  DcpRankWriter(strategies::Strategy& strategy, torch::optim::Optimizer& opt, const std::string& path,
                const std::vector<OptimizerGroup>& groups, bool background);
  ~DcpRankWriter();
  DcpRankWriter(const DcpRankWriter&) = delete;
  DcpRankWriter& operator=(const DcpRankWriter&) = delete;

  // The units whose shards this rank writes (0 for a later replica).
  int num_units() const { return static_cast<int>(units_.size()); }
  // The unit (as numbered here) of each of the optimizer's tensors
  // (OptimizerParams' order); empty when some tensor has none or the
  // optimizer is not Adam, AdamW or SGD (then a step changes any unit).
  const std::vector<int>& unit_of_optimizer_tensors() const { return unit_of_; }
  // Replaces unit u's tensors by copies (before something changes the live
  // ones); returns the bytes copied.
  int64_t CopyAside(int u);
  // What CopyAside(u) would copy, in bytes.
  int64_t UnitBytes(int u) const;
  // Writes unit u's chunks, then drops its tensors (and copies).
  void WriteUnit(int u);
  // The rest (buffers, groups, archive), the file, and this rank's part of
  // the metadata. shardtrain::Error naming the file on failure.
  void Finish();

 private:
  struct Unit {
    std::vector<ShardPart> parts;
    at::Tensor shard;                          // the live shard (or its copy)
    std::map<std::string, at::Tensor> ostate;  // laid out like the shard (live, a copy, or empty)
    int64_t base = 0;                          // the shard's first element in the unit's flat parameter
    int64_t step = -1;                         // Adam's step (-1: none)
    std::vector<uint32_t> crcs;                // background: each piece's CRC-32, in ForEachPiece's order
  };
  // The chunks WriteUnit writes of a unit's shard and optimizer state, in
  // order: fn(part, box, piece, state key; nullptr for the parameter).
  using PieceFn = std::function<void(const ShardPart&, const dcp::Box&, const at::Tensor&, const std::string*)>;
  void ForEachPiece(const Unit& unit, const PieceFn& fn) const;

  std::string path_;
  int64_t rank_ = 0;
  std::unique_ptr<dcp::RankFileWriter> file_;
  dcp::Metadata part_;
  std::vector<Unit> units_;
  std::function<std::map<std::string, at::Tensor>(int)> ostate_of_;  // not background: unit -> its state
  std::vector<int> unit_of_;
  std::map<std::string, std::string> aliases_;  // tied weights: alias -> name in the units
  std::set<std::string> optimized_;
  std::map<std::string, at::Tensor> buffers_;  // rank 0: copies
  std::vector<OptimizerGroup> groups_;         // rank 0
  std::string archive_;                        // another optimizer's LibTorch archive ("" otherwise)
  bool other_optimizer_ = false;
  bool writes_whole_ = true;  // tensor parallelism: this rank writes the whole (replicated) parameters too
};

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_DCP_RANK_WRITER_H_
