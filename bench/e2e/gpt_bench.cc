// End-to-end benchmark: trains the examples/gpt model through a ShardTrain
// strategy (by registry name) on fixed initial weights and batches, and
// prints one JSON line: median step time, tokens/s, peak RSS per rank, bytes
// sent per step, final loss. bench/e2e/run.sh runs it side by side with
// Python PyTorch (bench/e2e/torch_bench.py) on the same weights and batches.
//
//   gpt_bench --dump_dir=D ...         write D/init.pt and D/data.pt, then exit
//   gpt_bench --data_dir=D --devices=2 --strategy=fsdp_native ...
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gflags/gflags.h>
#include <sys/resource.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "examples/common/example_util.h"
#include "examples/gpt/gpt_model.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"
#include "launch/launcher.h"
#include "sharding/host_memory.h"
#include "sharding/sharded_model.h"
#include "strategies/model_parallel/model_parallel_strategy.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/testing/proc_status.h"

DEFINE_string(dump_dir, "", "write init.pt and data.pt here and exit");
DEFINE_string(data_dir, "", "read init.pt and data.pt from here");
DEFINE_int32(devices, 2, "ranks on this machine");
DEFINE_string(strategy, "fsdp_native", "strategy registry name");
DEFINE_string(strategy_options, "", "comma-separated key=value strategy options");
DEFINE_string(label, "", "name of this configuration in the output");
DEFINE_bool(local_compute, false,
            "every rank trains its own share of the batch with --strategy=single_device and no communication: "
            "the 'local compute alone' baseline of the same per-rank work under the same core sharing");
DEFINE_int32(n_layer, 8, "");
DEFINE_int32(n_embd, 512, "");
DEFINE_int32(n_head, 8, "");
DEFINE_int32(block_size, 128, "");
DEFINE_int32(vocab, 96, "");
DEFINE_int32(global_batch, 8, "sequences per step over all ranks");
DEFINE_int32(steps, 8, "timed steps after warmup");
DEFINE_int32(warmup, 2, "untimed steps first");
DEFINE_double(lr, 1e-3, "AdamW learning rate");

namespace {
using namespace shardtrain;

examples::GptConfig Config() {
  examples::GptConfig c;
  c.vocab_size = FLAGS_vocab;
  c.block_size = FLAGS_block_size;
  c.n_layer = FLAGS_n_layer;
  c.n_head = FLAGS_n_head;
  c.n_embd = FLAGS_n_embd;
  return c;
}

void WriteDict(const std::string& path, const c10::Dict<std::string, at::Tensor>& d) {
  auto bytes = torch::jit::pickle_save(d);
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  ST_CHECK_ARG(out, "cannot write ", path, ": --dump_dir must be an existing, writable directory");
}

std::map<std::string, at::Tensor> ReadDict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ST_CHECK_ARG(in, "cannot read ", path, " (run with --dump_dir first)");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : torch::jit::pickle_load(bytes).toGenericDict()) out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

// The dump must hold every parameter of the model with its shape, and a
// batch for each of the --warmup + --steps steps with --global_batch rows.
void CheckDumpFits(const std::map<std::string, at::Tensor>& init, const std::map<std::string, at::Tensor>& data,
                   const std::map<std::string, std::vector<int64_t>>& shapes) {
  const std::string again = " (dump again with the same model and step flags as this run, or change the flags)";
  for (const auto& [name, shape] : shapes) {
    auto it = init.find(name);
    ST_CHECK_ARG(it != init.end(), FLAGS_data_dir, "/init.pt has no parameter ", name,
                 ": it was dumped for another model (--n_layer/--n_embd/--n_head/--block_size/--vocab)", again);
    ST_CHECK_ARG(it->second.sizes() == c10::IntArrayRef(shape), FLAGS_data_dir, "/init.pt: ", name, " is ",
                 it->second.sizes(), ", the model's is ", c10::IntArrayRef(shape),
                 ": it was dumped for another model (--n_layer/--n_embd/--n_head/--block_size/--vocab)", again);
  }
  const int needed = FLAGS_warmup + FLAGS_steps;
  int have = 0;
  while (data.count("x." + std::to_string(have)) && data.count("y." + std::to_string(have))) ++have;
  ST_CHECK_ARG(have >= needed, FLAGS_data_dir, "/data.pt holds batches for ", have,
               " steps, but --warmup=", FLAGS_warmup, " + --steps=", FLAGS_steps, " need ", needed, again);
  const auto& x0 = data.at("x.0");
  ST_CHECK_ARG(x0.size(0) == FLAGS_global_batch && x0.size(1) == FLAGS_block_size, FLAGS_data_dir,
               "/data.pt holds batches of ", x0.sizes(), ", but --global_batch=", FLAGS_global_batch,
               " --block_size=", FLAGS_block_size, " need [", FLAGS_global_batch, ", ", FLAGS_block_size, "]", again);
}

