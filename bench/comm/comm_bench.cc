// comm_bench: all-gather, reduce-scatter and all-reduce through ShardTrain's
// GlooCommunicator at world size W (default 2), one process per rank.
//
// Started without --rank, the binary is rank 0 and re-executes itself for ranks
// 1..W-1 (same flags plus --rank and --master_port), then waits for them. With
// --rank it is one rank of a group started by someone else (all ranks need the
// same --world_size and --master_port).
//
// For every op x dtype x size (size = bytes of the FULL buffer: the all-gather
// output, the reduce-scatter input, the all-reduce tensor): one checked call
// (values compared exactly), --warmup more untimed calls, then timed calls, each
// preceded by a barrier. Rank 0 prints the median time, algorithm bandwidth
// (full bytes / time), bus bandwidth ((W-1)/W x full bytes / time for
// all-gather and reduce-scatter, 2(W-1)/W for all-reduce) and the bytes the
// communicator's stats() counted per call, and writes them as CSV to --out.
// Sizes below --unverified_below_mib are timed a second time on a communicator
// with GlooOptions.verify_calls off (CSV impl "shardtrain_unverified"), to show
// what the per-call signature exchange costs. With --latency_iters=N it also
// times N back-to-back all-reduces of one float32 element on both communicators
// (CSV op "tiny_all_reduce": the per-call latency, and with verify_calls on
// minus off, what the signature check costs). With --self_check (default) it
// first checks edge cases of the collectives bit for bit.
#include <arpa/inet.h>
#include <gflags/gflags.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/comm/self_check.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"

DEFINE_int32(rank, -1, "this process's rank; -1: be rank 0 and start ranks 1..world_size-1 as child processes");
DEFINE_int32(world_size, 2, "number of ranks (processes)");
DEFINE_string(master_addr, "127.0.0.1", "TCPStore address (rank 0 serves it)");
DEFINE_string(gloo_hostname, "",
              "GlooOptions.hostname: address Gloo listens on (empty: the communicator's default, the machine's "
              "hostname, as torch.distributed does)");
DEFINE_int32(master_port, 0, "TCPStore port; 0: pick a free one (only without --rank)");
DEFINE_string(sizes_mib, "1,4,16,64,256", "full-buffer sizes in MiB, comma separated");
DEFINE_string(dtypes, "float32,bfloat16", "dtypes: float32, bfloat16, float16, float64");
DEFINE_string(ops, "all_gather,reduce_scatter,all_reduce", "operations");
DEFINE_int32(warmup, 2, "untimed calls after the checked call");
DEFINE_int32(iters, 9, "timed calls per case from --small_mib to below --large_mib");
DEFINE_int32(small_iters, 25, "timed calls per case below --small_mib");
DEFINE_int32(small_mib, 16, "size (MiB) below which --small_iters applies");
DEFINE_int32(large_iters, 5, "timed calls per case at or above --large_mib");
DEFINE_int32(large_mib, 256, "size (MiB) from which --large_iters applies");
DEFINE_int32(gloo_threads, 2, "GlooOptions.threads");
DEFINE_int32(intra_op_threads, 0, "at::set_num_threads (0: LibTorch's default)");
DEFINE_bool(verify_calls, true, "GlooOptions.verify_calls (the per-call signature check ShardTrain does by default)");
DEFINE_int32(unverified_below_mib, 16,
             "also time sizes below this many MiB on a second communicator with verify_calls=false (0: never)");
DEFINE_string(out, "", "CSV file rank 0 writes (one row per case)");
DEFINE_int32(timeout_s, 300, "collective timeout in seconds");
DEFINE_int32(latency_iters, 0,
             "if > 0: also time this many back-to-back all-reduces of one float32 element (per-call latency)");
DEFINE_bool(self_check, true,
            "before timing, check edge cases bit for bit: in-place all-gather, reduce-scatter into a view of its "
            "input, reduce-scatter and all-reduce SUM/AVG with divide factors on random data against the reference "
            "arithmetic, odd sizes");

