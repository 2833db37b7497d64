// Memory benchmark, ShardTrain side: the examples/gpt model trained through
// the Trainer, with the peak resident set size of this rank's process
// recorded for each phase. The peak is VmHWM, reset between phases by writing
// "5" to /proc/self/clear_refs; where that does not reset it (gVisor, some
// containers) or ST_RSS_SAMPLER=1 is set, a thread samples VmRSS every 2 ms
// and keeps the phase's maximum instead ("rss_method" in the output says
// which). Each rank appends one JSON line per phase to --out.
// bench/memory/run.sh and device_run.sh run it next to Python PyTorch
// (torch_memory.py).
//
//   memory_bench --mode=train --devices=W --dir=D --out=F      construction, step, full save, sharded save
//   memory_bench --mode=load_full --devices=W --dir=D --out=F  construction, full load (D/full.ckpt)
//   memory_bench --mode=load_sharded ...                       construction, sharded load (D/sharded)
//   memory_bench --mode=self_test                              does the peak method see a 256 MiB transient?
//   memory_bench --mode=save_during_training --save=none|sync|async --steps=6 --save_at=2 ...
//       a sharded save after step --save_at, synchronous or in the background
//       (TrainerOptions::async_checkpoint): phases before_save (steps up to
//       it) and after_save (the save and the steps after it, to the end of
//       Fit, which waits for the writer), and one "timing" line per rank: each
//       step's time, the time SaveCheckpoint held the training thread, Fit's.
//       --save=bare_write: no save, the same bytes written by a bare O_DIRECT
//       thread (what the disk alone costs the steps).
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gflags/gflags.h>
#include <sys/mman.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "base/errors.h"
#include "examples/common/example_util.h"
#include "examples/common/trainer_flags.h"
#include "examples/gpt/gpt_model.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/testing/proc_status.h"
#include "trainer/trainer.h"

DEFINE_string(mode, "train",
              "train | load_full | load_sharded | save_during_training | self_test (does the peak method see a 256 "
              "MiB transient?)");
DEFINE_string(save, "async",
              "save_during_training: none | sync | async | bare_write (the control: the same bytes written "
              "with O_DIRECT by a bare thread)");
DEFINE_int32(save_at, 2, "save_during_training: save after this step");
DEFINE_double(async_max_extra, 0.2, "save_during_training: TrainerOptions::async_checkpoint_max_extra_memory");
DEFINE_string(dir, "", "checkpoints are written to / read from here (full.ckpt, sharded/)");
DEFINE_string(out, "", "append one JSON line per rank and phase to this file");
DEFINE_string(label, "", "model label in the output");
DEFINE_bool(sharded_construction, true, "build the model under the strategy's ShardedInitScope");
DEFINE_int32(n_layer, 16, "");
DEFINE_int32(n_embd, 1024, "");
DEFINE_int32(n_head, 16, "");
DEFINE_int32(block_size, 32, "tokens per sequence");
DEFINE_int32(vocab, 96, "");
DEFINE_int32(steps, 1, "training steps");

