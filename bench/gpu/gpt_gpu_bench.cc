// GPU benchmark: trains the examples/gpt model (by default 24 layers, d=1792,
// 16 heads, sequence 1024, vocab 50304: 1,017,386,496 parameters) on
// one NVIDIA GPU through sharding::ShardedModel — FULL_SHARD over a 1-rank
// NcclCommunicator (c10d HashStore), bf16 parameters and gradient reduction
// (float32 master shards and AdamW state), one unit per transformer block —
// and prints one JSON line: median step time, tokens/s, achieved TFLOP/s,
// model FLOPs utilisation, peak CUDA memory of the steps (caching allocator,
// reset after construction), final loss. --offload keeps the float32 shards,
// gradients and AdamW state on the host (offload_params); --plain trains the
// same model without ShardedModel (float32 parameters, bf16 autocast), the
// plain-LibTorch reference.
// bench/gpu/run.sh builds it with CMake and runs it next to Python PyTorch
// FSDP2 (bench/gpu/torch_fsdp_gpu.py) with the same sizes and batch.
//
//   gpt_gpu_bench [--batch=16] [--steps=10] [--warmup=3] [--checkpoint] ...
//   gpt_gpu_bench --help
//
// Model FLOPs per token: 6*N (N = all parameters; forward + backward of the
// matmuls, the tied head included) + 12*L*T*d (attention scores and values,
// forward + backward, as in the PaLM paper's MFU). Activation checkpointing's
// recompute is not counted (that is what makes it *model* FLOPs). MFU is that
// over --peak_tflops, by default 989 (H100/H200 SXM dense bf16 peak).
//
// --cpu_smoke runs the same loop on the CPU through a 1-rank in-process
// communicator instead of NCCL (a check of this program where there is no
// GPU; use a tiny model). Without it, no visible GPU is an error.
//
// Batches are random tokens (a throughput benchmark: the loss only shows that
// training runs; it starts near ln(vocab)). Exit status: 0 ok, 2 no CUDA
// device or bad flags, 3 CUDA out of memory (pass a smaller --batch or
// --checkpoint), 1 other errors; failures also print a JSON line with "error".
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/logging.h"
#include "comm/nccl_communicator.h"
#include "comm/rendezvous.h"
#include "examples/gpt/gpt_model.h"
#include "sharding/options.h"
#include "sharding/sharded_model.h"

