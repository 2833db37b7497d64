// One rank of tests/launch/process_test.sh: a real process that finds its place
// in the job with DetectClusterEnvironment (torchrun, shardtrain_launch, ...),
// joins the rendezvous store with comm::CreateStore (under torchrun's agent
// store every rank is a TCPStore client under /worker/attempt_<restart count>),
// connects a GlooCommunicator over 127.0.0.1 and checks every collective in
// float32 and bfloat16, values exactly.
//
//   collective_worker [--timeout_ms=MS] [--rendezvous=tcp|file|hash] [--file_path=P]
//                     [--die_rank=K | --stall_rank=K] [--die_after_ms=T] [--loop_ms=MS]
//                     [--defer_sigterm] [--fail_attempt=N] [--status_dir=DIR]
//                     [--stop_rank=K] [--heartbeat_ms=MS] [--stall_warning_ms=MS] [--stall_timeout_ms=MS]
//
// Prints "rank R/W ok (...)" and exits 0 when every check passed.
// With --die_rank=K, every rank instead runs collectives in a loop; rank K kills
// itself with SIGKILL T ms into the loop (from another thread, so mid-
// collective). Survivors print "rank R/W: CommError ... failed_after_fault_ms=N:
// <message>" to stderr and exit 3. --stall_rank=K: rank K stays alive but stops
// issuing collectives after T ms (until SIGTERM, then it exits 143), so the
// survivors' collectives time out. --defer_sigterm makes a survivor note and
// ignore the launcher's SIGTERM, so the test sees how the communicator itself
// fails rather than the launcher's clean-up. --fail_attempt=N: under torchrun,
// the last rank exits 7 after connecting when TORCHELASTIC_RESTART_COUNT is N
// (tests the agent store's per-attempt key prefix). --status_dir: writes the
// exit code, after the communicator is torn down, to DIR/rank_<R>.exit, and
// the rank's pid to DIR/rank_<R>.pid at start. --stop_rank=K: every rank runs
// collectives in a loop for --loop_ms; rank K stops itself with SIGSTOP after
// --die_after_ms (the test continues or kills it), printing how many
// collectives it had issued just before (N: the count its peers' stall report
// must name, exactly or one or two more); exits 0 if no error was seen. --heartbeat_ms, --stall_warning_ms, --stall_timeout_ms set the
// GlooOptions of the same names.
//
// Exit codes: 0 ok; 1 a value check failed; 2 bad flag or InvalidArgumentError;
// 3 CommError; 4 --die_rank/--stall_rank given but no error seen within
// --loop_ms; 5 other error; 7 --fail_attempt; 143 stalled rank terminated.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <signal.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"

namespace shardtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  int timeout_ms = 30000;
  std::string rendezvous = "tcp";
  std::string file_path;
  int die_rank = -1;
  int stall_rank = -1;
  int fail_attempt = -1;
  std::string status_dir;
  int die_after_ms = 500;
  int loop_ms = 30000;
  bool defer_sigterm = false;
  int stop_rank = -1;
  int heartbeat_ms = -1;       // -1: GlooOptions' defaults
  int stall_warning_ms = -1;
  int stall_timeout_ms = -1;
};