int Dump() {
  ST_CHECK_ARG(std::filesystem::is_directory(FLAGS_dump_dir), "--dump_dir=", FLAGS_dump_dir,
               " is not a directory: create it first (mkdir -p)");
  at::manual_seed(1234);
  auto model = std::make_shared<examples::GptImpl>(Config());
  c10::Dict<std::string, at::Tensor> init, data;
  for (const auto& p : model->named_parameters()) init.insert(p.key(), p.value().detach().clone());
  auto gen = at::detail::createCPUGenerator(99);
  for (int s = 0; s < FLAGS_warmup + FLAGS_steps; ++s) {
    at::Tensor seq = at::randint(FLAGS_vocab, {FLAGS_global_batch, FLAGS_block_size + 1}, gen, at::kLong);
    data.insert("x." + std::to_string(s), seq.slice(1, 0, FLAGS_block_size).contiguous());
    data.insert("y." + std::to_string(s), seq.slice(1, 1).contiguous());
  }
  WriteDict(FLAGS_dump_dir + "/init.pt", init);
  WriteDict(FLAGS_dump_dir + "/data.pt", data);
  std::printf("{\"params\": %lld}\n", static_cast<long long>(Config().NumParameters()));
  return 0;
}

// Bytes this network namespace sent on eth0 (/proc/self/net/dev is per
// namespace): what crossed the link between namespace hosts. 0 without eth0.
double Eth0TxBytes() {
  std::ifstream in("/proc/self/net/dev");
  std::string line;
  while (std::getline(in, line)) {
    auto colon = line.find(':');
    if (colon == std::string::npos || line.substr(0, colon).find("eth0") == std::string::npos) continue;
    std::istringstream fields(line.substr(colon + 1));
    double v = 0;
    for (int i = 0; i < 9; ++i) fields >> v;  // rx: 8 fields, then tx bytes
    return v;
  }
  return 0;
}

// Bytes sent per link class by the distinct communicators in `groups`:
// [0] through shared memory, [1] over TCP (inside a host or across).
std::array<double, 2> BytesByLinkClass(const std::vector<comm::CommunicatorPtr>& groups) {
  std::array<double, 2> out{0, 0};
  std::vector<comm::Communicator*> seen;
  for (const auto& g : groups) {
    if (!g || std::find(seen.begin(), seen.end(), g.get()) != seen.end()) continue;
    seen.push_back(g.get());
    auto* gloo = dynamic_cast<comm::GlooCommunicator*>(g.get());
    out[gloo && gloo->uses_shared_memory() ? 0 : 1] += static_cast<double>(g->stats().TotalBytesSent());
  }
  return out;
}

// What the sharding core's host block cache did per timed step (stderr):
// reuse whole, pages moved between sizes, fresh pages, pages given back.
void LogHostCacheSteps(int rank, const sharding::HostCacheStats& a, const sharding::HostCacheStats& b) {
  if (!b.installed) return;
  const double steps = FLAGS_steps, mib = 1 << 20;
  std::fprintf(stderr,
               "[gpt_bench rank %d] host block cache per step: %.1f reused whole, %.1f assembled, %.2f MiB moved, "
               "%.2f MiB fresh, %.2f MiB returned; now live %.1f MiB, cached %.1f MiB, peak %.1f MiB\n",
               rank, (b.hits - a.hits) / steps, (b.assembled - a.assembled) / steps,
               (b.moved_bytes - a.moved_bytes) / steps / mib, (b.fresh_bytes - a.fresh_bytes) / steps / mib,
               (b.returned_bytes - a.returned_bytes) / steps / mib, b.live_bytes / mib, b.cached_bytes / mib,
               b.peak_bytes / mib);
}