namespace {
using namespace shardtrain;

struct Flags {
  int64_t n_layer = 24;
  int64_t n_embd = 1792;
  int64_t n_head = 16;
  int64_t block_size = 1024;
  int64_t vocab = 50304;
  int64_t batch = 16;  // sequences per step
  int64_t steps = 10;  // timed steps
  int64_t warmup = 3;  // untimed steps first
  double lr = 3e-4;
  double weight_decay = 0.0;
  bool checkpoint = false;  // activation checkpointing of every block
  bool cpu_smoke = false;   // CPU + in-process communicator (no GPU needed)
  bool offload = false;     // offload_params: float32 shards, gradients and AdamW on the host
  bool plain = false;       // no sharding: plain LibTorch with bf16 autocast (the reference)
  std::string strategy = "FULL_SHARD";
  sharding::ShardingStrategy sharding_strategy = sharding::ShardingStrategy::kFullShard;
  int64_t device = 0;
  double peak_tflops = 989.0;
  int64_t seed = 1234;
  std::string label = "shardtrain_fsdp_native";
};

const char* kUsage =
    "usage: gpt_gpu_bench [--flag=value | --flag value]...\n"
    "  --n_layer=24 --n_embd=1792 --n_head=16 --block_size=1024 --vocab=50304   model (~1.02B parameters)\n"
    "  --batch=16        sequences of block_size tokens per step (lower it on CUDA out of memory)\n"
    "  --steps=10 --warmup=3   timed steps after untimed warmup steps\n"
    "  --lr=3e-4 --weight_decay=0   AdamW\n"
    "  --checkpoint      activation checkpointing of every transformer block (--checkpoint=0 to turn off)\n"
    "  --strategy=FULL_SHARD   FULL_SHARD, SHARD_GRAD_OP or NO_SHARD\n"
    "  --device=0 --seed=1234 --label=shardtrain_fsdp_native\n"
    "  --peak_tflops=989  dense bf16 peak of the GPU for MFU (H100/H200 SXM: 989)\n"
    "  --offload         offload_params: float32 shards, gradients and AdamW state on the host\n"
    "  --plain           no ShardedModel: plain LibTorch, float32 parameters, bf16 autocast (the reference)\n"
    "  --cpu_smoke       run on the CPU with an in-process 1-rank communicator (no GPU, no NCCL; tiny models)\n";

// A bad command line: reported with the usage text, exit status 2.
struct FlagError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#define FLAG_CHECK(cond, ...)                                                    \
  do {                                                                           \
    if (!(cond)) throw FlagError(::shardtrain::internal::StrCat(__VA_ARGS__)); \
  } while (0)

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

// --name=value, --name value, and bare --checkpoint / --cpu_smoke / --offload / --plain, by name.
std::map<std::string, std::string> FlagValues(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    FLAG_CHECK(a.rfind("--", 0) == 0, "unexpected argument '", a, "'");
    a = a.substr(2);
    const auto eq = a.find('=');
    if (eq != std::string::npos) {
      kv[a.substr(0, eq)] = a.substr(eq + 1);
    } else if (a == "checkpoint" || a == "cpu_smoke" || a == "offload" || a == "plain") {
      kv.insert_or_assign(a, std::string("1"));
    } else {
      FLAG_CHECK(i + 1 < argc, "flag --", a, " needs a value");
      kv[a] = argv[++i];
    }
  }
  return kv;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  std::map<std::string, std::string> kv = FlagValues(argc, argv);
  auto take_int = [&](const char* name, int64_t& out) {
    auto it = kv.find(name);
    if (it == kv.end()) return;
    char* end = nullptr;
    out = std::strtoll(it->second.c_str(), &end, 10);
    FLAG_CHECK(!it->second.empty() && *end == '\0', "--", name, " needs an integer, got '", it->second, "'");
    kv.erase(it);
  };
  auto take_double = [&](const char* name, double& out) {
    auto it = kv.find(name);
    if (it == kv.end()) return;
    char* end = nullptr;
    out = std::strtod(it->second.c_str(), &end);
    FLAG_CHECK(!it->second.empty() && *end == '\0', "--", name, " needs a number, got '", it->second, "'");
    kv.erase(it);
  };
  auto take_string = [&](const char* name, std::string& out) {
    auto it = kv.find(name);
    if (it == kv.end()) return;
    out = it->second;
    kv.erase(it);
  };
  take_int("n_layer", f.n_layer);
  take_int("n_embd", f.n_embd);
  take_int("n_head", f.n_head);
  take_int("block_size", f.block_size);
  take_int("vocab", f.vocab);
  take_int("batch", f.batch);
  take_int("steps", f.steps);
  take_int("warmup", f.warmup);
  take_double("lr", f.lr);
  take_double("weight_decay", f.weight_decay);
  auto take_bool = [&](const char* name, bool& out) {
    auto it = kv.find(name);
    if (it == kv.end()) return;
    const std::string v = it->second;
    FLAG_CHECK(v == "0" || v == "1" || v == "true" || v == "false", "--", name, " takes 0/1/true/false, got '", v,
               "'");
    out = v == "1" || v == "true";
    kv.erase(it);
  };
  take_bool("checkpoint", f.checkpoint);
  take_bool("cpu_smoke", f.cpu_smoke);
  take_bool("offload", f.offload);
  take_bool("plain", f.plain);
  take_string("strategy", f.strategy);
  take_int("device", f.device);
  take_double("peak_tflops", f.peak_tflops);
  take_int("seed", f.seed);
  take_string("label", f.label);
  if (!kv.empty()) {
    std::string names;
    for (const auto& [k, v] : kv) names += " --" + k;
    FLAG_CHECK(false, "unknown flag(s):", names);
  }
  try {
    f.sharding_strategy = sharding::ParseShardingStrategy(f.strategy);
  } catch (const InvalidArgumentError& e) {
    throw FlagError(e.what());
  }
  FLAG_CHECK(f.batch > 0 && f.steps > 0 && f.warmup >= 0 && f.peak_tflops > 0,
             "--batch and --steps must be positive, --warmup non-negative, --peak_tflops positive");
  FLAG_CHECK(!(f.plain && f.offload),
             "--plain trains without sharding, so it has nothing to offload; pass one of them");
  FLAG_CHECK(!(f.plain && f.checkpoint), "--plain has no wrap points to checkpoint; drop --checkpoint or --plain");
  return f;
}

