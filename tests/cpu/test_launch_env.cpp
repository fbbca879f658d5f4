// Launch environment parsing: torchrun, Open MPI and Slurm variables, defaults, and every error.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tdist/common/error.hpp"
#include "tdist/runtime/launch_env.hpp"

namespace {

using tdist::LaunchEnv;
using Vars = std::map<std::string, std::string>;

LaunchEnv parse(const Vars& vars) {
  return tdist::parse_launch_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// Expects parse(vars) to throw tdist::Error whose message holds every fragment.
void expect_error(const Vars& vars, const std::vector<std::string>& fragments) {
  try {
    LaunchEnv env = parse(vars);
    ADD_FAILURE() << "expected an error, got rank " << env.rank << " of " << env.world_size;
  } catch (const tdist::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("launch_env.cpp:"), std::string::npos) << msg;  // names file:line
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

const Vars kTorchrun = {{"RANK", "5"},
                        {"WORLD_SIZE", "8"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "4"},
                        {"MASTER_ADDR", "node7"},
                        {"MASTER_PORT", "1234"}};

Vars with(Vars base, const Vars& changes) {
  for (const auto& [k, v] : changes) base[k] = v;
  return base;
}
Vars without(Vars base, const std::string& name) {
  base.erase(name);
  return base;
}

TEST(LaunchEnv, NoLauncherIsAWorldOfOne) {
  LaunchEnv env = parse({});
  EXPECT_EQ(env.launcher, "none");
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);

  env = parse({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "4000"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(env.launcher, "none");
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 4000);
  expect_error({{"MASTER_PORT", "http"}}, {"MASTER_PORT", "'http'"});
}

TEST(LaunchEnv, Torchrun) {
  LaunchEnv env = parse(kTorchrun);
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "node7");
  EXPECT_EQ(env.master_port, 1234);
}

TEST(LaunchEnv, TorchrunDefaults) {
  // Without LOCAL_*: one node. Without MASTER_*: loopback and 29500.
  LaunchEnv env = parse({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  // Several nodes need MASTER_ADDR.
  expect_error(without(kTorchrun, "MASTER_ADDR"), {"MASTER_ADDR is not set", "4 of 8"});
}

TEST(LaunchEnv, TorchrunPartialSetsAreErrors) {
  expect_error({{"RANK", "0"}}, {"RANK='0' is set but WORLD_SIZE is not"});
  expect_error({{"WORLD_SIZE", "2"}}, {"WORLD_SIZE='2' is set but RANK is not"});
  expect_error(without(kTorchrun, "LOCAL_WORLD_SIZE"), {"LOCAL_RANK='1' is set but LOCAL_WORLD_SIZE is not"});
  expect_error(without(kTorchrun, "LOCAL_RANK"), {"LOCAL_WORLD_SIZE='4' is set but LOCAL_RANK is not"});
}

TEST(LaunchEnv, MalformedNumbers) {
  for (const std::string bad : {"", "abc", "1x", " 1", "1 ", "1.0", "0x10", "--1", "99999999999", "+"}) {
    SCOPED_TRACE("RANK='" + bad + "'");
    expect_error(with(kTorchrun, {{"RANK", bad}}), {"RANK='" + bad + "'"});
  }
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "8a"}}), {"WORLD_SIZE='8a'", "not a decimal integer"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "29500 "}}), {"MASTER_PORT='29500 '"});
  expect_error(with(kTorchrun, {{"LOCAL_RANK", "2147483648"}}), {"LOCAL_RANK='2147483648'", "out of the range"});
  EXPECT_EQ(parse(with(kTorchrun, {{"RANK", "+3"}})).rank, 3);  // an explicit '+' is fine
}

