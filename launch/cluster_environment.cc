#include "launch/cluster_environment.h"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <sstream>
#include <string_view>
#include <utility>

#include "base/errors.h"

namespace shardtrain {
namespace {

constexpr const char* kDefaultMasterAddr = "127.0.0.1";
constexpr int kDefaultMasterPort = 29500;
constexpr int kSlurmDefaultPort = 12910;   // Lightning's port without SLURM_JOB_ID
constexpr int kSlurmPortOffset = 15000;    // Lightning: int(job_id[-4:]) + 15000
constexpr size_t kMaxExpandedHosts = 1 << 20;

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Strict integer parse of the whole (trimmed) string; no overflow.
std::optional<int> ParseInt(std::string_view s) {
  s = Trim(s);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  if (s.empty()) return std::nullopt;
  int value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size()) return std::nullopt;
  return value;
}

// Reads variables of one environment and reports bad values by name.
class EnvReader {
 public:
  EnvReader(const GetEnvFn& getenv, std::string what) : getenv_(getenv), what_(std::move(what)) {}

  std::optional<std::string> Str(const std::string& name) const { return getenv_(name); }
  bool Has(const std::string& name) const { return getenv_(name).has_value(); }

  std::optional<int> Int(const std::string& name) const {
    auto value = getenv_(name);
    if (!value) return std::nullopt;
    auto parsed = ParseInt(*value);
    ST_CHECK_ARG(parsed.has_value(), name, "='", *value, "' is not an integer (", what_, ")");
    return parsed;
  }

  int RequireInt(const std::string& name) const {
    auto value = Int(name);
    ST_CHECK_ARG(value.has_value(), name, " is not set (", what_, "; it is required there)");
    return *value;
  }

  const std::string& what() const { return what_; }

