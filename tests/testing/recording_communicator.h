// RecordingCommunicator: a Communicator that hands every call to another one
// (e.g. a GlooCommunicator) and logs the collectives in the order this rank
// issued them, with their sizes and dtypes, so tests can assert what the
// sharding core sends and when (prefetch order, reduce dtypes). Tests can add
// their own marks (Mark) from hooks to place collectives relative to compute.
#ifndef SHARDTRAIN_TESTS_TESTING_RECORDING_COMMUNICATOR_H_
#define SHARDTRAIN_TESTS_TESTING_RECORDING_COMMUNICATOR_H_

#include <c10/core/ScalarType.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace shardtrain::testing {

// One logged call. For all-gather `numel` is the gathered (full) buffer's, for
// reduce-scatter the full input's, otherwise the tensor's; 0 for marks.
struct CommEvent {
  enum class Kind { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier, kMark };
  Kind kind;
  int64_t numel = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::string label;  // marks only
};
const char* CommEventKindName(CommEvent::Kind kind);
// "AG(1024 Float)", "RS(...)", "mark:label": for failure messages.
std::string ToString(const CommEvent& e);
std::string ToString(const std::vector<CommEvent>& events);

class RecordingCommunicator : public comm::Communicator {
 public:
  explicit RecordingCommunicator(comm::CommunicatorPtr inner);

  std::string backend() const override { return inner_->backend(); }
  comm::WorkPtr AllGather(const at::Tensor& input, const at::Tensor& output) override;
  comm::WorkPtr ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                              const comm::ReduceOptions& options) override;
  comm::WorkPtr AllReduce(const at::Tensor& tensor, const comm::ReduceOptions& options) override;
  comm::WorkPtr Broadcast(const at::Tensor& tensor, int root) override;
  comm::WorkPtr Barrier() override;
  // Sub-groups are recorded into this communicator's log too.
  comm::CommunicatorPtr NewGroup(const std::vector<int>& ranks, const std::string& name) override;

  // The Work of the latest all-gather issued through this communicator or
  // its sub-groups (null before the first), e.g. to poll it mid-forward.
  comm::WorkPtr last_all_gather() const;
  // The same for reduce-scatters.
  comm::WorkPtr last_reduce_scatter() const;
  // Appends a mark to the log.
  void Mark(std::string label);
  std::vector<CommEvent> events() const;
  void ClearEvents();

 private:
  struct Log {
    std::mutex mu;
    std::vector<CommEvent> events;
    comm::WorkPtr last_all_gather;
    comm::WorkPtr last_reduce_scatter;
  };
  RecordingCommunicator(comm::CommunicatorPtr inner, std::shared_ptr<Log> log);
  void Record(CommEvent e);
  // Runs `call` on the inner communicator and counts the bytes it sent in this one's stats.
  template <typename Call>
  comm::WorkPtr Forward(comm::CommOp op, Call&& call);

  comm::CommunicatorPtr inner_;
  std::shared_ptr<Log> log_;
};

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_RECORDING_COMMUNICATOR_H_