// World size 1 without a backend, for --cpu_smoke: every collective is a local
// copy (with the reduction's scaling applied) and completes at once.
class LocalCommunicator : public comm::Communicator {
 public:
  LocalCommunicator() : Communicator(0, 1, "world", comm::kDefaultTimeout) {}
  std::string backend() const override { return "local"; }
  comm::WorkPtr AllGather(const at::Tensor& input, const at::Tensor& output) override {
    CheckGatherScatter("all_gather", input, output);
    output.view({-1}).copy_(input.reshape({-1}));
    Count(comm::CommOp::kAllGather, 0);
    return comm::CompletedWork();
  }
  comm::WorkPtr ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                              const comm::ReduceOptions& options) override {
    CheckGatherScatter("reduce_scatter", output, input);
    output.view({-1}).copy_(input.reshape({-1}));
    Scale(output, options);
    Count(comm::CommOp::kReduceScatter, 0);
    return comm::CompletedWork();
  }
  comm::WorkPtr AllReduce(const at::Tensor& tensor, const comm::ReduceOptions& options) override {
    Scale(tensor, options);
    Count(comm::CommOp::kAllReduce, 0);
    return comm::CompletedWork();
  }
  comm::WorkPtr Broadcast(const at::Tensor&, int) override { return comm::CompletedWork(); }
  comm::WorkPtr Barrier() override { return comm::CompletedWork(); }
  comm::CommunicatorPtr NewGroup(const std::vector<int>&, const std::string&) override {
    return std::make_shared<LocalCommunicator>();
  }

 private:
  static void Scale(const at::Tensor& t, const comm::ReduceOptions& o) {
    const bool sum_like = o.op == comm::ReduceOp::kSum || o.op == comm::ReduceOp::kAvg;
    if (sum_like && o.pre_divide * o.post_divide != 1.0) t.div_(o.pre_divide * o.post_divide);
  }
};

examples::GptConfig Config(const Flags& f) {
  examples::GptConfig c;
  c.vocab_size = f.vocab;
  c.block_size = f.block_size;
  c.n_layer = f.n_layer;
  c.n_head = f.n_head;
  c.n_embd = f.n_embd;
  c.dropout = 0.0;
  return c;
}

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

// The timed loop's results: wall seconds of each timed step, and the losses.
struct StepTimes {
  std::vector<double> times;
  double first_loss = 0, last_loss = 0;
};
StepTimes TimeSteps(const Flags& f, const std::function<at::Tensor(const at::Tensor&)>& forward,
                    torch::optim::Optimizer& opt, const at::Tensor& data, const std::function<void()>& sync);
StepTimes TimePlain(const Flags& f, examples::GptImpl& model, const at::Tensor& data,
                    const std::function<void()>& sync);
