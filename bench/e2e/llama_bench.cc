// End-to-end Llama benchmark, ShardTrain side: examples/llama's model built
// shard by shard, loaded from a Hugging Face directory (each rank streams its
// shards' byte ranges), then trained with AdamW through a strategy on the
// batches torch_llama_bench.py wrote. Rank 0 prints one JSON line: load time
// and the peak RSS per rank through the load, median step time, tokens/s, the
// steps' peak RSS per rank, final loss. bench/e2e/llama_run.sh runs it beside
// PyTorch FSDP2 on the transformers model (torch_llama_bench.py).
//
//   llama_bench --hf_dir=D --batches=F --devices=2 --steps=5 --warmup=1
//   llama_bench --hf_dir=D --devices=4 --steps=0      load only
#include <ATen/ATen.h>
#include <gflags/gflags.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "base/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "examples/common/example_util.h"
#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/hf_strategy_io.h"
#include "examples/llama/llama_model.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"
#include "launch/launcher.h"
#include "strategies/registry.h"
#include "tests/testing/proc_status.h"
#include "trainer/checkpoint_io/safetensors.h"

DEFINE_string(hf_dir, "", "the Hugging Face model directory (torch_llama_bench.py make)");
DEFINE_string(batches, "",
              "safetensors file with \"batches\" [steps, global batch, T + 1] (torch_llama_bench.py make)");
DEFINE_int32(devices, 2, "ranks on this machine");
DEFINE_string(strategy, "fsdp_native", "strategy registry name");
DEFINE_string(strategy_options, "", "comma-separated key=value strategy options");
DEFINE_string(label, "", "name of this configuration in the output");
DEFINE_int32(steps, 5, "timed steps after warmup (0: load only)");
DEFINE_int32(warmup, 1, "untimed steps first");
DEFINE_double(lr, 1e-4, "AdamW learning rate");

