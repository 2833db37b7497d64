// Ordered shared-memory reductions and the collectives through
// SharedMemoryMesh (see internal/mesh_collectives.h).
#include "comm/gloo/internal/mesh_collectives.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/gloo/internal/common.h"
#include "comm/gloo/reduce_kernels.h"

namespace shardtrain::comm::gloo_internal {
namespace {

// Start of block b when n elements are cut into w blocks, the first n % w of
// them one element longer.
int64_t BlockBegin(int64_t n, int w, int b) { return n / w * b + std::min<int64_t>(b, n % w); }

// Elements laid end to end in one or more contiguous runs (a tensor, or the
// pieces of a reduce-scatter's input where they lie); positions count
// elements of `es` bytes over the whole sequence.
class Spans {
 public:
  struct Run {
    uint8_t* data;
    int64_t numel;
  };
  Spans(const std::vector<Run>& runs, int64_t es) : es_(es) {
    for (const Run& r : runs) {
      if (r.numel == 0) continue;  // (its pointer may be null)
      runs_.push_back(r);
      starts_.push_back(numel_);
      numel_ += r.numel;
    }
  }
  static Spans Of(const at::Tensor& t) {
    return Spans({{static_cast<uint8_t*>(t.data_ptr()), t.numel()}}, t.element_size());
  }
  int64_t numel() const { return numel_; }

  // Calls fn(offset from `begin`, pointer, count) for each contiguous part of
  // [begin, begin + count), in order.
  template <typename Fn>
  void ForEach(int64_t begin, int64_t count, Fn&& fn) const {
    if (count <= 0) return;
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    for (int64_t done = 0; done < count; ++i) {
      const int64_t at = begin + done - starts_[i];
      const int64_t k = std::min(count - done, runs_[i].numel - at);
      fn(done, runs_[i].data + at * es_, k);
      done += k;
    }
  }
  // The byte pieces of [begin, begin + count), for SharedMemoryMesh::PeerTraffic::send.
  std::vector<std::pair<const void*, int64_t>> Bytes(int64_t begin, int64_t count) const {
    std::vector<std::pair<const void*, int64_t>> out;
    ForEach(begin, count, [&](int64_t, uint8_t* p, int64_t k) { out.emplace_back(p, k * es_); });
    return out;
  }
  // Whether any run shares bytes with `t`'s.
  bool Overlaps(const at::Tensor& t) const {
    const auto* lo = static_cast<const uint8_t*>(t.data_ptr());
    const uint8_t* hi = lo + t.numel() * es_;
    for (const Run& r : runs_)
      if (r.data < hi && lo < r.data + r.numel * es_) return true;
    return false;
  }

 private:
  std::vector<Run> runs_;
  std::vector<int64_t> starts_;
  int64_t numel_ = 0;
  int64_t es_;
};

// The sum of the W ranks' contributions to one block of n elements, taken in
// rank order (c_0 + c_1 + ... + c_{W-1}, deterministic whatever order the
// bytes arrive in), piece by piece as they arrive; then multiplied by `scale`,
// stored into `out` and divided by `divide` there. 16-bit types are summed in
// float32 and rounded once, before the division. With `from_zero` the sum
// starts from +0 (as the general reduce-scatter's sum over blocks: -0 + -0
// gives +0), else from c_0 (as Gloo's all-reduce). At W=2 this is bit for bit
// the TCP paths' arithmetic.
//
// float32 and bfloat16 run comm/gloo/reduce_kernels' loops; at W=2 each arriving
// piece is added to this rank's and stored in one pass (in place when `out`
// is `mine`). Otherwise the sum runs in a buffer of its own (float32 for
// 16-bit types, or when `out` is `mine`) and is stored when the last rank's
// piece is in. Other dtypes use ATen.
class OrderedSum {
 public:
  // `mine`: this rank's contribution (out.numel() elements of out's dtype),
  // which may be `out` itself or lie in several runs.
  OrderedSum(int world, int rank, Spans mine, at::Tensor out, double scale, double divide, bool from_zero)
      : world_(world), rank_(rank), n_(out.numel()), dtype_(out.scalar_type()), es_(out.element_size()),
        mine_(std::move(mine)), out_(std::move(out)), scale_(scale), divide_(divide), from_zero_(from_zero),
        done_(world, 0) {
    TORCH_INTERNAL_ASSERT(mine_.numel() == n_, "OrderedSum: this rank's part has ", mine_.numel(), " elements, not ",
                          n_);
    pair_ = world == 2 && (dtype_ == at::kFloat || dtype_ == at::kBFloat16);
    if (pair_) return;
    const bool aliased = n_ > 0 && mine_.Overlaps(out_);
    acc_ = Is16Bit(dtype_) ? at::empty({n_}, out_.options().dtype(at::kFloat)) : aliased ? at::empty_like(out_) : out_;
    zero_ = at::zeros({}, acc_.options());
  }

