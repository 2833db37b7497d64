#include "tests/testing/recording_communicator.h"

#include <sstream>
#include <utility>

namespace shardtrain::testing {

const char* CommEventKindName(CommEvent::Kind kind) {
  switch (kind) {
    case CommEvent::Kind::kAllGather: return "AG";
    case CommEvent::Kind::kReduceScatter: return "RS";
    case CommEvent::Kind::kAllReduce: return "AR";
    case CommEvent::Kind::kBroadcast: return "BC";
    case CommEvent::Kind::kBarrier: return "BARRIER";
    case CommEvent::Kind::kMark: return "mark";
  }
  return "?";
}

std::string ToString(const CommEvent& e) {
  std::ostringstream os;
  if (e.kind == CommEvent::Kind::kMark) {
    os << "mark:" << e.label;
  } else {
    os << CommEventKindName(e.kind) << "(" << e.numel << " " << c10::toString(e.dtype) << ")";
  }
  return os.str();
}

std::string ToString(const std::vector<CommEvent>& events) {
  std::string out;
  for (const auto& e : events) out += (out.empty() ? "" : " ") + ToString(e);
  return out;
}

RecordingCommunicator::RecordingCommunicator(comm::CommunicatorPtr inner)
    : RecordingCommunicator(std::move(inner), std::make_shared<Log>()) {}

RecordingCommunicator::RecordingCommunicator(comm::CommunicatorPtr inner, std::shared_ptr<Log> log)
    : Communicator(inner->rank(), inner->size(), inner->name(), inner->timeout()),
      inner_(std::move(inner)),
      log_(std::move(log)) {}

void RecordingCommunicator::Record(CommEvent e) {
  std::lock_guard<std::mutex> lock(log_->mu);
  log_->events.push_back(std::move(e));
}

template <typename Call>
comm::WorkPtr RecordingCommunicator::Forward(comm::CommOp op, Call&& call) {
  const int64_t before = inner_->stats().BytesSent(op);
  comm::WorkPtr w = call();
  Count(op, inner_->stats().BytesSent(op) - before);
  return w;
}

comm::WorkPtr RecordingCommunicator::AllGather(const at::Tensor& input, const at::Tensor& output) {
  Record({CommEvent::Kind::kAllGather, output.numel(), output.scalar_type(), ""});
  comm::WorkPtr w = Forward(comm::CommOp::kAllGather, [&] { return inner_->AllGather(input, output); });
  std::lock_guard<std::mutex> lock(log_->mu);
  log_->last_all_gather = w;
  return w;
}

comm::WorkPtr RecordingCommunicator::last_all_gather() const {
  std::lock_guard<std::mutex> lock(log_->mu);
  return log_->last_all_gather;
}

comm::WorkPtr RecordingCommunicator::ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                                                   const comm::ReduceOptions& options) {
  Record({CommEvent::Kind::kReduceScatter, input.numel(), input.scalar_type(), ""});
  comm::WorkPtr w =
      Forward(comm::CommOp::kReduceScatter, [&] { return inner_->ReduceScatter(input, output, options); });
  std::lock_guard<std::mutex> lock(log_->mu);
  log_->last_reduce_scatter = w;
  return w;
}

comm::WorkPtr RecordingCommunicator::last_reduce_scatter() const {
  std::lock_guard<std::mutex> lock(log_->mu);
  return log_->last_reduce_scatter;
}

comm::WorkPtr RecordingCommunicator::AllReduce(const at::Tensor& tensor, const comm::ReduceOptions& options) {
  Record({CommEvent::Kind::kAllReduce, tensor.numel(), tensor.scalar_type(), ""});
  return Forward(comm::CommOp::kAllReduce, [&] { return inner_->AllReduce(tensor, options); });
}

comm::WorkPtr RecordingCommunicator::Broadcast(const at::Tensor& tensor, int root) {
  Record({CommEvent::Kind::kBroadcast, tensor.numel(), tensor.scalar_type(), ""});
  return Forward(comm::CommOp::kBroadcast, [&] { return inner_->Broadcast(tensor, root); });
}

comm::WorkPtr RecordingCommunicator::Barrier() {
  Record({CommEvent::Kind::kBarrier, 0, c10::ScalarType::Undefined, ""});
  return Forward(comm::CommOp::kBarrier, [&] { return inner_->Barrier(); });
}

comm::CommunicatorPtr RecordingCommunicator::NewGroup(const std::vector<int>& ranks, const std::string& name) {
  auto group = inner_->NewGroup(ranks, name);
  if (!group) return nullptr;
  return std::shared_ptr<RecordingCommunicator>(new RecordingCommunicator(std::move(group), log_));
}

void RecordingCommunicator::Mark(std::string label) {
  Record({CommEvent::Kind::kMark, 0, c10::ScalarType::Undefined, std::move(label)});
}

std::vector<CommEvent> RecordingCommunicator::events() const {
  std::lock_guard<std::mutex> lock(log_->mu);
  return log_->events;
}

void RecordingCommunicator::ClearEvents() {
  std::lock_guard<std::mutex> lock(log_->mu);
  log_->events.clear();
}

}  // namespace shardtrain::testing