// The run's JSON row on stdout (step time, tokens/s, MFU, peak GPU memory).
void PrintResult(const Flags& f, const std::string& gpu_name, const examples::GptConfig& cfg,
                 const std::string& strategy, double init_s, const StepTimes& run);

int Run(const Flags& f) {
  const int gpus = f.cpu_smoke ? 0 : c10::cuda::device_count();
  if (gpus == 0 && !f.cpu_smoke) {
    std::fprintf(stderr,
                 "gpt_gpu_bench: no CUDA device (the CUDA runtime reports no GPU, or no driver); this benchmark "
                 "needs one NVIDIA GPU\n");
    std::printf("{\"impl\": \"%s\", \"error\": \"no CUDA device\"}\n", JsonEscape(f.label).c_str());
    return 2;
  }
  ST_CHECK_ARG(f.cpu_smoke || (f.device >= 0 && f.device < gpus), "--device=", f.device, " but only ", gpus,
               " CUDA device(s)");
  const auto dev = static_cast<c10::DeviceIndex>(f.device);
  if (!f.cpu_smoke) c10::cuda::set_device(dev);
  const at::Device device = f.cpu_smoke ? at::Device(at::kCPU) : at::Device(at::kCUDA, dev);
  const std::string gpu_name = f.cpu_smoke ? "cpu (--cpu_smoke)" : at::cuda::getDeviceProperties(dev)->name;
  auto sync = [&] {
    if (!f.cpu_smoke) c10::cuda::device_synchronize();
  };
  SetLogRank(0, 1);

  const examples::GptConfig cfg = Config(f);
  std::fprintf(stderr, "gpt_gpu_bench: %s on %s; batch %lld x %lld tokens, %lld+%lld steps%s\n",
               cfg.ToString().c_str(), gpu_name.c_str(), static_cast<long long>(f.batch),
               static_cast<long long>(f.block_size), static_cast<long long>(f.warmup),
               static_cast<long long>(f.steps), f.checkpoint ? ", activation checkpointing" : "");

  // Construction initializes on the CPU (LibTorch modules have no default
  // device); then the parameters move to the GPU and are sharded there.
  const auto t_init = std::chrono::steady_clock::now();
  at::manual_seed(static_cast<uint64_t>(f.seed));
  auto model = std::make_shared<examples::GptImpl>(cfg);
  model->to(device);
  const double init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_init).count();

  // Random token batches, made on the device before timing.
  const int64_t total = f.warmup + f.steps;
  at::Tensor data =
      at::randint(f.vocab, {total, f.batch, f.block_size + 1}, at::TensorOptions().dtype(at::kLong).device(device));
  if (f.plain) {  // the reference: what a plain LibTorch program does
    PrintResult(f, gpu_name, cfg, "none (plain LibTorch, bf16 autocast)", init_s, TimePlain(f, *model, data, sync));
    return 0;
  }

  comm::CommunicatorPtr world;
  if (f.cpu_smoke) {
    world = std::make_shared<LocalCommunicator>();
  } else {
    comm::NcclOptions no;
    no.device = dev;
    world = comm::NcclCommunicator::Create(comm::CreateHashStore(), 0, 1, no);
  }

  sharding::ShardingOptions so;
  so.sharding_strategy = f.sharding_strategy;
  so.mixed_precision.param_dtype = at::kBFloat16;
  so.mixed_precision.reduce_dtype = at::kBFloat16;
  so.offload_params = f.offload;
  // Checkpoint exactly the wrapped blocks (the policy matches the type's
  // unqualified name), and count them: a flag that selects nothing is an error.
  const sharding::WrapPolicy blocks = sharding::WrapPolicy::ByType({"BlockImpl"});
  int64_t checkpointed = 0;
  std::function<bool(const sharding::WrapPoint&)> checkpoint;
  if (f.checkpoint) {
    checkpoint = [&](const sharding::WrapPoint& p) {
      const bool yes = blocks.should_wrap(p, /*numel=*/0);
      checkpointed += yes;
      return yes;
    };
  }
  sharding::ShardedModel sm(model, world, so, blocks, checkpoint, /*local_world_size=*/1);
  ST_CHECK_ARG(sm.num_units() == f.n_layer + 1, "expected one unit per block plus the root, got ", sm.num_units());
  ST_CHECK_ARG(!f.checkpoint || checkpointed == f.n_layer, "--checkpoint selected ", checkpointed, " of ", f.n_layer,
               " blocks");

  torch::optim::AdamW opt(sm.parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(f.weight_decay));
  const StepTimes run = TimeSteps(
      f, [&](const at::Tensor& x) { return sm.Forward([&] { return model->forward(x); }); }, opt, data, sync);
  PrintResult(f, gpu_name, cfg, sharding::ShardingStrategyName(so.sharding_strategy), init_s, run);
  return 0;
}