// Process CPU time (all threads: compute, Gloo I/O, kernel TCP work) so far.
double CpuSeconds() {
  struct rusage r {};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + 1e-6 * (r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

// Minor page faults of this process so far: fresh pages touched (memory the
// allocator returned to the system and got back).
double MinorFaults() {
  struct rusage r {};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_minflt);
}

// This rank's Gloo world: loopback on one host, the host's own address across
// hosts (bench/cluster); a world of one without a launcher.
std::shared_ptr<comm::GlooCommunicator> JoinWorld(const ClusterInfo& info) {
  if (info.world_size == 1) return comm::GlooCommunicator::Create(comm::CreateHashStore(), 0, 1);
  const comm::RendezvousOptions ro = RendezvousOptionsFor(info);
  comm::GlooOptions go;
  go.hostname = info.num_nodes > 1 ? "" : "127.0.0.1";
  return comm::GlooCommunicator::Create(comm::CreateStore(ro), info.rank, info.world_size, go);
}

// The --strategy set up on `world` (or alone, for --local_compute).
strategies::StrategyPtr SetUpStrategy(const ClusterInfo& info, const comm::CommunicatorPtr& world) {
  const strategies::StrategyOptions so = examples::ParseKeyValueList(FLAGS_strategy_options, "--strategy_options");
  auto strategy = strategies::StrategyRegistry::Create(FLAGS_strategy, so);
  if (FLAGS_local_compute) {
    ST_CHECK_ARG(FLAGS_strategy == "single_device", "--local_compute needs --strategy=single_device");
    ClusterInfo alone = info;
    alone.rank = 0;
    alone.world_size = 1;
    alone.local_rank = 0;
    alone.local_world_size = 1;
    strategy->Setup(comm::GlooCommunicator::Create(comm::CreateHashStore(), 0, 1), alone);
  } else {
    strategy->Setup(world, info);
  }
  return strategy;
}

// The model from the dumped weights, wrapped by `strategy`. Tensor parallel
// (model_parallel): built in the strategy's construction scope, each rank
// keeping its pieces of the dumped tensors (LoadFullStateDict cuts them).
std::shared_ptr<examples::GptImpl> BuildBenchModel(strategies::Strategy& strategy,
                                                   std::map<std::string, at::Tensor>& init,
                                                   const std::map<std::string, at::Tensor>& data, int rank) {
  std::shared_ptr<examples::GptImpl> model;
  if (FLAGS_strategy == "model_parallel") {
    {
      auto scope = strategy.MakeConstructionScope();
      at::manual_seed(0);  // the ranks' construction agrees (the dumped weights replace it)
      model = std::make_shared<examples::GptImpl>(Config());
    }
    strategy.WrapModel(model);
    CheckDumpFits(init, data, strategy.ParameterShapes());  // the global shapes
    strategy.LoadFullStateDict(init);
  } else {
    model = std::make_shared<examples::GptImpl>(Config());
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : model->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
    CheckDumpFits(init, data, shapes);
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->named_parameters()) p.value().copy_(init.at(p.key()));
    }
    strategy.WrapModel(model);
  }
  init.clear();  // the model holds the weights now (torch_bench.py drops its copy too)
  if (std::getenv("GPT_BENCH_RSS")) {
    struct rusage r {};
    getrusage(RUSAGE_SELF, &r);
    std::fprintf(stderr, "[gpt_bench rank %d] after WrapModel: peak RSS %.0f MiB\n", rank, r.ru_maxrss / 1024.0);
  }
  return model;
}

// What the timed steps measured on this rank.
struct TimedRun {
  std::vector<double> times;  // wall seconds per timed step
  double last_loss = 0;       // mean over ranks
  double cpu_start = 0, faults_start = 0, wire_start = 0;  // at the first timed step
  sharding::HostCacheStats cache_start;
};

// --warmup untimed then --steps timed AdamW steps on the dumped batches; the
// counters restart at the first timed step.
TimedRun RunSteps(strategies::Strategy& strategy, examples::GptImpl& model, torch::optim::Optimizer& opt,
                  const std::map<std::string, at::Tensor>& data, const std::shared_ptr<comm::GlooCommunicator>& gloo,
                  const std::vector<comm::CommunicatorPtr>& groups, sharding::ShardedModel* sharded, int dp_rank,
                  int dp_size) {
  const int64_t per = FLAGS_global_batch / dp_size, first = dp_rank * per;
  TimedRun run;
  for (int s = 0; s < FLAGS_warmup + FLAGS_steps; ++s) {
    if (s == FLAGS_warmup) {
      run.cpu_start = CpuSeconds();
      run.faults_start = MinorFaults();
      run.cache_start = sharding::GetHostCacheStats();
      if (gloo) {
        gloo->Barrier()->Wait();
        run.wire_start = Eth0TxBytes();
        for (auto& g : groups)
          if (g) g->ResetStats();
      }
      if (sharded) sharded->ResetCommTimes();
    }
    at::Tensor x = data.at("x." + std::to_string(s)).slice(0, first, first + per);
    at::Tensor y = data.at("y." + std::to_string(s)).slice(0, first, first + per);
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    at::Tensor loss = model.LossOf(strategy.Forward([&] { return model.forward(x); }), y);
    strategy.Backward(loss);
    opt.step();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    at::Tensor l = loss.detach().reshape({1}).to(at::kDouble).clone();
    if (gloo) gloo->AllReduce(l, {comm::ReduceOp::kAvg})->Wait();
    run.last_loss = l.item<double>();
    if (s >= FLAGS_warmup) run.times.push_back(dt);
  }
  return run;
}

