// Internal to //trainer: the data connector — a DataModule's stages
// (prepare_data on the right ranks, setup, teardown, the stage's data set)
// and the data loader options of TrainerOptions.
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_DATA_CONNECTOR_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_DATA_CONNECTOR_H_

#include <functional>

#include "trainer/data/data_loader.h"
#include "trainer/data_module.h"

namespace shardtrain::trainer {

class Trainer;

namespace internal {

class DataConnector {
 public:
  explicit DataConnector(Trainer& trainer) : t_(trainer) {}
  DataConnector(const DataConnector&) = delete;
  DataConnector& operator=(const DataConnector&) = delete;

  // The loader options of TrainerOptions (num_workers, prefetch_factor).
  DataLoaderOptions LoaderOptions() const;
  // prepare_data (see Trainer::Fit(module, datamodule)), setup(stage), `run`,
  // then teardown(stage) (also when `run` throws).
  void RunStage(DataModule& datamodule, Stage stage, const std::function<void()>& run);
  // The stage's required data set after setup (Fit: train_dataset(), Validate:
  // val_dataset(), ...); InvalidArgumentError naming the accessor when null.
  const Dataset& StageDataset(DataModule& datamodule, Stage stage);

 private:
  Trainer& t_;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_DATA_CONNECTOR_H_
