// examples/gpt: trains a character-level GPT with Fully Sharded Data Parallel.
//
//   tools/bazel run //examples/gpt:train -- --devices=2 --steps=300
//
// Ranks: --devices=N on one machine re-executes this binary for ranks 1..N-1;
// under torchrun --no-python, srun or mpirun it joins the existing ranks.
// Data: any UTF-8/ASCII text file (--data); by default the English quotations
// of Debian's `fortunes` package (/usr/share/games/fortunes). 90% trains, 10%
// validates. Prints progress, validation loss and a generated sample.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gflags/gflags.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include <fcntl.h>
#include <unistd.h>

#include "comm/cluster_environment.h"
#include "comm/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/launcher.h"
#include "comm/logging.h"
#include "comm/rendezvous.h"
#include "examples/gpt/gpt_model.h"
#include "sharding/sharded_model.h"

DEFINE_int32(devices, 2, "ranks to launch on this machine (ignored under torchrun/srun/mpirun)");
DEFINE_string(sharding_strategy, "FULL_SHARD", "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD");
DEFINE_string(precision, "32-true", "32-true or bf16-mixed");
DEFINE_string(data, "", "text file to train on (default: Debian's fortunes corpus)");
DEFINE_int32(steps, 300, "optimizer steps");
DEFINE_int32(batch_size, 32, "global batch size (sequences), split across ranks");
DEFINE_int32(block_size, 64, "context length");
DEFINE_int32(n_layer, 4, "transformer blocks (one FSDP unit each)");
DEFINE_int32(n_head, 4, "attention heads");
DEFINE_int32(n_embd, 128, "embedding width");
DEFINE_double(lr, 3e-3, "AdamW learning rate");
DEFINE_double(grad_clip, 1.0, "clip the global gradient norm to this (0 = off)");
DEFINE_int32(eval_every, 100, "validate every N steps");
DEFINE_int32(eval_batches, 8, "validation batches per evaluation");
DEFINE_int32(log_every, 10, "print progress every N steps");
DEFINE_string(checkpoint_dir, "", "save checkpoints here at each evaluation (empty = none)");
DEFINE_bool(resume, false, "resume from --checkpoint_dir");
DEFINE_int32(sample_tokens, 300, "characters to generate at the end");
DEFINE_int32(seed, 1337, "random seed");

namespace {

using namespace shardtrain;

std::string ReadCorpus(const std::string& path) {
  std::ostringstream text;
  if (!path.empty()) {
    std::ifstream in(path, std::ios::binary);
    ST_CHECK_ARG(in, "cannot read --data=", path, ": give a readable text file");
    text << in.rdbuf();
    return text.str();
  }
  const std::filesystem::path dir = "/usr/share/games/fortunes";
  ST_CHECK_ARG(std::filesystem::is_directory(dir),
               "no training text: install Debian's `fortunes` package (tools/bootstrap.sh does) or pass --data=FILE");
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension().empty()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text << in.rdbuf();
  }
  return text.str();
}

// Writes bytes to `path` atomically: a crash leaves the old file or the new one.
void WriteAtomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ST_CHECK_ARG(fd >= 0, "cannot write checkpoint file ", tmp);
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    ST_CHECK_ARG(n > 0, "writing ", tmp, " failed");
    off += static_cast<size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  std::filesystem::rename(tmp, path);
}

struct Corpus {
  std::string chars;  // vocabulary: sorted distinct bytes
  at::Tensor train, val;
};

Corpus Encode(const std::string& text) {
  ST_CHECK_ARG(text.size() > 1000, "the training text is too short (", text.size(), " bytes); give at least 1 KB");
  std::set<unsigned char> set(text.begin(), text.end());
  Corpus c;
  c.chars.assign(set.begin(), set.end());
  std::array<int64_t, 256> index{};
  for (size_t i = 0; i < c.chars.size(); ++i) index[static_cast<unsigned char>(c.chars[i])] = static_cast<int64_t>(i);
  at::Tensor all = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  auto a = all.accessor<int64_t, 1>();
  for (size_t i = 0; i < text.size(); ++i) a[i] = index[static_cast<unsigned char>(text[i])];
  const int64_t n = all.numel() * 9 / 10;
  c.train = all.slice(0, 0, n);
  c.val = all.slice(0, n);
  return c;
}

