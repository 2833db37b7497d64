#include "tensor_parallel/placement.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <sstream>

#include "base/errors.h"

namespace shardtrain::tensor_parallel {
namespace {

thread_local TensorParallelScope* g_scope = nullptr;

int64_t BlockRows(const Placement& p) {
  ST_CHECK_ARG(p.dim >= 0 && p.dim < static_cast<int64_t>(p.global_shape.size()) && p.chunks >= 1 &&
                   p.global_shape[p.dim] % p.chunks == 0,
               "tensor parallel: invalid placement ", p.ToString());
  return p.global_shape[p.dim] / p.chunks;
}

// `t` with `dim` moved to the front, its rows viewed as [chunks, rows, rest...].
at::Tensor AsBlocks(const at::Tensor& t, int64_t dim, int64_t chunks) {
  at::Tensor front = t.movedim(dim, 0);
  std::vector<int64_t> shape = {chunks, front.size(0) / chunks};
  for (int64_t d = 1; d < front.dim(); ++d) shape.push_back(front.size(d));
  return front.reshape(shape);
}

// [chunks, rows, rest...] back to a tensor with `dim` in its place.
at::Tensor FromBlocks(const at::Tensor& blocks, int64_t dim) {
  std::vector<int64_t> shape = {blocks.size(0) * blocks.size(1)};
  for (int64_t d = 2; d < blocks.dim(); ++d) shape.push_back(blocks.size(d));
  return blocks.reshape(shape).movedim(0, dim).contiguous();
}

}  // namespace

std::pair<int64_t, int64_t> Placement::Range(int rank, int group_size) const {
  const int64_t rows = BlockRows(*this);
  const int64_t per_rank = (rows + group_size - 1) / group_size;
  const int64_t begin = std::min<int64_t>(rank * per_rank, rows);
  return {begin, std::min(begin + per_rank, rows)};
}

std::vector<int64_t> Placement::LocalShape(int rank, int group_size) const {
  std::vector<int64_t> shape = global_shape;
  if (!sharded) return shape;
  const auto [begin, end] = Range(rank, group_size);
  shape[dim] = chunks * (end - begin);
  return shape;
}

std::string Placement::ToString() const {
  std::ostringstream os;
  if (sharded) {
    os << "Shard(" << dim;
    if (chunks > 1) os << ", chunks=" << chunks;
    os << ") of ";
  } else {
    os << "Replicate ";
  }
  os << "[";
  for (size_t i = 0; i < global_shape.size(); ++i) os << (i ? ", " : "") << global_shape[i];
  os << "]";
  if (partial_grad) os << " (partial gradient)";
  return os.str();
}

at::Tensor LocalPiece(const at::Tensor& global, const Placement& placement, int rank, int group_size) {
  ST_CHECK_ARG(global.sizes().vec() == placement.global_shape, "tensor parallel: a tensor of shape ", global.sizes(),
               " does not match its placement ", placement.ToString());
  if (!placement.sharded || group_size == 1) return global.clone().contiguous();
  const auto [begin, end] = placement.Range(rank, group_size);
  return FromBlocks(AsBlocks(global, placement.dim, placement.chunks).slice(1, begin, end), placement.dim);
}

at::Tensor GatherGlobal(const at::Tensor& local, const Placement& placement, const comm::CommunicatorPtr& group) {
  if (!placement.sharded || !group || group->size() == 1) return local;
  const int size = group->size();
  const int64_t per_rank = placement.Range(0, size).second;
  // Each rank's rows of every block, padded to per_rank rows (torch.chunk's
  // last pieces are shorter), gathered, then the padding dropped.
  at::Tensor blocks = AsBlocks(local, placement.dim, placement.chunks);
  std::vector<int64_t> padded_shape = blocks.sizes().vec();
  padded_shape[1] = per_rank;
  at::Tensor padded = at::zeros(padded_shape, local.options());
  padded.slice(1, 0, blocks.size(1)).copy_(blocks);
  std::vector<int64_t> all_shape = padded_shape;
  all_shape.insert(all_shape.begin(), size);
  at::Tensor all = at::empty(all_shape, local.options());
  group->AllGather(padded, all)->Wait();
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < size; ++r) {
    const auto [begin, end] = placement.Range(r, size);
    pieces.push_back(all.select(0, r).slice(1, 0, end - begin));
  }
  return FromBlocks(at::cat(pieces, 1), placement.dim);
}

std::map<std::string, Placement> CollectPlacements(const torch::nn::Module& root) {
  std::map<std::string, Placement> out;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    Placement p;
    p.global_shape = item.value().sizes().vec();
    out.emplace(item.key(), p);
  }
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const auto* tp = dynamic_cast<const TensorParallelModule*>(item.value().get());
    if (tp == nullptr) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& [name, placement] : tp->Placements()) {
      auto it = out.find(prefix + name);
      ST_CHECK_ARG(it != out.end(), "tensor parallel: module ", item.key(), " reports a placement for ", name,
                   ", which is not one of its parameters");
      it->second = placement;
    }
  }
  return out;
}

TensorParallelScope::TensorParallelScope(comm::CommunicatorPtr group, bool sequence_parallel)
    : group_(std::move(group)), sequence_parallel_(sequence_parallel), previous_(g_scope) {
  g_scope = this;
}

TensorParallelScope::~TensorParallelScope() { g_scope = previous_; }

comm::CommunicatorPtr TensorParallelScope::CurrentGroup() {
  return g_scope && g_scope->group_ && g_scope->group_->size() > 1 ? g_scope->group_ : nullptr;
}

bool TensorParallelScope::CurrentSequenceParallel() { return CurrentGroup() != nullptr && g_scope->sequence_parallel_; }

}  // namespace shardtrain::tensor_parallel
