// Internal to //trainer/checkpoint_io:checkpoint: the parts of the full
// checkpoint's Lightning layout (trainer/checkpoint_io/checkpoint.h) as
// IValues, both ways, and the reader of the earlier releases' layout.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_INTERNAL_LAYOUT_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_INTERNAL_LAYOUT_H_

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <optional>
#include <string>

#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/state_value.h"

namespace shardtrain::trainer::internal {

// Turns a tensor into what the root object holds (an ArchiveWriter's
// placeholder; the tensor itself for PickleSavePlain).
using TensorAdder = std::function<at::Tensor(const at::Tensor&)>;

// d[key]; throws c10::Error "no 'key' entry" (LoadCheckpoint names the file).
c10::IValue At(const c10::impl::GenericDict& d, const char* key);

c10::IValue ToIValue(const StateValue& v, const TensorAdder& add);
// None for values StateValue has no form for (nested containers, ...).
std::optional<StateValue> FromIValue(const c10::IValue& v);
c10::impl::GenericDict DictToIValue(const StateDict& d, const TensorAdder& add);
// Skips the entries FromIValue has no form for.
StateDict DictFromIValue(const c10::IValue& v);

// "optimizer_states": [] without a kind; else one torch.optim state_dict().
// `state` may hold placeholders already added (`state_added`).
c10::IValue OptimizerStatesToIValue(const FullOptimizerState& state, bool state_added,
                                    const std::vector<OptimizerGroup>& groups, const TensorAdder& add);
// Fills out.optimizer_groups and, where the groups name their parameters,
// out.optimizer_full (else out.optimizer_indexed). Throws c10::Error on a
// layout it does not know.
void OptimizerStatesFromIValue(const c10::IValue& v, CheckpointData& out);

// "loops": Lightning's progress counters for the position (epoch,
// batch_in_epoch, global_step); and the position back from them.
c10::IValue LoopsToIValue(const CheckpointData& data);
void PositionFromLoops(const c10::IValue& loops, CheckpointData& out);

// A file of an earlier release (keys "hparams", "optimizer_full", ...).
void ReadLegacyLayout(const c10::impl::GenericDict& d, CheckpointData& out);

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_INTERNAL_LAYOUT_H_
