// Fixture for tensorboard_test.sh: writes an event file with TensorBoardLogger
// into DIR (Lightning layout: DIR/lightning_logs/version_0/events.out.tfevents.*)
// and prints what it logged as "step<TAB>tag<TAB>value" lines (value as the
// float32 TensorBoard stores, to 9 significant digits).
#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include "trainer/loggers/tensorboard_logger.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: tensorboard_writer DIR" << std::endl;
    return 2;
  }
  using shardtrain::trainer::TensorBoardLogger;
  TensorBoardLogger logger(argv[1]);
  logger.LogHyperparams({{"lr", "0.001"}, {"model", "mlp"}});
  struct Row {
    int64_t step;
    std::map<std::string, double> metrics;
  };
  const Row rows[] = {
      {1, {{"train_loss", 1.25}, {"lr-Adam", 1e-3}}},
      {2, {{"train_loss", 0.875}, {"epoch", 0}}},
      {3, {{"val/loss", -0.1}, {"a much longer tag name with spaces and ünïcödé", 3.0e38}}},
      {1099511627776, {{"train_loss", 1.0 / 3.0}}},  // a step beyond 32 bits
  };
  for (const auto& r : rows) {
    logger.LogMetrics(r.metrics, r.step);
    for (const auto& [k, v] : r.metrics) std::printf("%lld\t%s\t%.9g\n", static_cast<long long>(r.step), k.c_str(),
                                                     static_cast<double>(static_cast<float>(v)));
  }
  logger.AddScalar("single", 42.5, 7);
  std::printf("7\tsingle\t42.5\n");
  logger.Save();
  std::fprintf(stderr, "event file: %s\n", logger.event_file().c_str());
  return 0;
}