namespace {
using namespace shardtrain;
using examples::llama::LlamaForCausalLMImpl;

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The maximum over ranks of `v`.
double MaxOverRanks(comm::GlooCommunicator& world, double v) {
  at::Tensor t = at::tensor({v}, at::kDouble);
  world.AllReduce(t, {comm::ReduceOp::kMax})->Wait();
  return t.item<double>();
}

struct Steps {
  double median_s = 0, last_loss = 0;
  int64_t tokens = 0;  // per step, over all ranks
};

// --warmup untimed then --steps timed AdamW steps; each rank its rows.
Steps Train(strategies::Strategy& strategy, LlamaForCausalLMImpl& model, comm::GlooCommunicator& world) {
  const at::Tensor batches = trainer::SafetensorsFile(FLAGS_batches).Tensor("batches").clone();
  ST_CHECK_ARG(batches.size(0) >= FLAGS_warmup + FLAGS_steps, FLAGS_batches, " holds ", batches.size(0),
               " batches; --warmup + --steps need ", FLAGS_warmup + FLAGS_steps);
  ST_CHECK_ARG(batches.size(1) % world.size() == 0, "the global batch ", batches.size(1), " does not split over ",
               world.size(), " ranks");
  const int64_t per = batches.size(1) / world.size();
  torch::optim::AdamW opt(strategy.parameters(), torch::optim::AdamWOptions(FLAGS_lr).weight_decay(0.0));
  std::vector<double> times;
  Steps out;
  for (int s = 0; s < FLAGS_warmup + FLAGS_steps; ++s) {
    const at::Tensor rows = batches[s].slice(0, world.rank() * per, (world.rank() + 1) * per);
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    const at::Tensor loss = strategy.Forward(
        [&] { return LlamaForCausalLMImpl::Loss(model.forward(rows.slice(1, 0, -1)), rows.slice(1, 1)); });
    strategy.Backward(loss);
    opt.step();
    if (s >= FLAGS_warmup) times.push_back(Since(t0));
    at::Tensor l = loss.detach().reshape({1}).to(at::kDouble).clone();
    world.AllReduce(l, {comm::ReduceOp::kAvg})->Wait();
    out.last_loss = l.item<double>();
  }
  std::sort(times.begin(), times.end());
  out.median_s = times[times.size() / 2];
  out.tokens = batches.size(1) * (batches.size(2) - 1);
  return out;
}

int Bench() {
  if (!std::getenv("RANK") && FLAGS_devices > 1) {
    LaunchOptions lo;
    lo.num_ranks = FLAGS_devices;
    LaunchLocalRanks(lo);
  }
  if (const char* t = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::max(1, std::atoi(t)));
  const ClusterInfo info = DetectClusterEnvironment();
  comm::GlooOptions go;
  go.hostname = "127.0.0.1";
  const auto world = info.world_size == 1
                         ? comm::GlooCommunicator::Create(comm::CreateHashStore(), 0, 1)
                         : comm::GlooCommunicator::Create(comm::CreateStore(RendezvousOptionsFor(info)), info.rank,
                                                          info.world_size, go);
  testing::ResetPeakRss();
  const auto t_load = std::chrono::steady_clock::now();
  const examples::llama::HfModelDir hf(FLAGS_hf_dir);
  auto strategy = strategies::StrategyRegistry::Create(
      FLAGS_strategy, examples::ParseKeyValueList(FLAGS_strategy_options, "--strategy_options"));
  strategy->Setup(world, info);
  std::shared_ptr<LlamaForCausalLMImpl> model;
  {
    auto scope = strategy->MakeConstructionScope();  // each wrap point keeps only this rank's shard
    examples::llama::ZeroInitScope zero_init;        // no random weights: the load replaces them (as from_pretrained)
    model = std::make_shared<LlamaForCausalLMImpl>(hf.config);
  }
  const double built_s = Since(t_load);
  strategy->WrapModel(model);
  const double wrapped_s = Since(t_load);
  examples::llama::LoadHfWeightsInto(*strategy, hf.config, hf.weights);
  world->Barrier()->Wait();
  const double load_s = Since(t_load);
  if (info.rank == 0) {
    std::fprintf(stderr,
                 "[llama_bench] load: model built %.2f s, wrapped %.2f s, weights read %.2f s (peak RSS %.0f MiB)\n",
                 built_s, wrapped_s - built_s, load_s - wrapped_s, testing::ProcStatusKb("VmHWM") / 1024.0);
  }
  const double load_peak = MaxOverRanks(*world, testing::ProcStatusKb("VmHWM") / 1024.0);
  Steps steps;
  double step_peak = 0;
  if (FLAGS_steps > 0) {
    testing::ResetPeakRss();
    steps = Train(*strategy, *model, *world);
    step_peak = MaxOverRanks(*world, testing::ProcStatusKb("VmHWM") / 1024.0);
  }
  if (info.rank == 0) {
    std::printf(
        "{\"impl\": \"%s\", \"world\": %d, \"params\": %lld, \"load_s\": %.2f, \"load_peak_rss_mib\": %.1f, "
        "\"median_step_s\": %.4f, \"tokens_per_s\": %.1f, \"step_peak_rss_mib\": %.1f, \"final_loss\": %.6f}\n",
        (FLAGS_label.empty() ? FLAGS_strategy : FLAGS_label).c_str(), info.world_size,
        static_cast<long long>(hf.config.NumParameters()), load_s, load_peak, steps.median_s,
        steps.median_s > 0 ? steps.tokens / steps.median_s : 0.0, step_peak, steps.last_loss);
    std::fflush(stdout);
  }
  world->Barrier()->Wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  int code = 1;
  try {
    ST_CHECK_ARG(!FLAGS_hf_dir.empty(), "--hf_dir is required (torch_llama_bench.py make writes one)");
    ST_CHECK_ARG(FLAGS_steps == 0 || !FLAGS_batches.empty(), "--batches is required when --steps > 0");
    code = Bench();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_bench: %s\n", e.what());
  }
  if (!std::getenv("SHARDTRAIN_LAUNCHED")) code = shardtrain::JoinLocalRanks(code);
  return code;
}