namespace {

using shardtrain::comm::CommOp;
using shardtrain::comm::GlooCommunicator;

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

at::ScalarType ParseDtype(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16") return at::kHalf;
  if (s == "float64") return at::kDouble;
  std::cerr << "unknown dtype '" << s << "'\n";
  std::exit(2);
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    perror("finding a free port");
    std::exit(1);
  }
  const int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Case {
  std::string op;
  std::string dtype;
  int64_t full_bytes;
};

// Runs one op once and waits.
void RunOnce(GlooCommunicator& c, const std::string& op, const at::Tensor& shard, const at::Tensor& full) {
  if (op == "all_gather") {
    c.AllGather(shard, full)->Wait();
  } else if (op == "reduce_scatter") {
    c.ReduceScatter(full, shard)->Wait();
  } else {
    c.AllReduce(full)->Wait();
  }
}

// One exact-valued call: returns false (and says why) on a wrong result.
bool CheckedCall(GlooCommunicator& c, const std::string& op, const at::Tensor& shard, const at::Tensor& full) {
  const int w = c.size(), r = c.rank();
  const int64_t n = shard.numel();
  const double tri = w * (w + 1) / 2.0;  // sum over ranks of (rank + 1)
  bool ok = true;
  if (op == "all_gather") {
    shard.fill_(r + 1);
    full.fill_(-1);
    RunOnce(c, op, shard, full);
    for (int b = 0; b < w; ++b) ok = ok && full.narrow(0, b * n, n).eq(b + 1).all().item<bool>();
  } else if (op == "reduce_scatter") {
    // Block j of rank r's input holds (r+1)*(j+1): block j of the sum is (j+1)*tri.
    at::Tensor blocks = full.view({w, n});
    for (int b = 0; b < w; ++b) blocks[b].fill_((r + 1) * (b + 1));
    shard.fill_(-1);
    RunOnce(c, op, shard, full);
    ok = shard.eq((r + 1) * tri).all().item<bool>();
  } else {
    full.fill_(r + 1);
    RunOnce(c, op, shard, full);
    ok = full.eq(tri).all().item<bool>();
  }
  if (!ok) std::cerr << "rank " << r << ": WRONG RESULT for " << op << " " << full.scalar_type() << "\n";
  return ok;
}

// Times one case on `comm` and prints / writes a row named `impl`. False if
// the checked call gave a wrong result.
bool TimeCase(GlooCommunicator& comm, const Case& cs, const std::string& impl, std::ofstream* csv) {
  const int w = comm.size();
  const bool leader = comm.rank() == 0;
  const at::ScalarType dtype = ParseDtype(cs.dtype);
  const int64_t full_numel = cs.full_bytes / c10::elementSize(dtype);
  at::Tensor full = at::empty({full_numel}, dtype);
  at::Tensor shard = at::empty({full_numel / w}, dtype);
  const bool ok = CheckedCall(comm, cs.op, shard, full);
  for (int i = 0; i < FLAGS_warmup; ++i) RunOnce(comm, cs.op, shard, full);
  if (cs.op == "all_reduce") full.fill_(1);  // keep repeated in-place sums finite
  const int64_t mib = cs.full_bytes >> 20;
  const int iters = mib >= FLAGS_large_mib   ? FLAGS_large_iters
                    : mib < FLAGS_small_mib ? FLAGS_small_iters
                                            : FLAGS_iters;
  std::vector<double> ms;
  comm.ResetStats();
  for (int i = 0; i < iters; ++i) {
    comm.Barrier()->Wait();
    const auto t0 = std::chrono::steady_clock::now();
    RunOnce(comm, cs.op, shard, full);
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  const CommOp cop = cs.op == "all_gather"       ? CommOp::kAllGather
                     : cs.op == "reduce_scatter" ? CommOp::kReduceScatter
                                                 : CommOp::kAllReduce;
  const int64_t sent = comm.stats().BytesSent(cop) / iters;
  const double bus_factor = cs.op == "all_reduce" ? 2.0 * (w - 1) / w : double(w - 1) / w;
  const int64_t expected = static_cast<int64_t>(bus_factor * cs.full_bytes);
  const double med = Median(ms), mn = *std::min_element(ms.begin(), ms.end());
  const double algbw = cs.full_bytes / (med * 1e-3) / 1e9;
  if (leader) {
    std::printf("%-15s %-9s %6lldMiB %5d %10.2f %10.2f %10.3f %10.3f %14lld%s%s\n", cs.op.c_str(), cs.dtype.c_str(),
                static_cast<long long>(mib), iters, med, mn, algbw, algbw * bus_factor, static_cast<long long>(sent),
                sent == expected ? "" : " (!= theory)", impl == "shardtrain" ? "" : ("  [" + impl + "]").c_str());
    std::fflush(stdout);
    if (csv) {
      *csv << impl << "," << cs.op << "," << cs.dtype << "," << cs.full_bytes << "," << w << "," << iters << "," << med
           << "," << mn << "," << algbw << "," << algbw * bus_factor << "," << sent << "," << expected << "\n";
      csv->flush();
    }
  }
  return ok;
}

// Back-to-back all-reduces of one float32 element (zeros, so the sums stay
// put): rank 0 prints and writes the median per-call latency.
void TimeLatency(GlooCommunicator& comm, const std::string& impl, std::ofstream* csv) {
  at::Tensor t = at::zeros({1}, at::kFloat);
  for (int i = 0; i < 20; ++i) comm.AllReduce(t)->Wait();
  comm.Barrier()->Wait();
  std::vector<double> ms;
  comm.ResetStats();
  for (int i = 0; i < FLAGS_latency_iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    comm.AllReduce(t)->Wait();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (comm.rank() != 0) return;
  const int w = comm.size();
  const double med = Median(ms), mn = *std::min_element(ms.begin(), ms.end());
  const int64_t sent = comm.stats().BytesSent(CommOp::kAllReduce) / FLAGS_latency_iters;
  std::printf("%-15s %-9s %9s %5d %10.3f %10.3f   (per-call latency)%s\n", "tiny_all_reduce", "float32", "4B",
              FLAGS_latency_iters, med, mn, impl == "shardtrain" ? "" : ("  [" + impl + "]").c_str());
  std::fflush(stdout);
  if (csv) {
    *csv << impl << ",tiny_all_reduce,float32,4," << w << "," << FLAGS_latency_iters << "," << med << "," << mn
         << ",0,0," << sent << "," << static_cast<int64_t>(2.0 * (w - 1) / w * 4) << "\n";
    csv->flush();
  }
}

int RunRank() {
  using namespace shardtrain::comm;
  if (FLAGS_intra_op_threads > 0) at::set_num_threads(FLAGS_intra_op_threads);
  RendezvousOptions ro;
  ro.kind = "tcp";
  ro.rank = FLAGS_rank;
  ro.world_size = FLAGS_world_size;
  ro.master_addr = FLAGS_master_addr;
  ro.master_port = FLAGS_master_port;
  ro.timeout = std::chrono::seconds(FLAGS_timeout_s);
  auto store = CreateStore(ro);
  GlooOptions go;
  go.timeout = std::chrono::seconds(FLAGS_timeout_s);
  go.hostname = FLAGS_gloo_hostname;
  go.threads = FLAGS_gloo_threads;
  go.verify_calls = FLAGS_verify_calls;
  auto comm = GlooCommunicator::Create(store, FLAGS_rank, FLAGS_world_size, go);
  // The same group without the per-call signature exchange, for small sizes
  // (and the latency) where that extra round trip is a visible part of the time.
  std::shared_ptr<GlooCommunicator> unverified;
  if (FLAGS_verify_calls && (FLAGS_unverified_below_mib > 0 || FLAGS_latency_iters > 0)) {
    GlooOptions uo = go;
    uo.verify_calls = false;
    uo.name = "unverified";
    unverified = GlooCommunicator::Create(c10::make_intrusive<c10d::PrefixStore>("unverified", store), FLAGS_rank,
                                          FLAGS_world_size, uo);
  }
  const int w = comm->size();
  const bool leader = comm->rank() == 0;

  std::vector<Case> cases;
  for (const auto& op : Split(FLAGS_ops))
    for (const auto& dt : Split(FLAGS_dtypes))
      for (const auto& mib : Split(FLAGS_sizes_mib)) {
        cases.push_back({op, dt, std::stoll(mib) << 20});
        const int64_t numel = cases.back().full_bytes / c10::elementSize(ParseDtype(dt));
        if (numel % w != 0) {
          std::cerr << "size " << mib << " MiB of " << dt << " is not a multiple of W elements\n";
          return 2;
        }
      }

  std::unique_ptr<std::ofstream> csv;
  if (leader && !FLAGS_out.empty()) {
    csv = std::make_unique<std::ofstream>(FLAGS_out);
    *csv << "impl,op,dtype,size_bytes,world_size,iters,median_ms,min_ms,algbw_gbps,busbw_gbps,bytes_sent_per_call,"
            "expected_bytes_per_call\n";
  }
  if (leader) {
    std::printf("# shardtrain comm_bench: W=%d, gloo threads %d, intra-op threads %d, verify_calls %d\n", w,
                FLAGS_gloo_threads, at::get_num_threads(), FLAGS_verify_calls ? 1 : 0);
    std::printf("%-15s %-9s %9s %5s %10s %10s %10s %10s %14s\n", "op", "dtype", "size", "iters", "median_ms",
                "min_ms", "algbw_GB/s", "busbw_GB/s", "bytes_sent");
  }
  bool all_ok = true;
  if (FLAGS_self_check) {
    const bool ok = shardtrain::bench::SelfCheck(*comm);
    all_ok = ok && all_ok;
    if (leader) {
      std::printf("# self-check (edge cases, bit-exact reduce-scatter arithmetic): %s\n", ok ? "ok" : "FAILED");
    }
  }
  if (FLAGS_latency_iters > 0) {
    TimeLatency(*comm, "shardtrain", csv.get());
    if (unverified) TimeLatency(*unverified, "shardtrain_unverified", csv.get());
  }
  for (const auto& cs : cases) {
    all_ok = TimeCase(*comm, cs, "shardtrain", csv.get()) && all_ok;
    if (unverified && (cs.full_bytes >> 20) < FLAGS_unverified_below_mib)
      all_ok = TimeCase(*unverified, cs, "shardtrain_unverified", csv.get()) && all_ok;
  }
  comm->Barrier()->Wait();
  return all_ok ? 0 : 3;
}

// Rank 0 of a self-started group: re-executes this binary for ranks 1..W-1.
int SpawnAndRun(int argc, char** argv) {
  if (FLAGS_master_port == 0) FLAGS_master_port = FreePort();
  std::vector<pid_t> children;
  for (int r = 1; r < FLAGS_world_size; ++r) {
    std::vector<std::string> args(argv, argv + argc);
    args.push_back("--rank=" + std::to_string(r));
    args.push_back("--master_port=" + std::to_string(FLAGS_master_port));
    args.push_back("--out=");
    std::vector<char*> cargs;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return 1;
    }
    if (pid == 0) {
      execv("/proc/self/exe", cargs.data());
      perror("execv");
      _exit(127);
    }
    children.push_back(pid);
  }
  FLAGS_rank = 0;
  int rc = 0;
  try {
    rc = RunRank();
  } catch (const std::exception& e) {
    std::cerr << "rank 0 failed: " << e.what() << "\n";
    rc = 1;
  }
  if (rc != 0)
    for (pid_t pid : children) kill(pid, SIGTERM);
  for (size_t i = 0; i < children.size(); ++i) {
    int status = 0;
    waitpid(children[i], &status, 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      std::cerr << "rank " << i + 1 << " failed (status " << status << ")\n";
      if (rc == 0) rc = 1;
    }
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("comm_bench: ShardTrain Gloo collectives at W ranks (see bench/comm/run.sh)");
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/false);
  if (FLAGS_rank < 0) return SpawnAndRun(argc, argv);
  try {
    return RunRank();
  } catch (const std::exception& e) {
    std::cerr << "rank " << FLAGS_rank << " failed: " << e.what() << "\n";
    return 1;
  }
}