 private:
  const GetEnvFn& getenv_;
  std::string what_;
};

// Names of the variables (or options) each field came from, for messages.
struct FieldNames {
  std::string rank, world_size, local_rank, local_world_size, node_rank, num_nodes, master_addr,
      master_port;
};

void Validate(const ClusterInfo& c, const FieldNames& n, const std::string& what) {
  auto ctx = [&] { return " (" + what + ")"; };
  ST_CHECK_ARG(c.world_size >= 1, n.world_size, "=", c.world_size, " must be >= 1", ctx());
  ST_CHECK_ARG(c.rank >= 0 && c.rank < c.world_size, n.rank, "=", c.rank, " must be in [0, ",
               n.world_size, "=", c.world_size, ")", ctx());
  ST_CHECK_ARG(c.local_world_size >= 1, n.local_world_size, "=", c.local_world_size, " must be >= 1",
               ctx());
  ST_CHECK_ARG(c.local_world_size <= c.world_size, n.local_world_size, "=", c.local_world_size,
               " must be <= ", n.world_size, "=", c.world_size, ctx());
  ST_CHECK_ARG(c.local_rank >= 0 && c.local_rank < c.local_world_size, n.local_rank, "=", c.local_rank,
               " must be in [0, ", n.local_world_size, "=", c.local_world_size, ")", ctx());
  ST_CHECK_ARG(c.num_nodes >= 1, n.num_nodes, "=", c.num_nodes, " must be >= 1", ctx());
  ST_CHECK_ARG(c.node_rank >= 0 && c.node_rank < c.num_nodes, n.node_rank, "=", c.node_rank,
               " must be in [0, ", n.num_nodes, "=", c.num_nodes, ")", ctx());
  ST_CHECK_ARG(!c.master_addr.empty(), n.master_addr, " is empty", ctx());
  ST_CHECK_ARG(c.master_port >= 1 && c.master_port <= 65535, n.master_port, "=", c.master_port,
               " must be a TCP port in [1, 65535]", ctx());
  ST_CHECK_ARG(c.restart_count >= 0, "TORCHELASTIC_RESTART_COUNT=", c.restart_count, " must be >= 0",
               ctx());
}

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// MASTER_ADDR / MASTER_PORT from the environment, else the defaults.
void MasterFromEnv(const EnvReader& env, ClusterInfo& c) {
  c.master_addr = env.Str("MASTER_ADDR").value_or(kDefaultMasterAddr);
  c.master_port = env.Int("MASTER_PORT").value_or(kDefaultMasterPort);
}

ClusterInfo FromExplicit(const ExplicitClusterOptions& o) {
  ClusterInfo c;
  c.source = "explicit";
  c.rank = o.rank.value_or(0);
  c.world_size = o.world_size.value_or(1);
  c.local_rank = o.local_rank.value_or(c.rank);
  c.local_world_size = o.local_world_size.value_or(c.world_size);
  c.node_rank = o.node_rank.value_or(0);
  c.num_nodes = o.num_nodes.value_or(c.local_world_size > 0 ? CeilDiv(c.world_size, c.local_world_size) : 1);
  c.master_addr = o.master_addr.value_or(kDefaultMasterAddr);
  c.master_port = o.master_port.value_or(kDefaultMasterPort);
  Validate(c,
           {"option rank", "option world_size", "option local_rank", "option local_world_size",
            "option node_rank", "option num_nodes", "option master_addr", "option master_port"},
           "explicit cluster options");
  return c;
}

bool ParseBoolVar(const EnvReader& env, const std::string& name, bool fallback) {
  auto v = env.Str(name);
  if (!v) return fallback;
  std::string s(Trim(*v));
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (s == "true" || s == "1" || s == "yes") return true;
  if (s == "false" || s == "0" || s == "no" || s.empty()) return false;
  ST_THROW(InvalidArgumentError, name, "='", *v, "' is not a boolean (True/False) (", env.what(), ")");
}

// torchrun (--no-python), or anything else that sets RANK / WORLD_SIZE.
ClusterInfo FromTorchrun(const EnvReader& env) {
  ClusterInfo c;
  c.source = "torchrun";
  c.rank = env.RequireInt("RANK");
  c.world_size = env.RequireInt("WORLD_SIZE");
  c.local_rank = env.Int("LOCAL_RANK").value_or(c.rank);
  c.local_world_size = env.Int("LOCAL_WORLD_SIZE").value_or(c.world_size);
  c.node_rank = env.Int("GROUP_RANK").value_or(0);
  std::string num_nodes_name = "GROUP_WORLD_SIZE";
  if (auto n = env.Int("GROUP_WORLD_SIZE")) {
    c.num_nodes = *n;
  } else {
    num_nodes_name = "number of nodes (WORLD_SIZE/LOCAL_WORLD_SIZE)";
    c.num_nodes = c.local_world_size > 0 ? CeilDiv(c.world_size, c.local_world_size) : 1;
  }
  MasterFromEnv(env, c);
  c.agent_store = ParseBoolVar(env, "TORCHELASTIC_USE_AGENT_STORE", false);
  c.restart_count = env.Int("TORCHELASTIC_RESTART_COUNT").value_or(0);
  Validate(c,
           {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", num_nodes_name,
            "MASTER_ADDR", "MASTER_PORT"},
           env.what());
  return c;
}

bool IsSlurmInteractive(const EnvReader& env) {
  auto name = env.Str("SLURM_JOB_NAME");
  return name && (*name == "bash" || *name == "interactive");
}

// SLURM_TASKS_PER_NODE syntax: "2(x3),1" = 2 tasks on each of 3 nodes, then 1.
std::optional<int> TasksOnNode(const std::string& name, const std::string& spec, int node, const std::string& what) {
  int index = 0;
  std::string_view rest(spec);
  auto bad = [&]() -> InvalidArgumentError {
    return InvalidArgumentError(internal::StrCat(name, "='", spec,
                                                 "' is not a SLURM tasks-per-node list like '2(x3),1' (", what, ")"));
  };
  while (!rest.empty()) {
    size_t comma = rest.find(',');
    std::string_view item = Trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    int repeat = 1;
    size_t paren = item.find("(x");
    std::optional<int> tasks;
    if (paren != std::string_view::npos) {
      if (item.back() != ')') throw bad();
      auto r = ParseInt(item.substr(paren + 2, item.size() - paren - 3));
      if (!r || *r < 1) throw bad();
      repeat = *r;
      tasks = ParseInt(item.substr(0, paren));
    } else {
      tasks = ParseInt(item);
    }
    if (!tasks || *tasks < 1) throw bad();
    if (node < index + repeat) return tasks;
    index += repeat;
  }
  return std::nullopt;
}

ClusterInfo FromSlurm(const EnvReader& env) {
  ClusterInfo c;
  c.source = "slurm";
  c.world_size = env.RequireInt("SLURM_NTASKS");
  c.rank = env.RequireInt("SLURM_PROCID");
  c.local_rank = env.RequireInt("SLURM_LOCALID");
  c.node_rank = env.Int("SLURM_NODEID").value_or(0);

  std::string nodelist_name = "SLURM_NODELIST";
  auto nodelist = env.Str("SLURM_NODELIST");
  if (!nodelist) {
    nodelist_name = "SLURM_JOB_NODELIST";
    nodelist = env.Str("SLURM_JOB_NODELIST");
  }
  std::vector<std::string> hosts;
  if (nodelist) {
    try {
      hosts = ExpandSlurmNodeList(*nodelist);
    } catch (const InvalidArgumentError& e) {
      ST_THROW(InvalidArgumentError, nodelist_name, "='", *nodelist, "' is not a valid SLURM node list: ",
               e.what());
    }
  }

  std::string num_nodes_name = "SLURM_NNODES";
  if (auto n = env.Int("SLURM_NNODES")) {
    c.num_nodes = *n;
  } else if (auto jn = env.Int("SLURM_JOB_NUM_NODES")) {
    num_nodes_name = "SLURM_JOB_NUM_NODES";
    c.num_nodes = *jn;
  } else {
    num_nodes_name = "number of hosts in " + nodelist_name;
    c.num_nodes = hosts.empty() ? 1 : static_cast<int>(hosts.size());
  }

  // Tasks on this node: the step's layout, else the job's, else an even split.
  std::string local_ws_name;
  std::optional<int> local_ws;
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    if (auto spec = env.Str(name)) {
      local_ws = TasksOnNode(name, *spec, c.node_rank, env.what());
      if (local_ws) {
        local_ws_name = name;
        break;
      }
    }
  }
  if (!local_ws) {
    if (auto per_node = env.Int("SLURM_NTASKS_PER_NODE")) {
      local_ws = per_node;
      local_ws_name = "SLURM_NTASKS_PER_NODE";
    } else {
      local_ws = c.num_nodes > 0 ? CeilDiv(c.world_size, c.num_nodes) : c.world_size;
      local_ws_name = "tasks per node (SLURM_NTASKS/SLURM_NNODES)";
    }
  }
  c.local_world_size = *local_ws;

