// Fixture for consolidate_test.sh.
//   ckpt_fixture make SHARDED_DIR FULL_FILE
//     trains the fixtures' classifier for 6 steps with fsdp_native
//     (state_dict_type=sharded, precision 16-mixed, so the checkpoints hold a
//     GradScaler state) on 2 threads-as-ranks, then saves the same
//     state twice: as a sharded checkpoint directory and as a full checkpoint.
//   ckpt_fixture compare A B
//     exits 0 when the two full checkpoints hold the same model, optimizer
//     state by name, loop state, RNG state, hyperparameters and GradScaler state.
#include <iostream>
#include <string>

#include "tests/trainer/fixtures.h"
#include "trainer/checkpoint_io/checkpoint.h"

namespace {
using namespace shardtrain::trainer;

int Make(const std::string& sharded, const std::string& full) {
  auto train = fixtures::MakeData(64, 1);
  TrainerOptions o = fixtures::BaseOptions(fixtures::TmpDir("ckpt_fixture_run"), 2);
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", "sharded"}};
  o.max_steps = 6;
  o.precision = "16-mixed";
  o.enable_checkpointing = false;
  shardtrain::testing::RunRanks(2, [&](int, const auto& comm) {
    fixtures::Classifier module;
    Trainer trainer(o, comm);
    trainer.Fit(module, *train);
    trainer.SaveCheckpoint(sharded);  // the strategy prefers sharded
    trainer.SaveCheckpoint(full, CheckpointFormat::kFull);
  });
  std::cout << "wrote " << sharded << " and " << full << std::endl;
  return 0;
}

int Compare(const std::string& a_path, const std::string& b_path) {
  CheckpointData a = LoadCheckpoint(a_path), b = LoadCheckpoint(b_path);
  int bad = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::cerr << "differs: " << what << std::endl;
      ++bad;
    }
  };
  check(a.state_dict.size() == b.state_dict.size(), "number of state dict entries");
  for (const auto& [k, v] : a.state_dict) {
    check(b.state_dict.count(k) && b.state_dict.at(k).equal(v), "state_dict['" + k + "']");
  }
  check(a.optimizer_full.kind == b.optimizer_full.kind, "optimizer kind");
  check(a.optimizer_full.step == b.optimizer_full.step, "optimizer steps");
  check(a.optimizer_full.state.size() == b.optimizer_full.state.size(), "optimizer state entries");
  for (const auto& [name, keys] : a.optimizer_full.state) {
    for (const auto& [k, t] : keys) {
      check(b.optimizer_full.state.count(name) && b.optimizer_full.state.at(name).count(k) &&
                b.optimizer_full.state.at(name).at(k).equal(t),
            "optimizer state '" + k + "' of '" + name + "'");
    }
  }
  check(a.epoch == b.epoch && a.global_step == b.global_step && a.batch_in_epoch == b.batch_in_epoch,
        "loop state");
  check(a.world_size == b.world_size && a.strategy == b.strategy, "world size / strategy");
  check(a.rng_state.equal(b.rng_state), "rng state");
  check(a.hparams == b.hparams, "hparams");
  check(a.grad_scaler.has_value() && b.grad_scaler.has_value() && a.grad_scaler->scale == b.grad_scaler->scale &&
            a.grad_scaler->growth_tracker == b.grad_scaler->growth_tracker &&
            a.grad_scaler->growth_interval == b.grad_scaler->growth_interval,
        "grad scaler state");
  check(!a.optimizer_full.empty() && a.global_step == 6, "expected Adam state after 6 steps");
  std::cout << (bad ? "DIFFERENT" : "SAME") << ": " << a_path << " vs " << b_path << " (" << a.state_dict.size()
            << " tensors, " << a.optimizer_full.state.size() << " optimizer entries)" << std::endl;
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (argc == 4 && mode == "make") return Make(argv[2], argv[3]);
  if (argc == 4 && mode == "compare") return Compare(argv[2], argv[3]);
  std::cerr << "usage: ckpt_fixture make SHARDED_DIR FULL_FILE | compare A B" << std::endl;
  return 2;
}