  // SharedMemoryMesh::Consumer: adds what it may of `peer`'s bytes.
  int64_t Consume(int peer, int64_t offset, const uint8_t* data, int64_t len) {
    if (pair_) {
      const int64_t k = std::min(len / es_, n_ - done_[peer]);
      StorePair(done_[peer], k, data);
      done_[peer] += k;
      return k * es_;
    }
    AdvanceMine();
    const int64_t k = std::min(len / es_, Limit(peer) - done_[peer]);
    if (k <= 0) return 0;
    Add(peer, data, k);
    AdvanceMine();
    return k * es_;
  }

  // Consume() as the mesh's consumer (the sum must outlive the exchange).
  SharedMemoryMesh::Consumer AsConsumer() {
    return [this](int peer, int64_t offset, const uint8_t* data, int64_t len) {
      return Consume(peer, offset, data, len);
    };
  }

  // After the exchange: adds the rest of this rank's contribution, finishes.
  void Finish() {
    if (!pair_)
      while (done_[rank_] < n_) AdvanceMine();
    TORCH_INTERNAL_ASSERT(finished_ == n_, "OrderedSum finished ", finished_, " of ", n_, " elements");
  }

 private:
  // Source s may add up to where the source before it has added.
  int64_t Limit(int s) const { return s == 0 ? n_ : done_[s - 1]; }

  // W=2: out[b, b+k) = finish(mine + peer's piece) in one pass.
  void StorePair(int64_t begin, int64_t k, const uint8_t* data) {
    const kernels::Finish f{from_zero_, static_cast<float>(scale_)};
    uint8_t* out = static_cast<uint8_t*>(out_.data_ptr()) + begin * es_;
    mine_.ForEach(begin, k, [&](int64_t off, const uint8_t* mine, int64_t len) {
      const int64_t b = off * es_;
      if (dtype_ == at::kFloat) {
        kernels::AddF32(reinterpret_cast<float*>(out + b), reinterpret_cast<const float*>(mine),
                        reinterpret_cast<const float*>(data + b), len, f);
      } else {
        kernels::AddBF16(reinterpret_cast<uint16_t*>(out + b), reinterpret_cast<const uint16_t*>(mine),
                         reinterpret_cast<const uint16_t*>(data + b), len, f);
      }
    });
    Divide(begin, k);
    finished_ += k;
  }