  // Lightning: MASTER_ADDR wins, else the first host of the node list.
  if (auto addr = env.Str("MASTER_ADDR")) {
    c.master_addr = *addr;
  } else {
    c.master_addr = hosts.empty() ? kDefaultMasterAddr : hosts.front();
  }
  c.master_port = SlurmMasterPort([&env](const std::string& n) { return env.Str(n); });
  Validate(c,
           {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_ws_name, "SLURM_NODEID", num_nodes_name,
            "master address (MASTER_ADDR or first host of " + nodelist_name + ")",
            "master port (MASTER_PORT or from SLURM_JOB_ID)"},
           env.what());
  return c;
}

// Open MPI and PMI (MPICH / Intel MPI hydra): a node index is not exported, so
// nodes are assumed to hold local_world_size consecutive ranks (by-slot mapping,
// the default of both).
ClusterInfo FromMpiLike(const EnvReader& env, const std::string& source, const std::string& rank_var,
                        const std::string& size_var, const std::string& local_rank_var,
                        const std::string& local_size_var) {
  ClusterInfo c;
  c.source = source;
  c.rank = env.RequireInt(rank_var);
  c.world_size = env.RequireInt(size_var);
  c.local_rank = env.Int(local_rank_var).value_or(c.rank);
  c.local_world_size = env.Int(local_size_var).value_or(c.world_size);
  if (c.local_world_size >= 1) {
    c.num_nodes = CeilDiv(c.world_size, c.local_world_size);
    c.node_rank = c.rank / c.local_world_size;
  }
  // MPI launchers do not export where rank 0 runs: 127.0.0.1 is right only
  // when every rank is on this host.
  ST_CHECK_ARG(env.Str("MASTER_ADDR") || c.local_world_size >= c.world_size, "MASTER_ADDR is not set, but the ",
               source, " job spans more than one host (", local_size_var, "=", c.local_world_size, " < ", size_var,
               "=", c.world_size, "): set MASTER_ADDR to the host name or address of rank 0's node (mpirun -x "
               "MASTER_ADDR=<node0>); the 127.0.0.1 default is valid only on a single host");
  MasterFromEnv(env, c);
  Validate(c,
           {rank_var, size_var, local_rank_var, local_size_var,
            "node index (" + rank_var + "/" + local_size_var + ")",
            "number of nodes (" + size_var + "/" + local_size_var + ")", "MASTER_ADDR", "MASTER_PORT"},
           env.what());
  return c;
}

