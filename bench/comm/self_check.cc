#include "bench/comm/self_check.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <iostream>
#include <string>
#include <vector>

namespace shardtrain::bench {
namespace {

using comm::GlooCommunicator;

// The reference reduce-scatter arithmetic (the general path's): stack every
// rank's input, sum over ranks (in float32 for 16-bit types), scale, round once.
at::Tensor ReferenceReduceScatter(const std::vector<at::Tensor>& inputs, int rank, double scale) {
  const int w = static_cast<int>(inputs.size());
  const int64_t n = inputs[0].numel() / w;
  at::Tensor blocks = at::stack(inputs).view({w, w, n}).select(1, rank);  // [ranks, n]: everyone's block `rank`
  const at::ScalarType dt = inputs[0].scalar_type();
  const bool low = dt == at::kHalf || dt == at::kBFloat16;
  at::Tensor sum = low ? blocks.sum(0, false, at::kFloat) : blocks.sum(0);
  if (scale != 1.0) sum.mul_(scale);
  return sum.to(dt);
}

// The reference all-reduce arithmetic (Gloo's, the general path's): each
// input divided by pre_divide in its dtype, the sum over ranks in rank order
// (one rounding per add; for 16-bit types each add in float32, rounded), the
// sum divided by post (post_divide, times W for AVG) in its dtype.
at::Tensor ReferenceAllReduce(const std::vector<at::Tensor>& inputs, double pre, double post) {
  const at::ScalarType dt = inputs[0].scalar_type();
  const bool low = dt == at::kHalf || dt == at::kBFloat16;
  at::Tensor sum;
  for (const at::Tensor& in : inputs) {
    at::Tensor x = in.clone();
    if (pre != 1.0) x.div_(pre);
    sum = !sum.defined() ? x : low ? (sum.to(at::kFloat) + x.to(at::kFloat)).to(dt) : sum + x;
  }
  if (post != 1.0) sum.div_(post);
  return sum;
}

bool BitEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) return false;
  const at::ScalarType bits = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kLong;
  return at::equal(a.contiguous().view(bits), b.contiguous().view(bits));
}

// Random data with signed zeros and mixed magnitudes, the same on every rank for a given seed.
at::Tensor RandomInput(int64_t numel, at::ScalarType dt, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = at::randn({numel}, gen, at::TensorOptions().dtype(at::kDouble));
  t.mul_(at::pow(10.0, at::randint(-3, 4, {numel}, gen, at::TensorOptions().dtype(at::kDouble))));
  if (numel > 8) {
    t[0] = 0.0;
    t[1] = -0.0;
    t[2] = -0.0;
  }
  return t.to(dt);
}

// The self-check's verdicts: failures go to stderr, `ok` remembers any.
struct Verdicts {
  int rank = 0;
  bool ok = true;
  void Expect(bool cond, const std::string& what) {
    if (!cond) std::cerr << "rank " << rank << ": SELF-CHECK FAILED: " << what << "\n";
    ok = ok && cond;
  }
  // Bit equality of `got` and `ref`, with the first differing element on stderr.
  void ExpectBitEqual(const at::Tensor& got, const at::Tensor& ref, const std::string& what) {
    if (!BitEqual(got, ref)) {
      const at::Tensor bad = got.to(at::kDouble).ne(ref.to(at::kDouble)).logical_or(got.signbit().ne(ref.signbit()));
      const int64_t first = bad.nonzero().flatten()[0].item<int64_t>();
      std::cerr << what << ": " << bad.sum().item<int64_t>() << " elements differ, first at " << first << ": got "
                << got[first].item<double>() << ", reference " << ref[first].item<double>() << "\n";
    }
    Expect(BitEqual(got, ref), what);
  }
};

// The three reductions the self-check runs: SUM, AVG with divide factors, SUM with a post-divide.
shardtrain::comm::ReduceOptions CheckedReduction(int variant) {
  using shardtrain::comm::ReduceOp;
  using shardtrain::comm::ReduceOptions;
  if (variant == 1) return ReduceOptions{ReduceOp::kAvg, 2.0, 3.0};
  if (variant == 2) return ReduceOptions{ReduceOp::kSum, 1.0, 3.0};
  return ReduceOptions{};
}