  // Adds the next k elements of source s (at `data`) to the sum; stores what
  // every source has added.
  void Add(int s, const void* data, int64_t k) {
    const int64_t begin = done_[s];
    const bool first = s == 0;
    if (dtype_ == at::kFloat || dtype_ == at::kBFloat16) {
      float* acc = acc_.data_ptr<float>() + begin;
      if (dtype_ == at::kFloat) {
        const auto* src = static_cast<const float*>(data);
        first ? kernels::LoadF32(acc, src, k, from_zero_) : kernels::AccumulateF32(acc, src, k);
      } else {
        const auto* src = static_cast<const uint16_t*>(data);
        first ? kernels::LoadBF16(acc, src, k, from_zero_) : kernels::AccumulateBF16(acc, src, k);
      }
    } else {
      const at::Tensor src = at::from_blob(const_cast<void*>(data), {k}, out_.options());
      Serially(k, [&](int64_t i, int64_t len) {
        at::Tensor a = acc_.narrow(0, begin + i, len);
        if (!first || from_zero_) {
          at::add_out(a, first ? zero_ : a, src.narrow(0, i, len));
        } else {
          a.copy_(src.narrow(0, i, len));
        }
      });
    }
    done_[s] += k;
    if (s == world_ - 1) Store(begin, k);
  }

  // Adds this rank's contribution up to its limit, a bounded piece at a time
  // (so sends and receives are serviced in between).
  void AdvanceMine() {
    constexpr int64_t kPiece = int64_t{1} << 17;
    const int64_t k = std::min(kPiece, Limit(rank_) - done_[rank_]);
    if (k <= 0) return;
    // Add() moves done_[rank_]: collect the runs first.
    std::vector<std::pair<const uint8_t*, int64_t>> runs;
    mine_.ForEach(done_[rank_], k, [&](int64_t, const uint8_t* p, int64_t len) { runs.emplace_back(p, len); });
    for (const auto& [p, len] : runs) Add(rank_, p, len);
  }

  void Store(int64_t begin, int64_t count) {
    if (dtype_ == at::kBFloat16) {
      kernels::StoreBF16(static_cast<uint16_t*>(out_.data_ptr()) + begin, acc_.data_ptr<float>() + begin, count,
                         static_cast<float>(scale_));
    } else if (dtype_ == at::kFloat) {
      float* acc = acc_.data_ptr<float>() + begin;
      if (scale_ != 1.0) kernels::ScaleF32(acc, count, static_cast<float>(scale_));
      if (!acc_.is_same(out_)) std::memcpy(out_.data_ptr<float>() + begin, acc, count * sizeof(float));
    } else {
      Serially(count, [&](int64_t i, int64_t len) {
        at::Tensor a = acc_.narrow(0, begin + i, len);
        if (scale_ != 1.0) a.mul_(scale_);
        if (!acc_.is_same(out_)) out_.narrow(0, begin + i, len).copy_(a);
      });
    }
    Divide(begin, count);
    finished_ += count;
  }

  // out[b, b+k) /= divide, in the output dtype (as the TCP paths' div_).
  void Divide(int64_t begin, int64_t k) {
    if (divide_ == 1.0) return;
    Serially(k, [&](int64_t i, int64_t len) { out_.narrow(0, begin + i, len).div_(divide_); });
  }