// Expands one name that may hold several bracket groups; appends to `out`.
void ExpandHost(std::string_view token, std::string prefix, std::vector<std::string>& out) {
  size_t open = token.find('[');
  if (open == std::string_view::npos) {
    ST_CHECK_ARG(token.find(']') == std::string_view::npos, "unbalanced ']' in '", token, "'");
    out.push_back(prefix + std::string(token));
    ST_CHECK_ARG(out.size() <= kMaxExpandedHosts, "node list expands to more than ", kMaxExpandedHosts,
                 " hosts");
    return;
  }
  size_t close = token.find(']', open);
  ST_CHECK_ARG(close != std::string_view::npos, "unbalanced '[' in '", token, "'");
  std::string_view head = token.substr(0, open);
  ST_CHECK_ARG(head.find(']') == std::string_view::npos, "unbalanced ']' in '", token, "'");
  std::string_view inside = token.substr(open + 1, close - open - 1);
  ST_CHECK_ARG(inside.find('[') == std::string_view::npos, "nested '[' in '", token, "'");
  ST_CHECK_ARG(!Trim(inside).empty(), "empty range '[]' in '", token, "'");
  std::string_view tail = token.substr(close + 1);
  std::string base = prefix + std::string(head);

  auto is_digits = [](std::string_view s) {
    if (s.empty()) return false;
    for (char ch : s)
      if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
    return true;
  };
  std::string_view rest = inside;
  while (true) {
    size_t comma = rest.find(',');
    std::string_view item = Trim(rest.substr(0, comma));
    size_t dash = item.find('-');
    std::string_view lo_s = item.substr(0, dash);
    std::string_view hi_s = dash == std::string_view::npos ? lo_s : item.substr(dash + 1);
    ST_CHECK_ARG(is_digits(lo_s) && is_digits(hi_s) && lo_s.size() <= 9 && hi_s.size() <= 9, "bad range '",
                 item, "' in '", token, "' (expected N or N-M with decimal digits)");
    int lo = *ParseInt(lo_s), hi = *ParseInt(hi_s);
    ST_CHECK_ARG(lo <= hi, "range '", item, "' in '", token, "' runs backwards");
    ST_CHECK_ARG(static_cast<size_t>(hi - lo) < kMaxExpandedHosts, "range '", item, "' in '", token,
                 "' is too large");
    size_t width = lo_s.size();  // "01-03" keeps two digits; "8-10" has none to keep
    for (int i = lo; i <= hi; ++i) {
      std::string num = std::to_string(i);
      if (num.size() < width) num.insert(0, width - num.size(), '0');
      ExpandHost(tail, base + num, out);
    }
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
}

}  // namespace

