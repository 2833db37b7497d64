// The data connector (trainer/connectors/internal/data_connector.h):
// StageName, and the Trainer's DataModule overloads (Fit, Validate, Test,
// Predict) with the steps they share: prepare_data on the right ranks, setup,
// teardown.
#include "trainer/connectors/internal/data_connector.h"

#include <exception>
#include <string>

#include "base/errors.h"
#include "base/logging.h"
#include "trainer/connectors/internal/process_connector.h"
#include "trainer/data_module.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

const char* StageName(Stage stage) {
  switch (stage) {
    case Stage::kFit:
      return "fit";
    case Stage::kValidate:
      return "validate";
    case Stage::kTest:
      return "test";
    case Stage::kPredict:
      return "predict";
  }
  return "unknown";
}

void Trainer::Fit(TrainingModule& module, DataModule& datamodule, const std::string& ckpt_path) {
  data_connector_->RunStage(datamodule, Stage::kFit, [&] {
    const Dataset& train = data_connector_->StageDataset(datamodule, Stage::kFit);
    Fit(module, train, datamodule.val_dataset(), ckpt_path);
  });
}

double Trainer::Validate(TrainingModule& module, DataModule& datamodule) {
  double mean = 0;
  data_connector_->RunStage(datamodule, Stage::kValidate, [&] {
    mean = Validate(module, data_connector_->StageDataset(datamodule, Stage::kValidate));
  });
  return mean;
}

std::map<std::string, double> Trainer::Test(TrainingModule& module, DataModule& datamodule) {
  std::map<std::string, double> metrics;
  data_connector_->RunStage(datamodule, Stage::kTest,
                            [&] { metrics = Test(module, data_connector_->StageDataset(datamodule, Stage::kTest)); });
  return metrics;
}

at::Tensor Trainer::Predict(TrainingModule& module, DataModule& datamodule, const PredictOptions& options) {
  at::Tensor out;
  data_connector_->RunStage(datamodule, Stage::kPredict, [&] {
    out = Predict(module, data_connector_->StageDataset(datamodule, Stage::kPredict), options);
  });
  return out;
}

DataLoaderOptions internal::DataConnector::LoaderOptions() const {
  DataLoaderOptions lo;
  lo.num_workers = t_.options_.num_workers;
  lo.prefetch_factor = t_.options_.prefetch_factor;
  lo.pin_memory = t_.device_.is_cuda();  // ToDevice's copies are then asynchronous
  return lo;
}

void internal::DataConnector::RunStage(DataModule& datamodule, Stage stage, const std::function<void()>& run) {
  t_.process_connector_->SetupProcesses();
  const bool mine = datamodule.prepare_data_per_node ? t_.process_connector_->LocalRank() == 0 : t_.rank() == 0;
  std::exception_ptr error;
  std::string what;
  if (mine) {
    try {
      datamodule.prepare_data();
    } catch (const std::exception& e) {
      error = std::current_exception();
      what = e.what();
    } catch (...) {
      error = std::current_exception();
      what = "an exception not derived from std::exception";
    }
  }
  // The barrier: every rank waits here until prepare_data is done everywhere.
  const double failed = t_.process_connector_->AllReduceSum({error ? 1.0 : 0.0})[0];
  if (error) {
    ST_LOG(ERROR) << "DataModule::prepare_data failed: " << what;
    std::rethrow_exception(error);
  }
  if (failed > 0)
    ST_THROW(Error, "DataModule::prepare_data failed on ", failed, " other rank(s) (see their errors)");
  datamodule.setup(stage);
  try {
    run();
  } catch (...) {
    try {
      datamodule.teardown(stage);
    } catch (const std::exception& e) {
      ST_LOG(ERROR) << "DataModule::teardown(" << StageName(stage) << ") after a failed run threw too: " << e.what();
    }
    throw;
  }
  datamodule.teardown(stage);
}

const Dataset& internal::DataConnector::StageDataset(DataModule& datamodule, Stage stage) {
  const Dataset* data = nullptr;
  const char* accessor = "";
  switch (stage) {
    case Stage::kFit:
      data = datamodule.train_dataset();
      accessor = "train_dataset()";
      break;
    case Stage::kValidate:
      data = datamodule.val_dataset();
      accessor = "val_dataset()";
      break;
    case Stage::kTest:
      data = datamodule.test_dataset();
      accessor = "test_dataset()";
      break;
    case Stage::kPredict:
      data = datamodule.predict_dataset();
      accessor = "predict_dataset()";
      break;
  }
  ST_CHECK_ARG(data != nullptr, "the DataModule's ", accessor, " returned null after setup(", StageName(stage),
               "): the ", StageName(stage), " stage needs it; override ", accessor,
               " to return the data set that setup built");
  return *data;
}

}  // namespace shardtrain::trainer