namespace {
using namespace shardtrain;

int64_t StatmRssKb(int fd) {  // resident pages from /proc/self/statm (cheaper than status)
  char buf[128];
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  buf[n] = 0;
  long long size = 0, resident = 0;
  if (std::sscanf(buf, "%lld %lld", &size, &resident) != 2) return -1;
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

// True when clear_refs resets VmHWM: a 64 MiB touched and released mapping
// raises the peak, and the reset must bring it back down.
bool ClearRefsResetsPeak() {
  const size_t bytes = size_t{64} << 20;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  std::memset(p, 1, bytes);
  ::munmap(p, bytes);
  const int64_t raised = testing::ProcStatusKb("VmHWM");
  if (!testing::ResetPeakRss()) return false;
  return testing::ProcStatusKb("VmHWM") < raised - 32 * 1024;
}

// Peak RSS of this process since the last Reset(), by either method.
class PeakMeter {
 public:
  PeakMeter() {
    const char* force = std::getenv("ST_RSS_SAMPLER");
    sampler_ = (force != nullptr && std::strcmp(force, "1") == 0) || !ClearRefsResetsPeak();
    if (!sampler_) return;
    fd_ = ::open("/proc/self/statm", O_RDONLY);
    ST_CHECK_ARG(fd_ >= 0, "cannot read /proc/self/statm (needed to sample VmRSS when clear_refs is unavailable)");
    max_kb_ = StatmRssKb(fd_);
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        Observe();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
  }
  ~PeakMeter() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) ::close(fd_);
  }
  const char* method() const { return sampler_ ? "vmrss_sampler_2ms" : "vmhwm_clear_refs"; }
  void Reset() {
    if (!sampler_) {
      ST_CHECK_ARG(testing::ResetPeakRss(),
                   "cannot write /proc/self/clear_refs (needed to reset VmHWM between phases)");
      return;
    }
    testing::ResetPeakRss();  // where it works, VmHWM is recorded next to the sampler's peak for comparison
    max_kb_ = StatmRssKb(fd_);
  }
  int64_t PeakKb() {
    if (!sampler_) return testing::ProcStatusKb("VmHWM");
    Observe();
    return max_kb_.load();
  }

 private:
  void Observe() {
    const int64_t now = StatmRssKb(fd_);
    int64_t seen = max_kb_.load();
    while (now > seen && !max_kb_.compare_exchange_weak(seen, now)) {
    }
  }
  bool sampler_ = false;
  int fd_ = -1;
  std::atomic<int64_t> max_kb_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

PeakMeter& Meter() {
  static PeakMeter meter;
  return meter;
}

int g_rank = 0, g_world = 1;
void AppendLine(const std::string& line);
int64_t g_baseline_kb = 0;
const auto g_start = std::chrono::steady_clock::now();  // "t_s": when each phase ended

double SecondsSinceStart() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - g_start).count();
}

void Record(const std::string& phase) {
  const int64_t peak = Meter().PeakKb();
  std::ostringstream s;
  s << "{\"impl\":\"shardtrain\",\"model\":\"" << FLAGS_label << "\",\"W\":" << g_world << ",\"rank\":" << g_rank
    << ",\"phase\":\"" << phase << "\",\"peak_mib\":" << peak / 1024.0 << ",\"baseline_mib\":" << g_baseline_kb / 1024.0
    << ",\"rss_method\":\"" << Meter().method() << "\",\"vmhwm_mib\":" << testing::ProcStatusKb("VmHWM") / 1024.0
    << ",\"t_s\":" << SecondsSinceStart() << "}\n";
  AppendLine(s.str());
  Meter().Reset();
}

void AppendLine(const std::string& line) {
  const int fd = ::open(FLAGS_out.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  ST_CHECK_ARG(fd >= 0, "cannot open --out=", FLAGS_out);
  ST_CHECK_ARG(::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()), "short write to ", FLAGS_out);
  ::close(fd);
}

double Now() { return SecondsSinceStart(); }

// --mode=save_during_training: times each step, saves after --save_at.
// --save=bare_write: the control. A thread writes `bytes` (what a rank's
// sharded save writes) with O_DIRECT from one buffer while training goes on:
// no ShardTrain code, just the disk's own cost to the steps.
class BareWrite {
 public:
  BareWrite(const std::string& path, int64_t bytes) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    thread_ = std::thread([path, bytes] {
      constexpr size_t kBlock = size_t{8} << 20;
      void* buf = std::aligned_alloc(4096, kBlock);
      std::memset(buf, 1, kBlock);
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
      auto fail = [&] {  // a bench: stop loudly
        std::perror(path.c_str());
        std::abort();
      };
      if (fd < 0) fail();
      for (int64_t done = 0; done < bytes; done += kBlock) {
        if (::write(fd, buf, kBlock) != static_cast<ssize_t>(kBlock)) fail();
      }
      ::fsync(fd);
      ::close(fd);
      ::unlink(path.c_str());
      std::free(buf);
    });
  }
  ~BareWrite() { thread_.join(); }

 private:
  std::thread thread_;
};