// The global batch for (split, step) is the same on every rank; each rank takes its rows.
std::pair<at::Tensor, at::Tensor> Batch(const at::Tensor& data, int64_t step, int64_t batch, int64_t block,
                                        int rank, int world, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed * 1000003 + static_cast<uint64_t>(step));
  at::Tensor starts = at::randint(data.numel() - block - 1, {batch}, gen, at::kLong);
  const int64_t per = batch / world;
  std::vector<at::Tensor> xs, ys;
  for (int64_t i = rank * per; i < (rank + 1) * per; ++i) {
    const int64_t s = starts[i].item<int64_t>();
    xs.push_back(data.slice(0, s, s + block));
    ys.push_back(data.slice(0, s + 1, s + block + 1));
  }
  return {at::stack(xs), at::stack(ys)};
}

int Run(int argc, char** argv) {
  // Launch local ranks unless an external launcher (or ours) already did.
  const bool external = std::getenv("RANK") || std::getenv("SLURM_PROCID") || std::getenv("OMPI_COMM_WORLD_RANK") ||
                        std::getenv("PMI_RANK");
  if (!external && FLAGS_devices > 1) {
    LaunchOptions lo;
    lo.num_ranks = FLAGS_devices;
    LaunchLocalRanks(lo);
  }
  // The launcher sets OMP_NUM_THREADS for the ranks it starts; this process's
  // OpenMP runtime read the environment before that, so apply it here too.
  if (const char* t = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::max(1, std::atoi(t)));
  const ClusterInfo info = DetectClusterEnvironment();
  const int rank = info.rank, world = info.world_size;
  SetLogRank(rank, world);
  ST_CHECK_ARG(FLAGS_batch_size % world == 0, "--batch_size=", FLAGS_batch_size, " must be divisible by the ", world,
               " ranks");
  comm::RendezvousOptions ro;
  ro.kind = "tcp";
  ro.rank = rank;
  ro.world_size = world;
  ro.master_addr = info.master_addr;
  ro.master_port = info.master_port;
  ro.agent_store = info.agent_store;
  ro.restart_count = info.restart_count;
  ro.timeout = std::chrono::minutes(5);
  comm::GlooOptions go;
  go.timeout = std::chrono::minutes(5);
  if (info.num_nodes == 1) go.hostname = "127.0.0.1";
  auto world_comm = comm::GlooCommunicator::Create(comm::CreateStore(ro), rank, world, go);

  Corpus corpus = Encode(ReadCorpus(FLAGS_data));
  examples::GptConfig cfg;
  cfg.vocab_size = static_cast<int64_t>(corpus.chars.size());
  cfg.block_size = FLAGS_block_size;
  cfg.n_layer = FLAGS_n_layer;
  cfg.n_head = FLAGS_n_head;
  cfg.n_embd = FLAGS_n_embd;
  at::manual_seed(FLAGS_seed);
  auto model = std::make_shared<examples::GptImpl>(cfg);

  sharding::ShardingOptions so;
  so.sharding_strategy = sharding::ParseShardingStrategy(FLAGS_sharding_strategy);
  ST_CHECK_ARG(FLAGS_precision == "32-true" || FLAGS_precision == "bf16-mixed", "--precision=", FLAGS_precision,
               " is not valid; valid: 32-true, bf16-mixed");
  if (FLAGS_precision == "bf16-mixed") so.mixed_precision.param_dtype = at::kBFloat16;
  sharding::ShardedModel sm(model, world_comm, so, sharding::WrapPolicy::ByType({"BlockImpl"}), nullptr,
                            info.local_world_size);
  torch::optim::AdamW opt(sm.parameters(), torch::optim::AdamWOptions(FLAGS_lr).weight_decay(0.01));

  int start_step = 0;
  const std::string dir = FLAGS_checkpoint_dir;
  const std::string optim_file = dir + "/optim_rank" + std::to_string(rank) + "_of" + std::to_string(world) + ".pt";
  if (FLAGS_resume) {
    ST_CHECK_ARG(!dir.empty() && std::filesystem::exists(dir + "/model.pt"), "--resume needs a checkpoint in --checkpoint_dir (",
                 dir, "/model.pt not found)");
    std::ifstream in(dir + "/model.pt", std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto dict = torch::pickle_load(bytes).toGenericDict();
    std::map<std::string, at::Tensor> state;
    for (const auto& kv : dict) state[kv.key().toStringRef()] = kv.value().toTensor();
    start_step = static_cast<int>(state.at("__step__").item<int64_t>());
    state.erase("__step__");
    sm.LoadFullStateDict(state);
    if (std::filesystem::exists(optim_file)) torch::load(opt, optim_file);
    if (rank == 0) std::cout << "resumed from " << dir << " at step " << start_step << std::endl;
  }

  auto evaluate = [&]() {
    at::NoGradGuard no_grad;
    model->eval();
    at::Tensor total = at::zeros({1}, at::kDouble);
    for (int b = 0; b < FLAGS_eval_batches; ++b) {
      auto [x, y] = Batch(corpus.val, b, FLAGS_batch_size, cfg.block_size, rank, world, FLAGS_seed + 7);
      total += examples::GptImpl::Loss(sm.Forward([&] { return model->forward(x); }), y).item<double>();
    }
    world_comm->AllReduce(total, {comm::ReduceOp::kAvg})->Wait();
    model->train();
    return total.item<double>() / FLAGS_eval_batches;
  };
  auto save = [&](int step) {
    if (dir.empty()) return;
    auto full = sm.FullStateDict(/*rank0_only=*/true);
    if (rank == 0) {
      std::filesystem::create_directories(dir);
      c10::Dict<std::string, at::Tensor> d;
      for (auto& [k, v] : full) d.insert(k, v);
      d.insert("__step__", at::tensor({static_cast<int64_t>(step)}));
      auto bytes = torch::pickle_save(d);
      WriteAtomically(dir + "/model.pt", std::string(bytes.begin(), bytes.end()));
    }
    world_comm->Barrier()->Wait();
    torch::save(opt, optim_file + ".tmp");
    std::filesystem::rename(optim_file + ".tmp", optim_file);
  };

  if (rank == 0) {
    std::cout << "ShardTrain GPT: " << cfg.ToString() << ", " << world << " ranks, "
              << sharding::ShardingStrategyName(so.sharding_strategy) << ", " << FLAGS_precision << ", corpus "
              << corpus.train.numel() << "+" << corpus.val.numel() << " chars" << std::endl;
  }
  const double initial_val = evaluate();
  if (rank == 0) std::printf("step %5d | val loss %.4f\n", start_step, initial_val);
  auto t0 = std::chrono::steady_clock::now();
  double last_val = initial_val;
  for (int step = start_step; step < FLAGS_steps; ++step) {
    auto [x, y] = Batch(corpus.train, step, FLAGS_batch_size, cfg.block_size, rank, world, FLAGS_seed);
    opt.zero_grad();
    at::Tensor loss = examples::GptImpl::Loss(sm.Forward([&] { return model->forward(x); }), y);
    loss.backward();
    if (FLAGS_grad_clip > 0) sm.ClipGradNorm(FLAGS_grad_clip);
    opt.step();
    const int done = step + 1;
    if (rank == 0 && (done % FLAGS_log_every == 0 || done == FLAGS_steps)) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double per_step = secs / (done - start_step);
      std::printf("step %5d/%d | loss %.4f | %.0f tok/s | ETA %.0f s\n", done, FLAGS_steps, loss.item<double>(),
                  FLAGS_batch_size * cfg.block_size / per_step, per_step * (FLAGS_steps - done));
      std::fflush(stdout);
    }
    if (done % FLAGS_eval_every == 0 || done == FLAGS_steps) {
      last_val = evaluate();
      if (rank == 0) std::printf("step %5d | val loss %.4f\n", done, last_val);
      save(done);
    }
  }

  // Generation: every rank runs the same sampling (same seed) so the units' gathers line up.
  at::manual_seed(FLAGS_seed);
  model->eval();
  at::Tensor idx = corpus.val.slice(0, 0, 8).unsqueeze(0);
  {
    at::NoGradGuard no_grad;
    for (int i = 0; i < FLAGS_sample_tokens; ++i) {
      at::Tensor cond = idx.size(1) <= cfg.block_size ? idx : idx.slice(1, idx.size(1) - cfg.block_size);
      at::Tensor logits = sm.Forward([&] { return model->forward(cond); }).select(1, cond.size(1) - 1).to(at::kFloat);
      idx = at::cat({idx, at::multinomial(at::softmax(logits / 0.8, -1), 1)}, 1);
    }
  }
  if (rank == 0) {
    std::string sample;
    auto a = idx[0];
    for (int64_t i = 0; i < a.numel(); ++i) sample += corpus.chars[a[i].item<int64_t>()];
    std::printf("validation loss: %.4f -> %.4f\n--- sample ---\n%s\n--------------\n", initial_val, last_val,
                sample.c_str());
  }
  world_comm->Barrier()->Wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("train a character-level GPT with FSDP: train --devices=2 --steps=300");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  int code = 1;
  try {
    code = Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    code = 1;
  }
  if (!std::getenv("SHARDTRAIN_LAUNCHED")) code = shardtrain::JoinLocalRanks(code);
  return code;
}