TEST(LaunchEnv, OutOfRangeValues) {
  expect_error(with(kTorchrun, {{"RANK", "8"}}), {"RANK=8 is out of range", "0 <= RANK < WORLD_SIZE (=8)"});
  expect_error(with(kTorchrun, {{"RANK", "-1"}}), {"RANK=-1 is out of range"});
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "0"}, {"RANK", "0"}}), {"WORLD_SIZE=0", ">= 1"});
  expect_error(with(kTorchrun, {{"LOCAL_RANK", "4"}}), {"LOCAL_RANK=4 is out of range", "LOCAL_WORLD_SIZE (=4)"});
  expect_error(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "9"}}), {"LOCAL_WORLD_SIZE=9 is out of range", "WORLD_SIZE (=8)"});
  expect_error(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "0"}}), {"LOCAL_WORLD_SIZE=0"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "0"}}), {"MASTER_PORT=0", "1..65535"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "65536"}}), {"MASTER_PORT=65536"});
  expect_error(with(kTorchrun, {{"MASTER_ADDR", ""}}), {"MASTER_ADDR is empty"});
  EXPECT_EQ(parse(with(kTorchrun, {{"MASTER_PORT", "65535"}})).master_port, 65535);
}

TEST(LaunchEnv, FirstMatchWins) {
  Vars all = with(kTorchrun, {{"OMPI_COMM_WORLD_RANK", "0"}, {"SLURM_PROCID", "0"}});
  EXPECT_EQ(parse(all).launcher, "torchrun");
  Vars mpi_and_slurm = {{"OMPI_COMM_WORLD_RANK", "1"},
                        {"OMPI_COMM_WORLD_SIZE", "2"},
                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                        {"SLURM_PROCID", "0"}};
  EXPECT_EQ(parse(mpi_and_slurm).launcher, "openmpi");
}

const Vars kOpenMpi = {{"OMPI_COMM_WORLD_RANK", "3"},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};

TEST(LaunchEnv, OpenMpiOnOneNode) {
  LaunchEnv env = parse(kOpenMpi);
  EXPECT_EQ(env.launcher, "openmpi");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 3);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(LaunchEnv, OpenMpiAcrossNodes) {
  Vars two_nodes = with(kOpenMpi, {{"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "7"}});
  expect_error(two_nodes, {"MASTER_ADDR is not set", "Open MPI", "set MASTER_ADDR"});
  LaunchEnv env = parse(with(two_nodes, {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "31000"}}));
  EXPECT_EQ(env.rank, 7);
  EXPECT_EQ(env.master_addr, "head");
  EXPECT_EQ(env.master_port, 31000);
}

TEST(LaunchEnv, OpenMpiErrors) {
  expect_error(without(kOpenMpi, "OMPI_COMM_WORLD_LOCAL_SIZE"), {"OMPI_COMM_WORLD_LOCAL_SIZE is not set"});
  expect_error(without(kOpenMpi, "OMPI_COMM_WORLD_RANK"), {"OMPI_COMM_WORLD_RANK is not set"});
  expect_error(with(kOpenMpi, {{"OMPI_COMM_WORLD_RANK", "4"}}), {"OMPI_COMM_WORLD_RANK=4 is out of range"});
  expect_error(with(kOpenMpi, {{"OMPI_COMM_WORLD_LOCAL_RANK", "x"}}), {"OMPI_COMM_WORLD_LOCAL_RANK='x'"});
}

// 11 tasks on 3 nodes (4, 4, 3); this is global rank 9, the second task of the third node.
const Vars kSlurm = {{"SLURM_PROCID", "9"},
                     {"SLURM_NTASKS", "11"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "2"},
                     {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"},
                     {"SLURM_STEP_NODELIST", "gpu[003-005,009],login1"},
                     {"SLURM_JOB_ID", "123456"}};

TEST(LaunchEnv, Slurm) {
  LaunchEnv env = parse(kSlurm);
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 9);
  EXPECT_EQ(env.world_size, 11);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.master_addr, "gpu003");
  EXPECT_GE(env.master_port, 20000);
  EXPECT_LT(env.master_port, 30000);
}

TEST(LaunchEnv, SlurmTasksPerNodeForms) {
  auto local_size = [](const std::string& tpn, const std::string& node) {
    return parse(with(kSlurm, {{"SLURM_STEP_TASKS_PER_NODE", tpn}, {"SLURM_NODEID", node}, {"SLURM_LOCALID", "0"}}))
        .local_world_size;
  };
  EXPECT_EQ(local_size("4(x2),3", "0"), 4);
  EXPECT_EQ(local_size("4(x2),3", "1"), 4);
  EXPECT_EQ(local_size("4(x2),3", "2"), 3);
  EXPECT_EQ(local_size("2,3(x2),1", "3"), 1);
  EXPECT_EQ(local_size("8", "0"), 8);
  EXPECT_EQ(local_size("1(x11)", "10"), 1);

  // The step's list wins over the job's; the job's serves when the step's is absent.
  Vars job_only = without(kSlurm, "SLURM_STEP_TASKS_PER_NODE");
  job_only["SLURM_TASKS_PER_NODE"] = "5(x2),1";
  job_only["SLURM_LOCALID"] = "0";
  EXPECT_EQ(parse(job_only).local_world_size, 1);
  EXPECT_EQ(parse(with(kSlurm, {{"SLURM_TASKS_PER_NODE", "1"}})).local_world_size, 3);

  // One node: SLURM_NODEID may be absent.
  Vars one_node = {{"SLURM_PROCID", "2"},
                   {"SLURM_NTASKS", "4"},
                   {"SLURM_LOCALID", "2"},
                   {"SLURM_TASKS_PER_NODE", "4"},
                   {"SLURM_NODELIST", "solo"}};
  LaunchEnv env = parse(one_node);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "solo");
  EXPECT_EQ(env.master_port, 29500);  // no SLURM_JOB_ID
}