int ParseInt(const std::string& name, const std::string& value) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  ST_CHECK_ARG(!value.empty() && *end == '\0' && v >= -1 && v <= 1000000000, "collective_worker: --", name, "='",
               value, "' is not an integer");
  return static_cast<int>(v);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    ST_CHECK_ARG(arg.rfind("--", 0) == 0, "collective_worker: unexpected argument '", arg, "'");
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (name == "timeout_ms") {
      f.timeout_ms = ParseInt(name, value);
    } else if (name == "rendezvous") {
      f.rendezvous = value;
    } else if (name == "file_path") {
      f.file_path = value;
    } else if (name == "die_rank") {
      f.die_rank = ParseInt(name, value);
    } else if (name == "die_after_ms") {
      f.die_after_ms = ParseInt(name, value);
    } else if (name == "stall_rank") {
      f.stall_rank = ParseInt(name, value);
    } else if (name == "fail_attempt") {
      f.fail_attempt = ParseInt(name, value);
    } else if (name == "status_dir") {
      f.status_dir = value;
    } else if (name == "loop_ms") {
      f.loop_ms = ParseInt(name, value);
    } else if (name == "defer_sigterm") {
      f.defer_sigterm = true;
    } else if (name == "stop_rank") {
      f.stop_rank = ParseInt(name, value);
    } else if (name == "heartbeat_ms") {
      f.heartbeat_ms = ParseInt(name, value);
    } else if (name == "stall_warning_ms") {
      f.stall_warning_ms = ParseInt(name, value);
    } else if (name == "stall_timeout_ms") {
      f.stall_timeout_ms = ParseInt(name, value);
    } else {
      ST_THROW(InvalidArgumentError, "collective_worker: unknown flag --", name,
               "; valid: --timeout_ms, --rendezvous, --file_path, --die_rank, --stall_rank, --die_after_ms, "
               "--loop_ms, --defer_sigterm, --fail_attempt, --status_dir, --stop_rank, --heartbeat_ms, "
               "--stall_warning_ms, --stall_timeout_ms");
    }
  }
  ST_CHECK_ARG(f.timeout_ms > 0, "collective_worker: --timeout_ms must be > 0");
  ST_CHECK_ARG(f.die_rank < 0 || f.stall_rank < 0, "collective_worker: --die_rank and --stall_rank exclude each other");
  return f;
}

// Small integers: exact in float32 and bfloat16, and so are their sums over
// up to 4 ranks (<= 4 * 38) and halves of those sums.
at::Tensor Pattern(int64_t n, int rank, at::ScalarType dtype) {
  return (at::arange(n, at::kDouble).remainder(7) + 1 + 10 * rank).to(dtype);
}

int g_failures = 0;
int g_rank = -1;
std::string g_status_dir;
char g_rank_text[64] = "rank ?";

void Check(bool ok, const std::string& what) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "%s: CHECK FAILED: %s\n", g_rank_text, what.c_str());
}

std::string Label(const char* op, at::ScalarType dtype, int64_t n) {
  return internal::StrCat(op, " ", c10::toString(dtype), " n=", n);
}

// Every collective once, values checked exactly; also the bytes CommStats counts.
void CheckCollectives(Communicator& comm, at::ScalarType dtype, int64_t n) {
  const int W = comm.size(), R = comm.rank();
  const int64_t elem = c10::elementSize(dtype);

  comm.ResetStats();
  at::Tensor shard = Pattern(n, R, dtype), full = at::empty({W * n}, dtype);
  comm.AllGather(shard, full)->Wait();
  for (int r = 0; r < W; ++r) {
    Check(at::equal(full.slice(0, r * n, (r + 1) * n), Pattern(n, r, dtype)),
          Label("AllGather", dtype, n) + " block " + std::to_string(r));
  }
  Check(comm.stats().BytesSent(CommOp::kAllGather) == (W - 1) * n * elem, Label("AllGather bytes", dtype, n));

  for (double post : {1.0, 2.0}) {
    at::Tensor input = Pattern(W * n, R, dtype), out = at::empty({n}, dtype);
    ReduceOptions o;
    o.post_divide = post;
    comm.ReduceScatter(input, out, o)->Wait();
    at::Tensor expected = at::zeros({n}, at::kDouble);
    for (int r = 0; r < W; ++r) expected += Pattern(W * n, r, at::kDouble).slice(0, R * n, (R + 1) * n);
    expected /= post;
    Check(at::equal(out, expected.to(dtype)), Label("ReduceScatter", dtype, n) + " post_divide=" + std::to_string(post));
  }
  Check(comm.stats().BytesSent(CommOp::kReduceScatter) == 2 * (W - 1) * n * elem,
        Label("ReduceScatter bytes", dtype, n));

  at::Tensor t = Pattern(n, R, dtype);
  comm.AllReduce(t)->Wait();
  at::Tensor sum = at::zeros({n}, at::kDouble);
  for (int r = 0; r < W; ++r) sum += Pattern(n, r, at::kDouble);
  Check(at::equal(t, sum.to(dtype)), Label("AllReduce SUM", dtype, n));
  t = Pattern(n, R, dtype);
  comm.AllReduce(t, {ReduceOp::kMax})->Wait();
  Check(at::equal(t, Pattern(n, W - 1, dtype)), Label("AllReduce MAX", dtype, n));

  for (int root : {W - 1, 0}) {
    t = Pattern(n, R, dtype);
    comm.Broadcast(t, root)->Wait();
    Check(at::equal(t, Pattern(n, root, dtype)), Label("Broadcast", dtype, n) + " root " + std::to_string(root));
  }
  comm.Barrier()->Wait();
}