// --plain: the model unsharded, float32 parameters, forward under bf16
// autocast (as torch.autocast), AdamW over the parameters.
StepTimes TimePlain(const Flags& f, examples::GptImpl& model, const at::Tensor& data,
                    const std::function<void()>& sync) {
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(f.weight_decay));
  const at::DeviceType type = data.device().type();
  const auto autocast_forward = [&](const at::Tensor& x) {
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::set_autocast_dtype(type, at::kBFloat16);
    at::Tensor logits;
    try {
      logits = model.forward(x);
    } catch (...) {
      at::autocast::set_autocast_enabled(type, false);
      throw;
    }
    at::autocast::set_autocast_enabled(type, false);
    at::autocast::clear_cache();
    return logits;
  };
  return TimeSteps(f, autocast_forward, opt, data, sync);
}

StepTimes TimeSteps(const Flags& f, const std::function<at::Tensor(const at::Tensor&)>& forward,
                    torch::optim::Optimizer& opt, const at::Tensor& data, const std::function<void()>& sync) {
  const int64_t total = f.warmup + f.steps;
  StepTimes run;
  // The steps' peak memory, not construction's (the whole model at W=1), on both sides.
  if (!f.cpu_smoke) c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(f.device));
  for (int64_t s = 0; s < total; ++s) {
    at::Tensor x = data[s].slice(1, 0, f.block_size).contiguous();
    at::Tensor y = data[s].slice(1, 1).contiguous();
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    at::Tensor logits = forward(x);
    at::Tensor loss = examples::GptImpl::Loss(logits, y);
    logits = at::Tensor();
    loss.backward();
    opt.step();
    sync();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.last_loss = loss.item<double>();
    if (s == 0) run.first_loss = run.last_loss;
    if (!std::isfinite(run.last_loss)) throw std::runtime_error("loss is not finite at step " + std::to_string(s));
    if (s >= f.warmup) run.times.push_back(dt);
    std::fprintf(stderr, "gpt_gpu_bench: step %lld/%lld  %.3f s  loss %.4f\n", static_cast<long long>(s + 1),
                 static_cast<long long>(total), dt, run.last_loss);
  }
  return run;
}

