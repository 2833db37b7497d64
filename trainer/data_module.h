// DataModule: Lightning's LightningDataModule. It keeps a run's data in one
// place: how to fetch or write it once (prepare_data), how every rank builds
// its data sets for a stage (setup), and the data set of each stage.
//
//   class MnistData : public DataModule {
//     void prepare_data() override { DownloadTo(dir_); }     // local rank 0 only
//     void setup(Stage stage) override {
//       if (stage == Stage::kFit) { train_ = Load(dir_, "train"); val_ = Load(dir_, "val"); }
//       if (stage == Stage::kTest) test_ = Load(dir_, "test");
//     }
//     const Dataset* train_dataset() override { return train_.get(); }
//     const Dataset* val_dataset() override { return val_.get(); }
//     const Dataset* test_dataset() override { return test_.get(); }
//   };
//   trainer.Fit(module, data);        // prepare_data, setup(kFit), train + val, teardown(kFit)
//   trainer.Validate(module, data);   // prepare_data, setup(kValidate), val, teardown(kValidate)
//
// The Trainer makes the loaders (trainer/data/data_loader.h: its batch_size,
// shuffle, drop_last, num_workers, prefetch_factor and the
// DistributedSampler), so a DataModule gives data sets, not loaders.
#ifndef SHARDTRAIN_TRAINER_DATA_MODULE_H_
#define SHARDTRAIN_TRAINER_DATA_MODULE_H_

#include <string>

#include "trainer/data/data.h"

namespace shardtrain::trainer {

// What the Trainer is about to run (Lightning's stage strings).
enum class Stage { kFit, kValidate, kTest, kPredict };
// "fit", "validate", "test", "predict".
const char* StageName(Stage stage);

class DataModule {
 public:
  virtual ~DataModule() = default;

  // Downloads, unpacks or writes files that setup() reads. Called once per
  // node, on its local rank 0 (or only on global rank 0 when
  // prepare_data_per_node is false), before setup(); the other ranks wait
  // for it. State set here is not seen by the other ranks: set it in setup().
  // An exception here fails the call on every rank.
  virtual void prepare_data() {}
  // Builds this rank's data sets for `stage`; called on every rank.
  virtual void setup(Stage stage) {}
  // After the stage's run (also when it threw), on every rank.
  virtual void teardown(Stage stage) {}

  // The data sets, valid after setup(stage); null: none. Fit needs
  // train_dataset() (val_dataset() optional), Validate val_dataset(),
  // Test test_dataset(), Predict predict_dataset(). The DataModule owns them.
  virtual const Dataset* train_dataset() { return nullptr; }
  virtual const Dataset* val_dataset() { return nullptr; }
  virtual const Dataset* test_dataset() { return nullptr; }
  virtual const Dataset* predict_dataset() { return nullptr; }

  // Lightning's prepare_data_per_node.
  bool prepare_data_per_node = true;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_DATA_MODULE_H_