  const int world_, rank_;
  const int64_t n_;
  const at::ScalarType dtype_;
  const int64_t es_;
  Spans mine_;
  at::Tensor out_, acc_, zero_;
  const double scale_, divide_;
  const bool from_zero_;
  bool pair_ = false;          // W=2 with a kernel dtype: one pass per piece, no accumulator
  std::vector<int64_t> done_;  // elements each source has added
  int64_t finished_ = 0;
};

// Reduce-scatter of `in` (W blocks of out.numel() elements) into `out`,
// which shares no bytes with `in` unless it is this rank's block of it.
void ReduceScatterSpans(SharedMemoryMesh& mesh, const Spans& in, const at::Tensor& out, double scale,
                        SteadyClock::time_point deadline) {
  const int world = mesh.size(), rank = mesh.rank();
  const int64_t n = out.numel();
  std::vector<Spans::Run> runs;
  in.ForEach(rank * n, n, [&](int64_t, uint8_t* p, int64_t k) { runs.push_back({p, k}); });
  OrderedSum sum(world, rank, Spans(runs, out.element_size()), out, scale, 1.0, /*from_zero=*/true);
  std::vector<SharedMemoryMesh::PeerTraffic> traffic(world);
  for (int p = 0; p < world; ++p) traffic[p] = {in.Bytes(p * n, n), n * out.element_size()};
  mesh.Exchange(traffic, sum.AsConsumer(), deadline);
  sum.Finish();
}

}  // namespace

void MeshAllGather(SharedMemoryMesh& mesh, const at::Tensor& input, const at::Tensor& output,
                   SteadyClock::time_point deadline) {
  const int world = mesh.size(), rank = mesh.rank();
  at::Tensor in = input.reshape(-1);
  const at::Tensor out = output.reshape(-1);
  const int64_t bytes = in.numel() * in.element_size();
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  const bool in_place = in.data_ptr() == base + rank * bytes;
  if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
  if (!in_place) std::memcpy(base + rank * bytes, in.data_ptr(), bytes);
  std::vector<SharedMemoryMesh::PeerTraffic> traffic(world);
  std::vector<int64_t> starts(world);
  for (int p = 0; p < world; ++p) {
    traffic[p] = {{{base + rank * bytes, bytes}}, bytes};
    starts[p] = p * bytes;
  }
  mesh.Exchange(traffic, CopyInto(base, std::move(starts)), deadline);
}

void MeshReduceScatter(SharedMemoryMesh& mesh, const at::Tensor& input, const at::Tensor& output, double scale,
                       SteadyClock::time_point deadline) {
  const int rank = mesh.rank();
  at::Tensor in = input.reshape(-1);
  const at::Tensor out = output.reshape(-1);
  const int64_t n = out.numel();
  // In place (`output` is this rank's block of `input`), OrderedSum sums into
  // scratch; any other overlap sends from a copy.
  const bool in_place = out.data_ptr() == in.narrow(0, rank * n, n).data_ptr();
  if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
  ReduceScatterSpans(mesh, Spans::Of(in), out, scale, deadline);
}

void MeshReduceScatterPieces(SharedMemoryMesh& mesh, const std::vector<at::Tensor>& pieces, const at::Tensor& output,
                             double scale, SteadyClock::time_point deadline) {
  std::vector<Spans::Run> runs;
  runs.reserve(pieces.size());
  for (const at::Tensor& p : pieces) runs.push_back({static_cast<uint8_t*>(p.data_ptr()), p.numel()});
  const at::Tensor out = output.reshape(-1);
  ReduceScatterSpans(mesh, Spans(runs, out.element_size()), out, scale, deadline);
}

// Reduce-scatter of the W blocks (each rank sums its own block, in rank
// order), then all-gather of the sums: every rank ends with the same bits.
void MeshAllReduce(SharedMemoryMesh& mesh, const at::Tensor& tensor, double divide, SteadyClock::time_point deadline) {
  const int world = mesh.size(), rank = mesh.rank();
  const at::Tensor t = tensor.reshape(-1);
  const int64_t n = t.numel(), es = t.element_size();
  auto block = [&](int b) {
    return t.narrow(0, BlockBegin(n, world, b), BlockBegin(n, world, b + 1) - BlockBegin(n, world, b));
  };
  const at::Tensor mine = block(rank);
  std::vector<SharedMemoryMesh::PeerTraffic> traffic(world);
  {
    OrderedSum sum(world, rank, Spans::Of(mine), mine, 1.0, divide, /*from_zero=*/false);
    for (int p = 0; p < world; ++p) traffic[p] = {{{block(p).data_ptr(), block(p).numel() * es}}, mine.numel() * es};
    mesh.Exchange(traffic, sum.AsConsumer(), deadline);
    sum.Finish();
  }
  std::vector<int64_t> starts(world);
  for (int p = 0; p < world; ++p) {
    traffic[p] = {{{mine.data_ptr(), mine.numel() * es}}, block(p).numel() * es};
    starts[p] = BlockBegin(n, world, p) * es;
  }
  mesh.Exchange(traffic, CopyInto(static_cast<uint8_t*>(t.data_ptr()), std::move(starts)), deadline);
}

}  // namespace shardtrain::comm::gloo_internal