// Rank 0's JSON row: every figure reduced over the ranks (see run.sh's report).
void Report(const TimedRun& run, strategies::Strategy& strategy, const std::shared_ptr<comm::GlooCommunicator>& gloo,
            const std::vector<comm::CommunicatorPtr>& groups, sharding::ShardedModel* sharded, const ClusterInfo& info,
            bool step_peak_known) {
  const int rank = info.rank, world = info.world_size;
  // Per host and step: eth0 bytes (counted once per host, by local rank 0)
  // and the communicators' bytes by link class (summed over the host's ranks);
  // the sharding core's time blocked on collectives (mean over ranks).
  const auto by_class = BytesByLinkClass(groups);
  double waited = 0;
  if (sharded) waited = sharded->comm_times().wait_s();
  at::Tensor link = at::tensor({info.local_rank == 0 ? Eth0TxBytes() - run.wire_start : 0.0, by_class[0], by_class[1],
                                waited / world},
                               at::kDouble);
  if (gloo) gloo->AllReduce(link, {comm::ReduceOp::kSum})->Wait();
  const double host_steps = 1.0 * std::max(1, info.num_nodes) * FLAGS_steps;
  link /= at::tensor({host_steps, host_steps, host_steps, 1.0 * FLAGS_steps}, at::kDouble);
  at::Tensor cpu = at::tensor({(CpuSeconds() - run.cpu_start) / FLAGS_steps}, at::kDouble);
  if (gloo) gloo->AllReduce(cpu, {comm::ReduceOp::kAvg})->Wait();
  // Summed over the ranks: the faults of the whole job per step, to compare
  // with single_device's on the same global batch.
  at::Tensor faults = at::tensor({(MinorFaults() - run.faults_start) / FLAGS_steps}, at::kDouble);
  if (gloo) gloo->AllReduce(faults, {comm::ReduceOp::kSum})->Wait();
  LogHostCacheSteps(rank, run.cache_start, sharding::GetHostCacheStats());
  std::vector<double> times = run.times;
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  at::Tensor rss = at::tensor({static_cast<double>(ru.ru_maxrss) / 1024.0,
                               step_peak_known ? testing::ProcStatusKb("VmHWM") / 1024.0 : -1.0},
                              at::kDouble);  // MiB: the whole run's peak, the steps' peak
  if (gloo) gloo->AllReduce(rss, {comm::ReduceOp::kMax})->Wait();
  const double bytes = gloo ? static_cast<double>(gloo->stats().TotalBytesSent()) / FLAGS_steps : 0.0;
  // Persistent training state per rank: what the optimizer steps (fp32), its
  // gradient and AdamW's two moments. The FSDP bound is 1/W of the unsharded
  // total plus the largest unit's gathered parameters.
  int64_t local_numel = 0;
  for (const auto& p : strategy.parameters()) local_numel += p.numel();
  const double persistent_mib = local_numel * 4.0 * 4.0 / (1 << 20);
  int64_t largest = 0;
  if (sharded) {
    for (const auto& u : sharded->units()) largest = std::max(largest, u.padded_numel);
    const auto& t = sharded->comm_times();
    std::fprintf(stderr,
                 "[gpt_bench rank %d] per step: gather issue %.3f s, gather wait %.3f s, reduce issue %.3f s, "
                 "reduce wait %.3f s, replicate issue %.3f s, replicate wait %.3f s\n",
                 rank, t.gather_issue_s / FLAGS_steps, t.gather_wait_s / FLAGS_steps, t.reduce_issue_s / FLAGS_steps,
                 t.reduce_wait_s / FLAGS_steps, t.replicate_issue_s / FLAGS_steps, t.replicate_wait_s / FLAGS_steps);
  }
  const double bound_mib = (Config().NumParameters() * 16.0 / world + largest * 4.0) / (1 << 20);
  if (rank != 0) return;
  std::printf(
      "{\"impl\": \"%s\", \"world\": %d, \"median_step_s\": %.4f, \"tokens_per_s\": %.1f, \"peak_rss_mib\": %.1f, "
      "\"bytes_sent_per_step\": %.0f, \"final_loss\": %.6f, \"persistent_mib\": %.2f, \"fsdp_bound_mib\": %.2f, "
      "\"cpu_s_per_step\": %.3f, \"wire_bytes_per_host_step\": %.0f, \"shm_bytes_per_host_step\": %.0f, "
      "\"tcp_bytes_per_host_step\": %.0f, \"comm_wait_s\": %.4f, \"nodes\": %d, "
      "\"minor_faults_per_step\": %.0f, \"step_peak_rss_mib\": %.1f}\n",
      (FLAGS_label.empty() ? FLAGS_strategy : FLAGS_label).c_str(), world, median,
      FLAGS_global_batch * FLAGS_block_size / median, rss[0].item<double>(), bytes, run.last_loss, persistent_mib,
      largest > 0 ? bound_mib : 0.0, cpu.item<double>(), link[0].item<double>(), link[1].item<double>(),
      link[2].item<double>(), link[3].item<double>(), info.num_nodes, faults.item<double>(), rss[1].item<double>());
  std::fflush(stdout);
}

