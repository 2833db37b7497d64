// Cluster environments from synthetic environments: each launcher's variables,
// precedence between them, SLURM node lists and ports, and bad values.
#include "launch/cluster_environment.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "base/errors.h"

namespace shardtrain {
namespace {

using Env = std::map<std::string, std::string>;

GetEnvFn FromMap(const Env& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

ClusterInfo Detect(const Env& env, const ExplicitClusterOptions& opts = {}) {
  return DetectClusterEnvironment(opts, FromMap(env));
}

// Expects InvalidArgumentError whose message contains every one of `needles`.
void ExpectInvalid(const Env& env, std::initializer_list<std::string> needles,
                   const ExplicitClusterOptions& opts = {}) {
  try {
    ClusterInfo info = Detect(env, opts);
    ADD_FAILURE() << "expected InvalidArgumentError, got " << ToString(info);
  } catch (const InvalidArgumentError& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

Env Torchrun() {
  return {{"RANK", "5"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "1"},
          {"GROUP_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29400"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_RUN_ID", "abc"}};
}

Env Slurm() {
  return {{"SLURM_PROCID", "5"},     {"SLURM_LOCALID", "1"},  {"SLURM_NTASKS", "8"},
          {"SLURM_NODEID", "1"},     {"SLURM_NNODES", "2"},   {"SLURM_NODELIST", "node[07-08]"},
          {"SLURM_JOB_ID", "1234567"}, {"SLURM_JOB_NAME", "train"}, {"SLURM_TASKS_PER_NODE", "4(x2)"}};
}

Env OpenMpi() {
  return {{"OMPI_COMM_WORLD_RANK", "6"},
          {"OMPI_COMM_WORLD_SIZE", "8"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
          {"MASTER_ADDR", "node0"}};
}

Env Pmi() {
  return {{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"},
          {"MASTER_ADDR", "node0"}};
}

Env Merge(Env a, const Env& b) {
  for (const auto& [k, v] : b) a[k] = v;
  return a;
}

TEST(ClusterEnvironmentTest, SingleProcessWhenNothingIsSet) {
  ClusterInfo c = Detect({{"HOME", "/root"}, {"LOCAL_RANK", "3"}});
  EXPECT_EQ(c.source, "single");
  EXPECT_EQ(c.rank, 0);
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.local_rank, 0);
  EXPECT_EQ(c.local_world_size, 1);
  EXPECT_EQ(c.node_rank, 0);
  EXPECT_EQ(c.num_nodes, 1);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.master_port, 29500);
  EXPECT_FALSE(c.agent_store);
  EXPECT_EQ(c.restart_count, 0);
}

TEST(ClusterEnvironmentTest, Torchrun) {
  ClusterInfo c = Detect(Torchrun());
  EXPECT_EQ(c.source, "torchrun");
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "10.0.0.1");
  EXPECT_EQ(c.master_port, 29400);
  EXPECT_TRUE(c.agent_store);
  EXPECT_EQ(c.restart_count, 2);
}

TEST(ClusterEnvironmentTest, TorchrunAgentStoreFalseAndDefaults) {
  ClusterInfo c = Detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_EQ(c.source, "torchrun");
  EXPECT_FALSE(c.agent_store);
  EXPECT_EQ(c.local_rank, 1);  // one node: local = global
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.node_rank, 0);
  EXPECT_EQ(c.num_nodes, 1);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.master_port, 29500);
  EXPECT_EQ(c.restart_count, 0);
}

TEST(ClusterEnvironmentTest, TorchrunNumNodesWithoutGroupWorldSize) {
  Env env = Torchrun();
  env.erase("GROUP_WORLD_SIZE");
  EXPECT_EQ(Detect(env).num_nodes, 2);
}

TEST(ClusterEnvironmentTest, TorchrunMissingWorldSize) {
  ExpectInvalid({{"RANK", "0"}}, {"WORLD_SIZE", "not set"});
}

TEST(ClusterEnvironmentTest, TorchrunBadValues) {
  ExpectInvalid(Merge(Torchrun(), {{"RANK", "abc"}}), {"RANK", "'abc'", "not an integer"});
  ExpectInvalid(Merge(Torchrun(), {{"RANK", "8"}}), {"RANK=8", "WORLD_SIZE=8"});
  ExpectInvalid(Merge(Torchrun(), {{"RANK", "-1"}}), {"RANK=-1"});
  ExpectInvalid(Merge(Torchrun(), {{"WORLD_SIZE", "0"}}), {"WORLD_SIZE=0"});
  ExpectInvalid(Merge(Torchrun(), {{"WORLD_SIZE", "99999999999"}}), {"WORLD_SIZE", "'99999999999'"});
  ExpectInvalid(Merge(Torchrun(), {{"LOCAL_RANK", "4"}}), {"LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"});
  ExpectInvalid(Merge(Torchrun(), {{"LOCAL_WORLD_SIZE", "2x"}}), {"LOCAL_WORLD_SIZE", "'2x'"});
  ExpectInvalid(Merge(Torchrun(), {{"GROUP_RANK", "2"}}), {"GROUP_RANK=2", "GROUP_WORLD_SIZE=2"});
  ExpectInvalid(Merge(Torchrun(), {{"MASTER_PORT", "http"}}), {"MASTER_PORT", "'http'"});
  ExpectInvalid(Merge(Torchrun(), {{"MASTER_PORT", "70000"}}), {"MASTER_PORT=70000"});
  ExpectInvalid(Merge(Torchrun(), {{"TORCHELASTIC_USE_AGENT_STORE", "maybe"}}),
                {"TORCHELASTIC_USE_AGENT_STORE", "'maybe'"});
  ExpectInvalid(Merge(Torchrun(), {{"TORCHELASTIC_RESTART_COUNT", "x"}}), {"TORCHELASTIC_RESTART_COUNT", "'x'"});
}

TEST(ClusterEnvironmentTest, TorchrunAcceptsSurroundingWhitespace) {
  EXPECT_EQ(Detect(Merge(Torchrun(), {{"RANK", " 3 "}})).rank, 3);
}

TEST(ClusterEnvironmentTest, Slurm) {
  ClusterInfo c = Detect(Slurm());
  EXPECT_EQ(c.source, "slurm");
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "node07");
  EXPECT_EQ(c.master_port, 4567 + 15000);
}

TEST(ClusterEnvironmentTest, SlurmMasterFromNodeListWithRanges) {
  ClusterInfo c = Detect(Merge(Slurm(), {{"SLURM_NODELIST", "node[01-03,7],gpu5"}, {"SLURM_NNODES", "5"}}));
  EXPECT_EQ(c.master_addr, "node01");
  EXPECT_EQ(c.num_nodes, 5);
}

TEST(ClusterEnvironmentTest, SlurmMasterEnvWins) {
  ClusterInfo c = Detect(Merge(Slurm(), {{"MASTER_PORT", "33333"}, {"MASTER_ADDR", "head"}}));
  EXPECT_EQ(c.master_port, 33333);
  EXPECT_EQ(c.master_addr, "head");
}

TEST(ClusterEnvironmentTest, SlurmPortLikeLightning) {
  // int(job_id[-4:]) + 15000; 12910 without a job id.
  EXPECT_EQ(SlurmMasterPort(FromMap({{"SLURM_JOB_ID", "1234567"}})), 19567);
  EXPECT_EQ(SlurmMasterPort(FromMap({{"SLURM_JOB_ID", "10042"}})), 15042);  // "0042" -> 42
  EXPECT_EQ(SlurmMasterPort(FromMap({{"SLURM_JOB_ID", "77"}})), 15077);
  EXPECT_EQ(SlurmMasterPort(FromMap({})), 12910);
  EXPECT_EQ(SlurmMasterPort(FromMap({{"SLURM_JOB_ID", "1234567"}, {"MASTER_PORT", "1111"}})), 1111);
  EXPECT_THROW(SlurmMasterPort(FromMap({{"SLURM_JOB_ID", "12ab"}})), InvalidArgumentError);
  Env no_job = Slurm();
  no_job.erase("SLURM_JOB_ID");
  EXPECT_EQ(Detect(no_job).master_port, 12910);
}

TEST(ClusterEnvironmentTest, SlurmDefaultsWithoutOptionalVariables) {
  ClusterInfo c = Detect({{"SLURM_PROCID", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS", "3"},
                          {"SLURM_NODEID", "2"}, {"SLURM_NODELIST", "n[1-3]"}});
  EXPECT_EQ(c.num_nodes, 3);          // hosts in the node list
  EXPECT_EQ(c.local_world_size, 1);   // 3 tasks on 3 nodes
  EXPECT_EQ(c.master_addr, "n1");
  EXPECT_EQ(c.master_port, 12910);
  ClusterInfo bare = Detect({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(bare.master_addr, "127.0.0.1");
  EXPECT_EQ(bare.num_nodes, 1);
}

TEST(ClusterEnvironmentTest, SlurmUnevenTasksPerNode) {
  // 3 tasks on node 0, 3 on node 1, 1 on node 2.
  Env env = {{"SLURM_PROCID", "6"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS", "7"}, {"SLURM_NODEID", "2"},
             {"SLURM_NNODES", "3"}, {"SLURM_TASKS_PER_NODE", "3(x2),1"}};
  EXPECT_EQ(Detect(env).local_world_size, 1);
  env["SLURM_NODEID"] = "1";
  env["SLURM_PROCID"] = "4";
  env["SLURM_LOCALID"] = "1";
  EXPECT_EQ(Detect(env).local_world_size, 3);
  // The step's layout wins over the job's.
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)";
  EXPECT_EQ(Detect(env).local_world_size, 2);
  ExpectInvalid(Merge(env, {{"SLURM_STEP_TASKS_PER_NODE", "2(x"}}), {"SLURM_STEP_TASKS_PER_NODE", "'2(x'"});
}

TEST(ClusterEnvironmentTest, SlurmInteractiveIsNotSlurm) {
  for (const char* name : {"bash", "interactive"}) {
    ClusterInfo c = Detect(Merge(Slurm(), {{"SLURM_JOB_NAME", name}}));
    EXPECT_EQ(c.source, "single") << name;
    // ... and another environment is then detected.
    EXPECT_EQ(Detect(Merge(Merge(Slurm(), OpenMpi()), {{"SLURM_JOB_NAME", name}})).source, "mpi") << name;
  }
}

TEST(ClusterEnvironmentTest, SlurmBadValues) {
  ExpectInvalid(Merge(Slurm(), {{"SLURM_PROCID", "five"}}), {"SLURM_PROCID", "'five'"});
  ExpectInvalid(Merge(Slurm(), {{"SLURM_PROCID", "8"}}), {"SLURM_PROCID=8", "SLURM_NTASKS=8"});
  ExpectInvalid(Merge(Slurm(), {{"SLURM_NTASKS", ""}}), {"SLURM_NTASKS", "''"});
  ExpectInvalid(Merge(Slurm(), {{"SLURM_NODEID", "2"}}), {"SLURM_NODEID=2", "SLURM_NNODES=2"});
  ExpectInvalid(Merge(Slurm(), {{"SLURM_LOCALID", "4"}}), {"SLURM_LOCALID=4"});
  ExpectInvalid(Merge(Slurm(), {{"SLURM_NODELIST", "node[1-"}}), {"SLURM_NODELIST", "'node[1-'"});
  ExpectInvalid(Merge(Slurm(), {{"SLURM_JOB_ID", "job"}}), {"SLURM_JOB_ID", "'job'"});
  Env no_procid = Slurm();
  no_procid.erase("SLURM_PROCID");
  ExpectInvalid(no_procid, {"SLURM_PROCID", "not set"});
}

TEST(ClusterEnvironmentTest, OpenMpi) {
  ClusterInfo c = Detect(Merge(OpenMpi(), {{"MASTER_ADDR", "mpihead"}, {"MASTER_PORT", "4000"}}));
  EXPECT_EQ(c.source, "mpi");
  EXPECT_EQ(c.rank, 6);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 2);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "mpihead");
  EXPECT_EQ(c.master_port, 4000);
  ClusterInfo d = Detect(OpenMpi());
  EXPECT_EQ(d.master_addr, "node0");
  EXPECT_EQ(d.master_port, 29500);
}

// Open MPI does not export where rank 0 runs: without MASTER_ADDR, 127.0.0.1
// is right on one host only, and an error across hosts.
TEST(ClusterEnvironmentTest, MpiWithoutMasterAddr) {
  Env one_host = {{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  ClusterInfo c = Detect(one_host);
  EXPECT_EQ(c.num_nodes, 1);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  Env no_local_size = one_host;  // nothing says the ranks span hosts
  no_local_size.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
  EXPECT_EQ(Detect(no_local_size).master_addr, "127.0.0.1");
  Env two_hosts = OpenMpi();
  two_hosts.erase("MASTER_ADDR");
  ExpectInvalid(two_hosts, {"MASTER_ADDR is not set", "OMPI_COMM_WORLD_LOCAL_SIZE=4 < OMPI_COMM_WORLD_SIZE=8",
                            "valid only on a single host"});
  Env pmi_two_hosts = Pmi();
  pmi_two_hosts.erase("MASTER_ADDR");
  ExpectInvalid(pmi_two_hosts, {"MASTER_ADDR is not set", "MPI_LOCALNRANKS=2 < PMI_SIZE=4"});
}

TEST(ClusterEnvironmentTest, OpenMpiBadValues) {
  ExpectInvalid(Merge(OpenMpi(), {{"OMPI_COMM_WORLD_RANK", "8"}}), {"OMPI_COMM_WORLD_RANK=8", "OMPI_COMM_WORLD_SIZE=8"});
  ExpectInvalid(Merge(OpenMpi(), {{"OMPI_COMM_WORLD_SIZE", "eight"}}), {"OMPI_COMM_WORLD_SIZE", "'eight'"});
  ExpectInvalid({{"OMPI_COMM_WORLD_RANK", "0"}}, {"OMPI_COMM_WORLD_SIZE", "not set"});
}

TEST(ClusterEnvironmentTest, Pmi) {
  ClusterInfo c = Detect(Pmi());
  EXPECT_EQ(c.source, "pmi");
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "node0");
  EXPECT_EQ(c.master_port, 29500);
  ExpectInvalid(Merge(Pmi(), {{"PMI_RANK", "4"}}), {"PMI_RANK=4", "PMI_SIZE=4"});
  ExpectInvalid(Merge(Pmi(), {{"MPI_LOCALRANKID", "1.5"}}), {"MPI_LOCALRANKID", "'1.5'"});
}

TEST(ClusterEnvironmentTest, Explicit) {
  ExplicitClusterOptions o;
  o.rank = 3;
  o.world_size = 4;
  o.master_port = 1234;
  ClusterInfo c = Detect(Torchrun(), o);  // explicit wins over everything
  EXPECT_EQ(c.source, "explicit");
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 3);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 0);
  EXPECT_EQ(c.num_nodes, 1);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.master_port, 1234);
  EXPECT_FALSE(c.agent_store);

  ExplicitClusterOptions bad;
  bad.rank = 4;
  bad.world_size = 4;
  ExpectInvalid({}, {"option rank=4", "option world_size=4"}, bad);
  ExplicitClusterOptions only_port;
  only_port.master_port = 70000;
  ExpectInvalid({}, {"option master_port=70000"}, only_port);
}

TEST(ClusterEnvironmentTest, Precedence) {
  Env all = Merge(Merge(Merge(Torchrun(), Slurm()), OpenMpi()), Pmi());
  EXPECT_EQ(Detect(all).source, "torchrun");
  Env no_torchrun = Merge(Merge(Slurm(), OpenMpi()), Pmi());
  EXPECT_EQ(Detect(no_torchrun).source, "slurm");
  EXPECT_EQ(Detect(Merge(OpenMpi(), Pmi())).source, "mpi");
  EXPECT_EQ(Detect(Pmi()).source, "pmi");
  // A bad variable of a lower-precedence environment is not read.
  EXPECT_EQ(Detect(Merge(Torchrun(), {{"SLURM_PROCID", "bad"}})).source, "torchrun");
  ExplicitClusterOptions none;
  EXPECT_FALSE(none.any_set());
  EXPECT_EQ(Detect(all, none).source, "torchrun");
}

TEST(ExpandSlurmNodeListTest, Ranges) {
  using V = std::vector<std::string>;
  EXPECT_EQ(ExpandSlurmNodeList("node[01-03,7],gpu5"), (V{"node01", "node02", "node03", "node7", "gpu5"}));
  EXPECT_EQ(ExpandSlurmNodeList("host1"), (V{"host1"}));
  EXPECT_EQ(ExpandSlurmNodeList("a,b c"), (V{"a", "b", "c"}));
  EXPECT_EQ(ExpandSlurmNodeList("n[8-10]"), (V{"n8", "n9", "n10"}));
  EXPECT_EQ(ExpandSlurmNodeList("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(ExpandSlurmNodeList("n[5]"), (V{"n5"}));
  EXPECT_EQ(ExpandSlurmNodeList("r[1-2]-n[01-02]"), (V{"r1-n01", "r1-n02", "r2-n01", "r2-n02"}));
  EXPECT_EQ(ExpandSlurmNodeList("a[1-2].ib,b"), (V{"a1.ib", "a2.ib", "b"}));
  EXPECT_EQ(ExpandSlurmNodeList(""), (V{}));
}

TEST(ExpandSlurmNodeListTest, Malformed) {
  for (const char* bad : {"n[1-", "n]1", "n[1-2]]", "n[[1]]", "n[a-b]", "n[3-1]", "n[]", "n[1-2-3]", "n[-1]"}) {
    EXPECT_THROW(ExpandSlurmNodeList(bad), InvalidArgumentError) << bad;
  }
}

}  // namespace
}  // namespace shardtrain