class SaveDuringTraining : public trainer::Callback {
 public:
  explicit SaveDuringTraining(int64_t rank_state_bytes) : rank_state_bytes_(rank_state_bytes) {}
  void on_train_batch_start(trainer::Trainer&, trainer::TrainingModule&, const trainer::Batch&, int64_t) override {
    start_ = Now();
  }
  void on_train_batch_end(trainer::Trainer& t, trainer::TrainingModule&, const at::Tensor&, int64_t) override {
    step_s_.push_back(Now() - start_);
    last_end_ = Now();
    if (t.global_step() != FLAGS_save_at) return;
    Record("before_save");
    const double t0 = Now();
    if (FLAGS_save == "bare_write") {
      bare_ = std::make_unique<BareWrite>(FLAGS_dir + "/bare_write." + std::to_string(g_rank), rank_state_bytes_);
    } else if (FLAGS_save != "none") {
      t.SaveCheckpoint(FLAGS_dir + "/sharded", trainer::CheckpointFormat::kSharded);
    }
    save_call_s_ = Now() - t0;
    last_end_ = Now();
  }
  void on_fit_end(trainer::Trainer& t, trainer::TrainingModule&) override {
    bare_.reset();                                  // waits for it, as Fit waits for a background save
    const double final_wait_s = Now() - last_end_;  // the end of Fit: waiting for the writer, completing the save
    Record("after_save");
    std::ostringstream s;
    s << "{\"impl\":\"shardtrain\",\"model\":\"" << FLAGS_label << "\",\"W\":" << g_world << ",\"rank\":" << g_rank
      << ",\"phase\":\"timing\",\"save\":\"" << FLAGS_save << "\",\"save_at\":" << FLAGS_save_at
      << ",\"save_call_s\":" << save_call_s_ << ",\"final_wait_s\":" << final_wait_s << ",\"step_s\":[";
    for (size_t i = 0; i < step_s_.size(); ++i) s << (i ? "," : "") << step_s_[i];
    const auto& st = t.async_checkpoint_stats();
    s << "],\"writer_s\":" << st.write_seconds << ",\"units_copied\":" << st.units_copied << ",\"units\":" << st.units
      << ",\"aside_peak_mib\":" << st.peak_extra_bytes / 1048576.0 << ",\"optimizer_wait_s\":" << st.wait_seconds
      << "}\n";
    AppendLine(s.str());
  }

 private:
  int64_t rank_state_bytes_;
  std::unique_ptr<BareWrite> bare_;
  double start_ = 0, save_call_s_ = 0, last_end_ = 0;
  std::vector<double> step_s_;
};

class GptModule : public trainer::TrainingModule {
 public:
  explicit GptModule(examples::GptConfig c) : config_(c) {}
  std::shared_ptr<torch::nn::Module> configure_model() override {
    model_ = std::make_shared<examples::GptImpl>(config_);
    return model_;
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return examples::GptImpl::Loss(forward([&] { return model_->forward(b.inputs); }), b.targets);
  }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    Record("construction");  // model built and sharded; the optimizer's state comes at the first step
    return {std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4))};
  }
  void on_fit_start() override {
    if (FLAGS_mode == "load_full" || FLAGS_mode == "load_sharded") {
      Record(FLAGS_mode == "load_full" ? "full_load" : "sharded_load");
    }
  }
  void on_fit_end() override {
    if (FLAGS_mode == "train") Record("step");
  }

 private:
  examples::GptConfig config_;
  std::shared_ptr<examples::GptImpl> model_;
};