bool ExplicitClusterOptions::any_set() const {
  return rank || world_size || local_rank || local_world_size || node_rank || num_nodes || master_addr ||
         master_port;
}

std::vector<std::string> ExpandSlurmNodeList(const std::string& nodelist) {
  std::vector<std::string> hosts;
  std::string token;
  int depth = 0;
  auto flush = [&] {
    if (!token.empty()) ExpandHost(token, "", hosts);
    token.clear();
  };
  for (char ch : nodelist) {
    if (ch == '[') {
      ST_CHECK_ARG(depth == 0, "nested '[' in node list '", nodelist, "'");
      ++depth;
    } else if (ch == ']') {
      ST_CHECK_ARG(depth == 1, "unbalanced ']' in node list '", nodelist, "'");
      --depth;
    }
    if (depth == 0 && (ch == ',' || std::isspace(static_cast<unsigned char>(ch)))) {
      flush();
    } else {
      token.push_back(ch);
    }
  }
  ST_CHECK_ARG(depth == 0, "unbalanced '[' in node list '", nodelist, "'");
  flush();
  return hosts;
}

int SlurmMasterPort(const GetEnvFn& getenv) {
  EnvReader env(getenv, "SLURM environment");
  if (auto port = env.Int("MASTER_PORT")) return *port;
  auto job_id = env.Str("SLURM_JOB_ID");
  if (!job_id) return kSlurmDefaultPort;
  std::string_view id = Trim(*job_id);
  std::string_view last4 = id.size() > 4 ? id.substr(id.size() - 4) : id;
  auto digits = ParseInt(last4);
  ST_CHECK_ARG(digits.has_value() && *digits >= 0, "SLURM_JOB_ID='", *job_id,
               "' does not end in digits; the master port is derived from its last 4 digits (set "
               "MASTER_PORT to choose one)");
  return *digits + kSlurmPortOffset;
}

ClusterInfo DetectClusterEnvironment(const ExplicitClusterOptions& explicit_opts, const GetEnvFn& getenv) {
  if (explicit_opts.any_set()) return FromExplicit(explicit_opts);

  EnvReader torchrun(getenv, "torchrun environment");
  if (torchrun.Has("RANK") || torchrun.Has("WORLD_SIZE")) return FromTorchrun(torchrun);

  EnvReader slurm(getenv, "SLURM environment");
  if (slurm.Has("SLURM_NTASKS") && !IsSlurmInteractive(slurm)) return FromSlurm(slurm);

  EnvReader mpi(getenv, "Open MPI environment");
  if (mpi.Has("OMPI_COMM_WORLD_RANK") || mpi.Has("OMPI_COMM_WORLD_SIZE")) {
    return FromMpiLike(mpi, "mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                       "OMPI_COMM_WORLD_LOCAL_SIZE");
  }

  EnvReader pmi(getenv, "PMI environment");
  if (pmi.Has("PMI_RANK") || pmi.Has("PMI_SIZE")) {
    return FromMpiLike(pmi, "pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  }

  ClusterInfo single;
  single.source = "single";
  return single;
}

ClusterInfo DetectClusterEnvironment(const ExplicitClusterOptions& explicit_opts) {
  return DetectClusterEnvironment(explicit_opts, [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

std::string ToString(const ClusterInfo& c) {
  std::ostringstream os;
  os << "ClusterInfo{source=" << c.source << ", rank=" << c.rank << "/" << c.world_size
     << ", local_rank=" << c.local_rank << "/" << c.local_world_size << ", node=" << c.node_rank << "/"
     << c.num_nodes << ", master=" << c.master_addr << ":" << c.master_port;
  if (c.source == "torchrun") os << ", agent_store=" << (c.agent_store ? "true" : "false")
                                 << ", restart_count=" << c.restart_count;
  os << "}";
  return os.str();
}

}  // namespace shardtrain