TEST(LaunchEnv, SlurmTasksPerNodeErrors) {
  for (const std::string bad : {"", "4(x2", "4(2)", "4(x)", "4(x0)", "0", "x", "4,,3", "4,", "4(x2)3", "-1"}) {
    SCOPED_TRACE("SLURM_STEP_TASKS_PER_NODE='" + bad + "'");
    expect_error(with(kSlurm, {{"SLURM_STEP_TASKS_PER_NODE", bad}}),
                 {"SLURM_STEP_TASKS_PER_NODE='" + bad + "' is malformed"});
  }
  expect_error(with(kSlurm, {{"SLURM_NODEID", "3"}}), {"SLURM_NODEID=3 is out of range", "3 node(s)"});
  expect_error(without(kSlurm, "SLURM_NODEID"), {"SLURM_NODEID is not set"});
  expect_error(without(kSlurm, "SLURM_STEP_TASKS_PER_NODE"), {"SLURM_TASKS_PER_NODE is set"});
  expect_error(with(kSlurm, {{"SLURM_LOCALID", "3"}}), {"SLURM_LOCALID=3 is out of range"});
}

TEST(LaunchEnv, SlurmErrors) {
  expect_error(without(kSlurm, "SLURM_NTASKS"), {"SLURM_NTASKS is not set"});
  expect_error(without(kSlurm, "SLURM_LOCALID"), {"SLURM_LOCALID is not set"});
  expect_error(with(kSlurm, {{"SLURM_PROCID", "11"}}), {"SLURM_PROCID=11 is out of range", "SLURM_NTASKS (=11)"});
  expect_error(with(kSlurm, {{"SLURM_NTASKS", "eleven"}}), {"SLURM_NTASKS='eleven'"});
  expect_error(without(kSlurm, "SLURM_STEP_NODELIST"), {"SLURM_NODELIST are all unset", "MASTER_ADDR"});
  expect_error(with(kSlurm, {{"SLURM_STEP_NODELIST", "gpu[003"}}), {"SLURM_STEP_NODELIST='gpu[003' is malformed"});
  expect_error(with(kSlurm, {{"SLURM_JOB_ID", "12ab"}}), {"SLURM_JOB_ID='12ab'"});
}