void PrintResult(const Flags& f, const std::string& gpu_name, const examples::GptConfig& cfg,
                 const std::string& strategy, double init_s, const StepTimes& run) {
  const int64_t n_params = cfg.NumParameters();
  std::vector<double> times = run.times;
  std::sort(times.begin(), times.end());
  const double median = times.size() % 2 ? times[times.size() / 2]
                                         : 0.5 * (times[times.size() / 2 - 1] + times[times.size() / 2]);
  const double tokens = static_cast<double>(f.batch * f.block_size);
  const double tokens_per_s = tokens / median;
  const double flops_per_token =
      6.0 * static_cast<double>(n_params) + 12.0 * f.n_layer * f.block_size * static_cast<double>(f.n_embd);
  const double tflops = tokens_per_s * flops_per_token / 1e12;
  double peak_alloc = 0, peak_reserved = 0;  // CUDA caching allocator, whole run
  if (!f.cpu_smoke) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(f.device));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    peak_alloc = GiB(stats.allocated_bytes[agg].peak);
    peak_reserved = GiB(stats.reserved_bytes[agg].peak);
  }

  std::printf(
      "{\"impl\": \"%s\", \"gpu\": \"%s\", \"world\": 1, \"strategy\": \"%s\", \"params\": %lld, "
      "\"n_layer\": %lld, \"n_embd\": %lld, \"n_head\": %lld, \"seq\": %lld, \"vocab\": %lld, \"batch\": %lld, "
      "\"tokens_per_step\": %lld, \"steps\": %lld, \"warmup\": %lld, \"checkpointing\": %s, \"offload\": %s, "
      "\"param_dtype\": \"bf16\", \"reduce_dtype\": \"bf16\", \"init_s\": %.2f, "
      "\"median_step_s\": %.4f, \"min_step_s\": %.4f, \"tokens_per_s\": %.1f, \"flops_per_token\": %.6g, "
      "\"achieved_tflops\": %.1f, \"peak_tflops\": %.1f, \"mfu\": %.4f, "
      "\"peak_mem_allocated_gib\": %.2f, \"peak_mem_reserved_gib\": %.2f, \"first_loss\": %.4f, "
      "\"final_loss\": %.4f}\n",
      JsonEscape(f.label).c_str(), JsonEscape(gpu_name).c_str(), JsonEscape(strategy).c_str(),
      static_cast<long long>(n_params), static_cast<long long>(f.n_layer), static_cast<long long>(f.n_embd),
      static_cast<long long>(f.n_head), static_cast<long long>(f.block_size), static_cast<long long>(f.vocab),
      static_cast<long long>(f.batch), static_cast<long long>(f.batch * f.block_size), static_cast<long long>(f.steps),
      static_cast<long long>(f.warmup), f.checkpoint ? "true" : "false", f.offload ? "true" : "false", init_s, median,
      times.front(), tokens_per_s, flops_per_token, tflops, f.peak_tflops, tflops / f.peak_tflops, peak_alloc,
      peak_reserved, run.first_loss, run.last_loss);
  std::fflush(stdout);
}
}  // namespace

int main(int argc, char** argv) {
  std::string label = "shardtrain_fsdp_native";
  try {
    const Flags f = ParseFlags(argc, argv);
    label = f.label;
    return Run(f);
  } catch (const FlagError& e) {
    std::fprintf(stderr, "gpt_gpu_bench: %s\n%s", e.what(), kUsage);
    std::printf("{\"impl\": \"%s\", \"error\": \"%s\"}\n", JsonEscape(label).c_str(), JsonEscape(e.what()).c_str());
    return 2;
  } catch (const c10::OutOfMemoryError& e) {
    std::fprintf(stderr, "gpt_gpu_bench: CUDA out of memory; pass a smaller --batch (or --checkpoint)\n%s\n",
                 e.what_without_backtrace());
    std::printf("{\"impl\": \"%s\", \"error\": \"CUDA out of memory\"}\n", JsonEscape(label).c_str());
    return 3;
  } catch (const InvalidArgumentError& e) {
    std::fprintf(stderr, "gpt_gpu_bench: %s\n", e.what());
    std::printf("{\"impl\": \"%s\", \"error\": \"%s\"}\n", JsonEscape(label).c_str(), JsonEscape(e.what()).c_str());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "gpt_gpu_bench: %s\n", e.what_without_backtrace());
    std::printf("{\"impl\": \"%s\", \"error\": \"%s\"}\n", JsonEscape(label).c_str(),
                JsonEscape(e.what_without_backtrace()).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_gpu_bench: %s\n", e.what());
    std::printf("{\"impl\": \"%s\", \"error\": \"%s\"}\n", JsonEscape(label).c_str(), JsonEscape(e.what()).c_str());
    return 1;
  }
}