int Bench() {
  if (!std::getenv("RANK") && FLAGS_devices > 1) {
    LaunchOptions lo;
    lo.num_ranks = FLAGS_devices;
    LaunchLocalRanks(lo);
  }
  // The launcher sets OMP_NUM_THREADS for the ranks it starts; this process's
  // OpenMP runtime read the environment before that, so apply it here too.
  if (const char* t = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::max(1, std::atoi(t)));
  const ClusterInfo info = DetectClusterEnvironment();
  const std::shared_ptr<comm::GlooCommunicator> gloo = JoinWorld(info);  // a world of one at W=1
  ST_CHECK_ARG(FLAGS_global_batch % info.world_size == 0, "--global_batch must be divisible by the world size");

  auto init = ReadDict(FLAGS_data_dir + "/init.pt");
  auto data = ReadDict(FLAGS_data_dir + "/data.pt");
  strategies::StrategyPtr strategy = SetUpStrategy(info, gloo);
  const auto model = BuildBenchModel(*strategy, init, data, info.rank);
  auto* sharded_base = dynamic_cast<strategies::ShardedStrategyBase*>(strategy.get());
  sharding::ShardedModel* sharded = sharded_base ? &sharded_base->sharded_model() : nullptr;
  torch::optim::AdamW opt(strategy->parameters(), torch::optim::AdamWOptions(FLAGS_lr).weight_decay(0.0));
  // The steps' own peak, apart from the construction above (this harness builds
  // the whole model first, as torch_bench.py does): VmHWM restarts here.
  const bool step_peak_known = testing::ResetPeakRss();
  std::vector<comm::CommunicatorPtr> groups = {gloo};
  if (sharded) groups = {gloo, sharded->shard_group(), sharded->replicate_group()};
  if (auto* mp = dynamic_cast<strategies::ModelParallelStrategy*>(strategy.get())) groups.push_back(mp->mesh().tp);
  // The data-parallel ranks split the batch (tensor-parallel ranks read the same rows); --local_compute:
  // each rank its share of the launch's world, alone.
  const int dp_rank = FLAGS_local_compute ? info.rank : strategy->data_parallel_rank();
  const int dp_size = FLAGS_local_compute ? info.world_size : strategy->data_parallel_size();
  const TimedRun run = RunSteps(*strategy, *model, opt, data, gloo, groups, sharded, dp_rank, dp_size);
  if (gloo) gloo->Barrier()->Wait();
  Report(run, *strategy, gloo, groups, sharded, info, step_peak_known);
  if (gloo) gloo->Barrier()->Wait();
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  int code = 1;
  try {
    code = FLAGS_dump_dir.empty() ? Bench() : Dump();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_bench: %s\n", e.what());
  }
  if (!std::getenv("SHARDTRAIN_LAUNCHED")) code = shardtrain::JoinLocalRanks(code);
  return code;
}