// All-gather into separate buffers, in place, and (W=2) from the peer's block.
void CheckAllGather(GlooCommunicator& c, at::ScalarType dt, int64_t n, Verdicts& v) {
  const int w = c.size(), r = c.rank();
  const std::string what = c10::toString(dt) + std::string(" n=") + std::to_string(n);
  std::vector<at::Tensor> shards;
  for (int q = 0; q < w; ++q) shards.push_back(RandomInput(n, dt, 1000 + q));
  at::Tensor expected = at::cat(shards);
  at::Tensor full = at::full({w * n}, 7, dt);
  c.AllGather(shards[r], full)->Wait();
  v.Expect(BitEqual(full, expected), "all_gather " + what);
  full.fill_(7);
  full.narrow(0, r * n, n).copy_(shards[r]);
  c.AllGather(full.narrow(0, r * n, n), full)->Wait();
  v.Expect(BitEqual(full, expected), "in-place all_gather " + what);
  if (w == 2) {  // input is the OTHER rank's block of the output
    full.fill_(7);
    full.narrow(0, (1 - r) * n, n).copy_(shards[r]);
    c.AllGather(full.narrow(0, (1 - r) * n, n), full)->Wait();
    v.Expect(BitEqual(full, expected), "all_gather from the peer's block " + what);
  }
}

// Reduce-scatter: each reduction, into a fresh output, into a view of the
// input's own block and into a view straddling two blocks.
void CheckReduceScatter(GlooCommunicator& c, at::ScalarType dt, int64_t n, Verdicts& v) {
  using shardtrain::comm::ReduceOp;
  const int w = c.size(), r = c.rank();
  const std::string dn = c10::toString(dt);
  std::vector<at::Tensor> inputs;
  for (int q = 0; q < w; ++q) inputs.push_back(RandomInput(w * n, dt, 2000 + q));
  for (int variant = 0; variant < 3; ++variant) {
    const auto o = CheckedReduction(variant);
    const double scale = 1.0 / (o.pre_divide * o.post_divide * (o.op == ReduceOp::kAvg ? w : 1));
    at::Tensor in = inputs[r].clone();
    at::Tensor out = at::full({n}, 7, dt);
    c.ReduceScatter(in, out, o)->Wait();
    const std::string what = "reduce_scatter#" + std::to_string(variant) + " " + dn + " n=" + std::to_string(n);
    v.ExpectBitEqual(out, ReferenceReduceScatter(inputs, r, scale), what);
    v.Expect(BitEqual(in, inputs[r]), what + " left its input unchanged");
    if (variant != 1) continue;
    at::Tensor aliased = inputs[r].clone();
    c.ReduceScatter(aliased, aliased.narrow(0, r * n, n), o)->Wait();
    v.Expect(BitEqual(aliased.narrow(0, r * n, n), ReferenceReduceScatter(inputs, r, scale)),
             "reduce_scatter into its own input block " + dn);
    at::Tensor straddling = inputs[r].clone();  // output overlaps two blocks of the input
    const at::Tensor view = straddling.narrow(0, n / 2, n);
    c.ReduceScatter(straddling, view, o)->Wait();
    v.Expect(BitEqual(view, ReferenceReduceScatter(inputs, r, scale)),
             "reduce_scatter into a view straddling input blocks " + dn);
  }
}

// All-reduce, each reduction. At W=2 only (the reference's summation order is
// Gloo's there; a ring over more ranks adds in another order).
void CheckAllReduce(GlooCommunicator& c, at::ScalarType dt, int64_t n, Verdicts& v) {
  using shardtrain::comm::ReduceOp;
  const int w = c.size(), r = c.rank();
  if (w != 2) return;
  std::vector<at::Tensor> inputs;
  for (int q = 0; q < w; ++q) inputs.push_back(RandomInput(n, dt, 3000 + q));
  for (int variant = 0; variant < 3; ++variant) {
    const auto o = CheckedReduction(variant);
    at::Tensor t = inputs[r].clone();
    c.AllReduce(t, o)->Wait();
    const double post = o.post_divide * (o.op == ReduceOp::kAvg ? w : 1);
    v.ExpectBitEqual(t, ReferenceAllReduce(inputs, o.pre_divide, post),
                     "all_reduce#" + std::to_string(variant) + " " + c10::toString(dt) + " n=" + std::to_string(n));
  }
}

}  // namespace

bool SelfCheck(GlooCommunicator& c) {
  Verdicts v;
  v.rank = c.rank();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    for (int64_t n : {int64_t{1}, int64_t{100003}, (int64_t{3} << 20) + 12345}) {  // the last: several RS pieces
      CheckAllGather(c, dt, n, v);
      CheckReduceScatter(c, dt, n, v);
      CheckAllReduce(c, dt, n, v);
    }
  }
  return v.ok;
}

}  // namespace shardtrain::bench