std::string ToString(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// Under torchrun's agent store: rank 0 writes a key through the store
// CreateStore returned; every rank then reads it back through a raw client of
// the agent's TCPStore under /worker/attempt_<restart count>/, and finds the
// keys earlier attempts wrote under their own prefixes (a restarted job
// rendezvouses in a fresh namespace of the same store).
void CheckAgentStorePrefix(c10d::Store& store, const ClusterInfo& info, Communicator& comm,
                           std::chrono::milliseconds timeout) {
  const std::string key = "collective_worker/attempt", mine = std::to_string(info.restart_count);
  if (info.rank == 0) store.set(key, std::vector<uint8_t>(mine.begin(), mine.end()));
  comm.Barrier()->Wait();
  Check(ToString(store.get(key)) == mine, "agent store: key read back through the prefixed store");
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(info.master_port);
  o.isServer = false;
  o.timeout = timeout;
  c10d::TCPStore raw(info.master_addr, o);
  for (int a = 0; a <= info.restart_count; ++a) {
    const std::string full = "/worker/attempt_" + std::to_string(a) + "/" + key;
    const bool present = raw.check({full});
    Check(present, "agent store: key " + full + " missing");
    if (present) Check(ToString(raw.get(full)) == std::to_string(a), "agent store: wrong value under " + full);
  }
}

volatile sig_atomic_t g_sigterm_seen = 0;

void OnSigterm(int) {
  g_sigterm_seen = 1;
  const char msg[] = "collective_worker: SIGTERM received (handled, not fatal: --defer_sigterm or --stall_rank)\n";
  ssize_t ignored = write(STDERR_FILENO, msg, sizeof(msg) - 1);
  (void)ignored;
}

// Collectives in a loop until rank `die_rank` dies (SIGKILL from a timer
// thread) or rank `stall_rank` stops, and this rank's collective fails with
// CommError (propagates). Returns normally only if no error was seen within loop_ms.
// Collectives this rank has issued (each counted once its call returned).
std::atomic<int64_t> g_issued{0};

int64_t CallsSoFar(const Communicator& comm) {
  int64_t n = 0;
  for (int64_t c : comm.stats().calls) n += c;
  return n;
}

void LoopUntilPeerFails(Communicator& comm, const Flags& flags) {
  const int W = comm.size(), R = comm.rank();
  const int64_t n = 1 << 18;  // 1 MiB of float32 per shard: ranks are mid-collective most of the time
  at::Tensor shard = Pattern(n, R, at::kFloat), full = at::empty({W * n}, at::kFloat);
  at::Tensor out = at::empty({n}, at::kFloat), t = Pattern(n, R, at::kFloat);
  comm.Barrier()->Wait();
  g_issued = CallsSoFar(comm);
  // Issues one collective (the count goes up once its call returned, so a
  // stop can only find the communicator's count equal to it or one above).
  auto issue = [](WorkPtr w) {
    g_issued.fetch_add(1);
    return w;
  };
  const auto start = Clock::now();
  if (R == flags.stop_rank) {
    std::thread([delay = flags.die_after_ms, text = std::string(g_rank_text)] {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
      std::fprintf(stderr, "%s: stopping myself with SIGSTOP now (--stop_rank), %lld collectives issued\n",
                   text.c_str(), static_cast<long long>(g_issued.load()));
      std::fflush(stderr);
      raise(SIGSTOP);
      std::fprintf(stderr, "%s: continued after SIGSTOP\n", text.c_str());
      std::fflush(stderr);
    }).detach();
  }
  if (R == flags.die_rank) {
    std::thread([delay = flags.die_after_ms, text = std::string(g_rank_text)] {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
      std::fprintf(stderr, "%s: killing myself with SIGKILL now (--die_rank)\n", text.c_str());
      std::fflush(stderr);
      raise(SIGKILL);
    }).detach();
  }
  int64_t iteration = 0;
  try {
    // The ranks agree when the loop ends (each one's clock says whether it
    // wants another iteration; MIN over the group): ended on its own clock
    // alone, a rank could leave while its peer starts one more collective.
    auto another_iteration = [&] {
      at::Tensor go = at::zeros({1}, at::kLong);
      go.data_ptr<int64_t>()[0] = Clock::now() - start < std::chrono::milliseconds(flags.loop_ms) ? 1 : 0;
      issue(comm.AllReduce(go, ReduceOptions{ReduceOp::kMin}))->Wait();
      return go.data_ptr<int64_t>()[0] == 1;
    };
    while (another_iteration()) {
      if (R == flags.stall_rank && Clock::now() - start >= std::chrono::milliseconds(flags.die_after_ms)) {
        std::fprintf(stderr, "%s: stalling after %lld iterations (--stall_rank)\n", g_rank_text,
                     static_cast<long long>(iteration));
        std::fflush(stderr);
        while (!g_sigterm_seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        std::fprintf(stderr, "%s: stalled rank terminated\n", g_rank_text);
        std::fflush(stderr);
        std::_Exit(143);
      }
      issue(comm.AllGather(shard, full))->Wait();
      issue(comm.ReduceScatter(full, out))->Wait();
      issue(comm.AllReduce(t))->Wait();
      issue(comm.Broadcast(t, static_cast<int>(iteration % W)))->Wait();
      ++iteration;
    }
  } catch (const CommError& e) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    std::fprintf(stderr, "%s: CommError in iteration %lld after %lld ms, failed_after_fault_ms=%lld: %s\n", g_rank_text,
                 static_cast<long long>(iteration), static_cast<long long>(ms),
                 static_cast<long long>(ms - flags.die_after_ms), e.what());
    std::fflush(stderr);
    throw;
  }
  std::fprintf(stderr, "%s: no error within --loop_ms=%d (%lld iterations)\n", g_rank_text, flags.loop_ms,
               static_cast<long long>(iteration));
}

// Everything but the error reporting; `comm` outlives the catch blocks in Main,
// so a failure is printed before the communicator is torn down.
int Run(int argc, char** argv, std::shared_ptr<GlooCommunicator>& comm) {
  const Flags flags = ParseFlags(argc, argv);
  g_status_dir = flags.status_dir;
  const ClusterInfo info = DetectClusterEnvironment();
  g_rank = info.rank;
  if (!g_status_dir.empty()) {
    const std::string path = g_status_dir + "/rank_" + std::to_string(info.rank) + ".pid";
    if (std::FILE* f = std::fopen(path.c_str(), "w")) {
      std::fprintf(f, "%d\n", static_cast<int>(getpid()));
      std::fclose(f);
    }
  }
  std::snprintf(g_rank_text, sizeof(g_rank_text), "rank %d/%d", info.rank, info.world_size);
  if (flags.defer_sigterm || info.rank == flags.stall_rank) signal(SIGTERM, OnSigterm);
  ST_CHECK_ARG(flags.die_rank < info.world_size && flags.stall_rank < info.world_size,
               "collective_worker: --die_rank/--stall_rank must be a rank of this world of ", info.world_size);

  RendezvousOptions ro = shardtrain::RendezvousOptionsFor(info);
  ro.kind = flags.rendezvous;
  ro.file_path = flags.file_path;
  ro.timeout = std::chrono::milliseconds(flags.timeout_ms);
  auto store = CreateStore(ro);

  GlooOptions go;
  go.hostname = "127.0.0.1";
  go.timeout = std::chrono::milliseconds(flags.timeout_ms);
  if (flags.heartbeat_ms >= 0) go.heartbeat_period = std::chrono::milliseconds(flags.heartbeat_ms);
  if (flags.stall_warning_ms >= 0) go.stall_warning = std::chrono::milliseconds(flags.stall_warning_ms);
  if (flags.stall_timeout_ms >= 0) go.stall_timeout = std::chrono::milliseconds(flags.stall_timeout_ms);
  comm = GlooCommunicator::Create(store, info.rank, info.world_size, go);
  Check(comm->rank() == info.rank && comm->size() == info.world_size, "communicator rank/size");
  if (info.agent_store) CheckAgentStorePrefix(*store, info, *comm, ro.timeout);

  if (info.restart_count == flags.fail_attempt) {
    comm->Barrier()->Wait();  // every rank of this attempt has connected through the store
  }
  if (info.restart_count == flags.fail_attempt && info.rank == info.world_size - 1) {
    std::fprintf(stderr, "%s: failing attempt %d on purpose (--fail_attempt)\n", g_rank_text, info.restart_count);
    std::fflush(stderr);
    std::_Exit(7);
  }
  if (flags.die_rank >= 0 || flags.stall_rank >= 0 || flags.stop_rank >= 0) {
    LoopUntilPeerFails(*comm, flags);
    return flags.stop_rank >= 0 ? 0 : 4;
  }
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t n : {int64_t{13}, int64_t{(1 << 17) + 5}}) CheckCollectives(*comm, dtype, n);
  }
  if (g_failures > 0) {
    std::fprintf(stderr, "%s: %d checks failed\n", g_rank_text, g_failures);
    return 1;
  }
  std::printf("%s ok (source=%s agent_store=%d restart_count=%d master=%s:%d%s)\n", g_rank_text, info.source.c_str(),
              info.agent_store ? 1 : 0, info.restart_count, info.master_addr.c_str(), info.master_port,
              info.agent_store ? " agent_store_prefix_checked" : "");
  std::fflush(stdout);
  return 0;
}

int Main(int argc, char** argv) {
  std::shared_ptr<GlooCommunicator> comm;
  int code = 0;
  try {
    code = Run(argc, argv, comm);
  } catch (const InvalidArgumentError& e) {
    std::fprintf(stderr, "%s: invalid argument: %s\n", g_rank_text, e.what());
    code = 2;
  } catch (const CommError& e) {
    std::fprintf(stderr, "%s: CommError: %s\n", g_rank_text, e.what());
    code = 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", g_rank_text, e.what());
    code = 5;
  }
  std::fflush(stderr);
  comm.reset();
  if (!g_status_dir.empty()) {
    const std::string path = g_status_dir + "/rank_" + std::to_string(g_rank) + ".exit";
    if (std::FILE* f = std::fopen(path.c_str(), "w")) {
      std::fprintf(f, "%d\n", code);
      std::fclose(f);
    }
  }
  return code;
}

}  // namespace
}  // namespace shardtrain::comm

int main(int argc, char** argv) { return shardtrain::comm::Main(argc, argv); }
