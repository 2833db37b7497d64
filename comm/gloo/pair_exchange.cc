// W=2 direct exchanges of GlooCommunicator (see internal/pair_exchange.h).
#include "comm/gloo/internal/pair_exchange.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "comm/gloo/internal/common.h"

namespace shardtrain::comm::gloo_internal {
namespace {

// Sends `send` (n elements) to the other rank of a 2-rank group and receives
// its n elements into `recv`.
c10::intrusive_ptr<c10d::Work> ExchangeWithPeer(c10d::Backend& pg, int rank, const at::Tensor& send,
                                                const at::Tensor& recv, std::chrono::milliseconds timeout) {
  const int64_t n = send.numel();
  // Separate vectors: c10d may move from its split-size arguments.
  std::vector<int64_t> send_splits = rank == 0 ? std::vector<int64_t>{0, n} : std::vector<int64_t>{n, 0};
  std::vector<int64_t> recv_splits = send_splits;
  at::Tensor in = send, out = recv;
  c10d::AllToAllOptions o;
  o.timeout = timeout;
  return pg.alltoall_base(out, in, recv_splits, send_splits, o);
}

// An exchange in pieces: wait() runs the local step of piece k on the calling
// thread while Gloo's worker threads still move pieces k+1, ...
class PipelinedWork : public c10d::Work {
 public:
  PipelinedWork(std::vector<c10::intrusive_ptr<c10d::Work>> pieces, std::function<void(size_t)> on_piece)
      : pieces_(std::move(pieces)), on_piece_(std::move(on_piece)) {}
  bool isCompleted() override {
    return std::all_of(pieces_.begin(), pieces_.end(), [](const auto& w) { return w->isCompleted(); });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (; next_ < pieces_.size(); ++next_) {
      if (timeout == ::kNoTimeout) {
        pieces_[next_]->wait(timeout);
      } else {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pieces_[next_]->wait(std::max(left, std::chrono::milliseconds(1)));
      }
      on_piece_(next_);
    }
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> pieces_;
  std::function<void(size_t)> on_piece_;
  size_t next_ = 0;
};

// W=2: sends `send` to the peer and receives the peer's send.numel() elements
// into `recv` (which must not overlap `send`), in pieces of 4 MiB, each its own
// alltoall_base. The returned work's wait() calls on_piece(begin, count) on the
// waiting thread for each piece, in order, once it has arrived (and left),
// while later pieces are still moving.
c10::intrusive_ptr<c10d::Work> PipelinedExchange(c10d::Backend& pg, int rank, const at::Tensor& send,
                                                 const at::Tensor& recv, std::chrono::milliseconds timeout,
                                                 std::function<void(int64_t, int64_t)> on_piece) {
  constexpr int64_t kPieceBytes = int64_t{4} << 20;
  const int64_t n = send.numel();
  const int64_t piece = std::max<int64_t>(1, kPieceBytes / send.element_size());
  std::vector<c10::intrusive_ptr<c10d::Work>> pieces;
  for (int64_t i = 0; i < n; i += piece) {
    const int64_t len = std::min(piece, n - i);
    pieces.push_back(ExchangeWithPeer(pg, rank, send.narrow(0, i, len), recv.narrow(0, i, len), timeout));
  }
  return c10::make_intrusive<PipelinedWork>(std::move(pieces), [on_piece = std::move(on_piece), piece, n](size_t k) {
    const int64_t begin = static_cast<int64_t>(k) * piece;
    on_piece(begin, std::min(piece, n - begin));
  });
}

}  // namespace

c10::intrusive_ptr<c10d::Work> PairAllGather(c10d::Backend& pg, int rank, const at::Tensor& input,
                                             const at::Tensor& output, std::chrono::milliseconds timeout) {
  at::Tensor in = input.reshape(-1);
  const at::Tensor out = output.reshape(-1);
  const int64_t n = in.numel();
  const at::Tensor mine = out.narrow(0, rank * n, n), theirs = out.narrow(0, (1 - rank) * n, n);
  // In place (`input` is this rank's block of `output`) needs no copy; any
  // other overlap sends from a copy.
  const bool in_place = in.data_ptr() == mine.data_ptr();
  if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
  auto work = ExchangeWithPeer(pg, rank, in, theirs, timeout);
  if (!in_place) std::memcpy(mine.data_ptr(), in.data_ptr(), n * in.element_size());  // overlaps the exchange
  return work;
}

c10::intrusive_ptr<c10d::Work> PairReduceScatter(c10d::Backend& pg, int rank, const at::Tensor& input,
                                                 const at::Tensor& output, double scale,
                                                 std::chrono::milliseconds timeout) {
  // Send the peer's block of `input`, receive the peer's contribution to ours
  // (straight into `output` unless it aliases `input`), then add ours. Same
  // arithmetic as the general path, bit for bit: the sum of the two blocks,
  // then the scale, in the dtype for float32/float64; in float32 with one
  // rounding at the end for 16-bit types; the trailing add of +0 turns -0 into
  // +0 and changes nothing else, as the general path's sum (which starts from
  // +0) does.
  const int64_t n = output.numel();
  at::Tensor in = input.reshape(-1);
  const at::Tensor out = output.reshape(-1);
  at::Tensor recv = out;
  if (at::get_overlap_status(in, out) != at::MemOverlapStatus::No) {
    if (out.data_ptr() == in.narrow(0, rank * n, n).data_ptr()) {
      recv = at::empty_like(out);  // in place: `output` is this rank's block of `input`
    } else {
      in = in.clone();
    }
  }
  const at::Tensor mine = in.narrow(0, rank * n, n), to_peer = in.narrow(0, (1 - rank) * n, n);
  const bool low = Is16Bit(out.scalar_type());
  // +0 as a 0-dim tensor: adding it is markedly faster than adding the Scalar 0.0.
  const at::Tensor zero = at::zeros({}, out.options().dtype(low && scale != 1.0 ? at::kFloat : out.scalar_type()));
  auto reduce = [out, recv, mine, scale, low, zero](int64_t begin, int64_t count) {
    Serially(count, [&](int64_t i, int64_t len) {
      at::Tensor o = out.narrow(0, begin + i, len), got = recv.narrow(0, begin + i, len);
      const at::Tensor m = mine.narrow(0, begin + i, len);
      if (!low || scale == 1.0) {
        at::add_out(o, got, m).add_(zero);
        if (scale != 1.0) o.mul_(scale);
      } else {
        at::Tensor acc = got.to(at::kFloat);
        acc.add_(m).add_(zero);
        acc.mul_(scale);
        o.copy_(acc);
      }
    });
  };
  return PipelinedExchange(pg, rank, to_peer, recv, timeout, std::move(reduce));
}

c10::intrusive_ptr<c10d::Work> PairAllReduce(c10d::Backend& pg, int rank, const at::Tensor& tensor, double post,
                                             std::chrono::milliseconds timeout) {
  // Each rank sends its whole tensor (= 2(W-1)/W of it, as counted) and
  // receives the peer's into a separate buffer (the tensor is still being sent
  // from), then wait() adds piece by piece into the tensor and divides by
  // `post`. Same arithmetic as Gloo's sum, bit for bit: one add per element, in
  // the dtype (for 16-bit types in float32, rounded once), then the same
  // div_(post); both ranks add rank 0's value to rank 1's, so even NaN
  // payloads agree across ranks.
  const at::Tensor t = tensor.reshape(-1);
  const at::Tensor recv = at::empty_like(t);
  const at::Tensor first = rank == 0 ? t : recv, second = rank == 0 ? recv : t;
  auto combine = [t, first, second, post](int64_t begin, int64_t count) {
    Serially(count, [&](int64_t i, int64_t len) {
      at::Tensor o = t.narrow(0, begin + i, len);
      at::add_out(o, first.narrow(0, begin + i, len), second.narrow(0, begin + i, len));
      if (post != 1.0) o.div_(post);
    });
  };
  return PipelinedExchange(pg, rank, t, recv, timeout, std::move(combine));
}

}  // namespace shardtrain::comm::gloo_internal