// --mode=self_test: a 256 MiB tensor filled, held 50 ms and freed must show
// in the phase's peak (it fails where the peak method misses it); exit 1 if not.
int SelfTest() {
  Meter().Reset();
  const int64_t before = testing::ProcStatusKb("VmRSS");
  {
    at::Tensor t = at::ones({int64_t{64} << 20}, at::kFloat);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int64_t after = testing::ProcStatusKb("VmRSS");
  const double seen = (Meter().PeakKb() - before) / 1024.0;
  const bool ok = seen >= 0.9 * 256 && after - before < 128 * 1024;
  std::printf("{\"self_test\":\"shardtrain\",\"rss_method\":\"%s\",\"expected_mib\":256,\"seen_mib\":%.1f,\"ok\":%s}\n",
              Meter().method(), seen, ok ? "true" : "false");
  return ok ? 0 : 1;
}

int Run() {
  if (FLAGS_mode == "self_test") return SelfTest();
  ST_CHECK_ARG(FLAGS_mode == "train" || FLAGS_mode == "load_full" || FLAGS_mode == "load_sharded" ||
                   FLAGS_mode == "save_during_training",
               "--mode must be train, load_full, load_sharded, save_during_training or self_test, got '", FLAGS_mode,
               "'");
  ST_CHECK_ARG(FLAGS_save == "none" || FLAGS_save == "sync" || FLAGS_save == "async" || FLAGS_save == "bare_write",
               "--save must be none, sync, async or bare_write, got '", FLAGS_save, "'");
  ST_CHECK_ARG(!FLAGS_dir.empty() && !FLAGS_out.empty(), "--dir and --out are required");
  g_baseline_kb = testing::ProcStatusKb("VmRSS");
  trainer::TrainerOptions o;
  const examples::ProcessPlan plan = examples::ApplyTrainerFlags(o);
  g_rank = plan.rank;
  g_world = plan.devices;
  examples::GptConfig c;
  c.vocab_size = FLAGS_vocab;
  c.block_size = FLAGS_block_size;
  c.n_layer = FLAGS_n_layer;
  c.n_head = FLAGS_n_head;
  c.n_embd = FLAGS_n_embd;
  o.max_epochs = -1;
  o.max_steps = FLAGS_steps;
  o.batch_size = 1;
  o.shuffle = false;
  o.enable_checkpointing = false;
  o.enable_logger = false;
  o.enable_progress_bar = false;
  o.default_root_dir = FLAGS_dir;
  o.seed = 1;
  if (FLAGS_mode == "save_during_training") {
    o.async_checkpoint = FLAGS_save == "async";
    o.async_checkpoint_max_extra_memory = FLAGS_async_max_extra;
    // What a rank's sharded save writes: parameters and AdamW's two moments, fp32.
    o.callbacks.push_back(std::make_shared<SaveDuringTraining>(12 * c.NumParameters() / plan.devices));
  }
  const int64_t n = 64;
  at::Tensor tokens = at::randint(FLAGS_vocab, {n, FLAGS_block_size + 1}, at::kLong);
  trainer::TensorDataset data(tokens.slice(1, 0, FLAGS_block_size).contiguous(), tokens.slice(1, 1).contiguous());
  trainer::Trainer t(o);
  if (auto* s = dynamic_cast<strategies::ShardedStrategyBase*>(&t.strategy())) {
    s->set_sharded_construction(FLAGS_sharded_construction);
  }
  GptModule module(c);
  Meter().Reset();
  if (FLAGS_mode == "save_during_training") {
    t.Fit(module, data);
  } else if (FLAGS_mode == "train") {
    t.Fit(module, data);
    t.SaveCheckpoint(FLAGS_dir + "/full.ckpt", trainer::CheckpointFormat::kFull);
    Record("full_save");
    t.SaveCheckpoint(FLAGS_dir + "/sharded", trainer::CheckpointFormat::kSharded);
    Record("sharded_save");
  } else {
    t.Fit(module, data, nullptr, FLAGS_dir + (FLAGS_mode == "load_full" ? "/full.ckpt" : "/sharded"));
  }
  if (plan.rank == 0) std::printf("%s: %s done at W=%d\n", FLAGS_label.c_str(), FLAGS_mode.c_str(), plan.devices);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return shardtrain::examples::RunExampleMain(argc, argv, "memory per phase: memory_bench --mode=train --devices=2 ...",
                                              Run);
}