TEST(LaunchEnv, SlurmMasterAndPort) {
  // MASTER_ADDR and MASTER_PORT override what Slurm implies.
  LaunchEnv env = parse(with(kSlurm, {{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "40000"}}));
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 40000);
  // The job's node list serves when the step's is absent.
  Vars job_list = without(kSlurm, "SLURM_STEP_NODELIST");
  job_list["SLURM_NODELIST"] = "a100-[07-08]";
  EXPECT_EQ(parse(job_list).master_addr, "a100-07");
  // The derived port is the same on every rank of a job and differs across jobs.
  const int port = parse(kSlurm).master_port;
  EXPECT_EQ(parse(with(kSlurm, {{"SLURM_PROCID", "0"}, {"SLURM_NODEID", "0"}, {"SLURM_LOCALID", "0"}})).master_port,
            port);
  std::set<int> ports;
  for (int job = 1000; job < 1020; ++job) {
    const int p = parse(with(kSlurm, {{"SLURM_JOB_ID", std::to_string(job)}})).master_port;
    EXPECT_GE(p, 20000);
    EXPECT_LT(p, 30000);
    ports.insert(p);
  }
  EXPECT_EQ(ports.size(), 20u);
  EXPECT_NE(parse(with(kSlurm, {{"SLURM_STEP_ID", "1"}})).master_port,
            parse(with(kSlurm, {{"SLURM_STEP_ID", "2"}})).master_port);
}

TEST(LaunchEnv, FirstSlurmHost) {
  EXPECT_EQ(tdist::first_slurm_host("gpu[003-005,009],login1"), "gpu003");
  EXPECT_EQ(tdist::first_slurm_host("node[03-05,07],gpu1"), "node03");
  EXPECT_EQ(tdist::first_slurm_host("login1,gpu[1-2]"), "login1");
  EXPECT_EQ(tdist::first_slurm_host("solo"), "solo");
  EXPECT_EQ(tdist::first_slurm_host("n[7]"), "n7");
  EXPECT_EQ(tdist::first_slurm_host("n[9,2-4]"), "n9");
  EXPECT_EQ(tdist::first_slurm_host("rack[2-3]-gpu[010-011]"), "rack2-gpu010");
  EXPECT_EQ(tdist::first_slurm_host("host.example.com"), "host.example.com");
  for (const std::string bad : {"", "gpu[003", "gpu]", "gpu[]", "gpu[a-b]", ",gpu1", "[-3]"}) {
    SCOPED_TRACE("'" + bad + "'");
    try {
      tdist::first_slurm_host(bad);
      ADD_FAILURE() << "expected an error";
    } catch (const tdist::Error& e) {
      EXPECT_NE(std::string(e.what()).find("nodelist"), std::string::npos) << e.what();
    }
  }
}

TEST(LaunchEnv, MakeLaunchEnv) {
  LaunchEnv env = tdist::make_launch_env(1, 4, 1, 2, "host", 5000);
  EXPECT_EQ(env.launcher, "explicit");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "host");
  auto expect_bad = [](auto make, const std::string& fragment) {
    try {
      make();
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const tdist::Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_bad([] { tdist::make_launch_env(4, 4, 0, 1, "h", 1); }, "rank=4 is out of range");
  expect_bad([] { tdist::make_launch_env(0, 0, 0, 1, "h", 1); }, "world_size=0");
  expect_bad([] { tdist::make_launch_env(0, 4, 2, 2, "h", 1); }, "local_rank=2");
  expect_bad([] { tdist::make_launch_env(0, 4, 0, 5, "h", 1); }, "local_world_size=5");
  expect_bad([] { tdist::make_launch_env(0, 4, 0, 1, "", 1); }, "master_addr is empty");
  expect_bad([] { tdist::make_launch_env(0, 4, 0, 1, "h", 0); }, "master_port=0");
}

TEST(LaunchEnv, FromProcessEnvironment) {
  const std::vector<std::pair<std::string, std::string>> vars = {{"RANK", "1"},
                                                                 {"WORLD_SIZE", "2"},
                                                                 {"LOCAL_RANK", "1"},
                                                                 {"LOCAL_WORLD_SIZE", "2"},
                                                                 {"MASTER_ADDR", "127.0.0.2"},
                                                                 {"MASTER_PORT", "23456"}};
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const auto& [name, value] : vars) {
    const char* old = std::getenv(name.c_str());
    saved.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    setenv(name.c_str(), value.c_str(), 1);
  }
  LaunchEnv env = tdist::launch_env_from_process();
  for (const auto& [name, old] : saved) {
    if (old)
      setenv(name.c_str(), old->c_str(), 1);
    else
      unsetenv(name.c_str());
  }
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.master_addr, "127.0.0.2");
  EXPECT_EQ(env.master_port, 23456);
}

}  // namespace
