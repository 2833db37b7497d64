// The example GPT (its tensor-parallel plan) as a TrainingModule for the
// model_parallel tests that go through the Trainer: model_parallel_trainer_test
// and lightning_fixture's save_tp / resume_tp (PyTorch TP + FSDP2 on the same
// DCP checkpoints, dcp_interop_test.sh; tests/python/torch_gpt.py is the same
// model in Python).
#ifndef SHARDTRAIN_TESTS_TRAINER_GPT_MODULE_H_
#define SHARDTRAIN_TESTS_TRAINER_GPT_MODULE_H_

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <barrier>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "examples/gpt/gpt_model.h"
#include "trainer/data/data.h"
#include "trainer/training_module.h"

namespace shardtrain::trainer::testing {

// vocab 64, context 16, 2 layers, 4 heads, width 32 (torch_gpt.GPT(64, 16, 2, 4, 32)).
inline examples::GptConfig SmallGptConfig() {
  examples::GptConfig c;
  c.vocab_size = 64;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  return c;
}

// 16 random sequences of 16 tokens and their targets (the same on every call).
inline TensorDataset SmallGptData() {
  auto g = at::detail::createCPUGenerator(9);
  at::Tensor inputs = at::randint(64, {16, 16}, g);
  return TensorDataset(inputs, at::randint(64, {16, 16}, g));
}

// AdamW (lr 1e-2, eps 1e-5) on the GPT's vocabulary-parallel loss; `freeze`
// freezes a column-wise weight (tensor-parallel pieces) and the final norm
// (replicated).
class GptModule : public TrainingModule {
 public:
  // `seeded`: a barrier of the world's size (threads-as-ranks share the generator).
  GptModule(bool freeze, std::barrier<>* seeded) : freeze_(freeze), seeded_(seeded) {}
  std::shared_ptr<torch::nn::Module> configure_model() override {
    // Every rank has seeded the generator (Trainer::Fit) before any builds, and they build one at a time from
    // the same seed, so each cuts its pieces from the same global weights.
    seeded_->arrive_and_wait();
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    at::manual_seed(5);
    model_ = std::make_shared<examples::GptImpl>(SmallGptConfig());
    if (freeze_) {
      for (auto& p : model_->named_parameters()) {
        if (Frozen(p.key())) p.value().set_requires_grad(false);
      }
    }
    return model_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    return model_->LossOf(forward([&] { return model_->forward(b.inputs); }), b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    // eps 1e-5: the key bias's gradient is rounding noise (tests/tensor_parallel/model_parallel_test.cc says why).
    return {std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).eps(1e-5))};
  }
  // The parameters `freeze` freezes.
  static bool Frozen(const std::string& name) {
    return name == "h.0.attn.c_attn.weight" || name.rfind("ln_f.", 0) == 0;
  }
  std::shared_ptr<examples::GptImpl> model_;

 private:
  bool freeze_;
  std::barrier<>* seeded_;
};

}  // namespace shardtrain::trainer::testing

#endif  // SHARDTRAIN_TESTS_TRAINER_GPT_MODULE_H_
