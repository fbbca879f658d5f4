// Reads the job layout (rank, sizes, rendezvous address) from the variables a launcher sets.
// Every value is parsed strictly and range-checked; an error names the variable and the value
// seen, because a wrong rank or port otherwise shows up much later as a hang.
#include "tdist/runtime/launch_env.hpp"

#include <charconv>
#include <cstdlib>
#include <limits>
#include <vector>

#include "tdist/common/error.hpp"

namespace tdist {
namespace {

constexpr int kDefaultMasterPort = 29500;
// Ports derived from SLURM_JOB_ID fall in [kSlurmPortBase, kSlurmPortBase + kSlurmPortSpan):
// unprivileged and below Linux's ephemeral range (32768+), so outgoing connections of other
// programs do not take them.
constexpr int kSlurmPortBase = 20000;
constexpr int kSlurmPortSpan = 10000;

// Strict decimal integer: optional sign, digits, nothing else (no spaces, no trailing junk).
bool parse_int64(const std::string& text, int64_t& out) {
  const char* begin = text.data();
  const char* end = begin + text.size();
  if (begin != end && *begin == '+') ++begin;  // from_chars accepts '-' but not '+'
  if (begin == end) return false;
  auto [ptr, ec] = std::from_chars(begin, end, out);
  return ec == std::errc() && ptr == end;
}

int parse_int_var(const std::string& name, const std::string& value) {
  int64_t parsed = 0;
  if (!parse_int64(value, parsed)) TDIST_FAIL("environment variable ", name, "='", value, "' is not a decimal integer");
  if (parsed < std::numeric_limits<int>::min() || parsed > std::numeric_limits<int>::max())
    TDIST_FAIL("environment variable ", name, "='", value, "' is out of the range of int");
  return static_cast<int>(parsed);
}

// Names used in error messages for each field: environment variables, or argument names for
// make_launch_env.
struct FieldNames {
  std::string rank, world_size, local_rank, local_world_size, master_addr, master_port;
};

const FieldNames kTorchrunNames{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
const FieldNames kOpenMpiNames{"OMPI_COMM_WORLD_RANK",       "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                               "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR",          "MASTER_PORT"};
const FieldNames kExplicitNames{"rank", "world_size", "local_rank", "local_world_size", "master_addr", "master_port"};

void validate(const LaunchEnv& env, const FieldNames& n) {
  if (env.world_size < 1) TDIST_FAIL(n.world_size, "=", env.world_size, " is invalid: expected a world size >= 1");
  if (env.rank < 0 || env.rank >= env.world_size)
    TDIST_FAIL(n.rank, "=", env.rank, " is out of range: expected 0 <= ", n.rank, " < ", n.world_size,
               " (=", env.world_size, ")");
  if (env.local_world_size < 1 || env.local_world_size > env.world_size)
    TDIST_FAIL(n.local_world_size, "=", env.local_world_size, " is out of range: expected 1 <= ", n.local_world_size,
               " <= ", n.world_size, " (=", env.world_size, ")");
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size)
    TDIST_FAIL(n.local_rank, "=", env.local_rank, " is out of range: expected 0 <= ", n.local_rank, " < ",
               n.local_world_size, " (=", env.local_world_size, ")");
  if (env.master_addr.empty()) TDIST_FAIL(n.master_addr, " is empty: expected the host name or address of rank 0");
  if (env.master_port < 1 || env.master_port > 65535)
    TDIST_FAIL(n.master_port, "=", env.master_port, " is out of range: expected 1..65535");
}

std::string require(const EnvLookup& lookup, const std::string& name, const std::string& why) {
  auto value = lookup(name);
  if (!value) TDIST_FAIL("environment variable ", name, " is not set: ", why);
  return *value;
}

// A launcher's integer variable that must be set; errors name it.
int require_int(const EnvLookup& lookup, const std::string& name, const std::string& why) {
  return parse_int_var(name, require(lookup, name, why));
}

int port_from_env(const EnvLookup& lookup, int fallback) {
  auto port = lookup("MASTER_PORT");
  return port ? parse_int_var("MASTER_PORT", *port) : fallback;
}

// MASTER_ADDR when set; otherwise loopback, which is only right when every rank is on this node.
std::string master_addr_or_loopback(const EnvLookup& lookup, const LaunchEnv& env, const char* launcher) {
  if (auto addr = lookup("MASTER_ADDR")) return *addr;
  if (env.local_world_size == env.world_size) return "127.0.0.1";
  TDIST_FAIL("MASTER_ADDR is not set and the ", launcher, " job spans several nodes (", env.local_world_size, " of ",
             env.world_size, " ranks on this node): set MASTER_ADDR to the host name or address of rank 0");
}

LaunchEnv parse_torchrun(const EnvLookup& lookup) {
  auto rank = lookup("RANK");
  auto world = lookup("WORLD_SIZE");
  if (!rank || !world) {
    const char* set = rank ? "RANK" : "WORLD_SIZE";
    const char* unset = rank ? "WORLD_SIZE" : "RANK";
    TDIST_FAIL(set, "='", rank ? *rank : *world, "' is set but ", unset,
               " is not: a torchrun-style launch sets RANK, WORLD_SIZE, LOCAL_RANK and "
               "LOCAL_WORLD_SIZE together");
  }
  LaunchEnv env;
  env.launcher = "torchrun";
  env.rank = parse_int_var("RANK", *rank);
  env.world_size = parse_int_var("WORLD_SIZE", *world);
  auto local_rank = lookup("LOCAL_RANK");
  auto local_world = lookup("LOCAL_WORLD_SIZE");
  if (local_rank && local_world) {
    env.local_rank = parse_int_var("LOCAL_RANK", *local_rank);
    env.local_world_size = parse_int_var("LOCAL_WORLD_SIZE", *local_world);
  } else if (!local_rank && !local_world) {
    // RANK and WORLD_SIZE alone (set by hand): the whole job is on this node.
    env.local_rank = env.rank;
    env.local_world_size = env.world_size;
  } else {
    const char* set = local_rank ? "LOCAL_RANK" : "LOCAL_WORLD_SIZE";
    const char* unset = local_rank ? "LOCAL_WORLD_SIZE" : "LOCAL_RANK";
    TDIST_FAIL(set, "='", local_rank ? *local_rank : *local_world, "' is set but ", unset,
               " is not: set both or neither");
  }
  env.master_addr = master_addr_or_loopback(lookup, env, "torchrun-style");
  env.master_port = port_from_env(lookup, kDefaultMasterPort);
  validate(env, kTorchrunNames);
  return env;
}

LaunchEnv parse_openmpi(const EnvLookup& lookup) {
  const std::string why =
      "Open MPI sets OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK and _LOCAL_SIZE "
      "together (is this process started by mpirun?)";
  LaunchEnv env;
  env.launcher = "openmpi";
  env.rank = require_int(lookup, "OMPI_COMM_WORLD_RANK", why);
  env.world_size = require_int(lookup, "OMPI_COMM_WORLD_SIZE", why);
  env.local_rank = require_int(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", why);
  env.local_world_size = require_int(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE", why);
  env.master_addr = master_addr_or_loopback(lookup, env, "Open MPI");
  env.master_port = port_from_env(lookup, kDefaultMasterPort);
  validate(env, kOpenMpiNames);
  return env;
}

// Expands Slurm's compressed tasks-per-node list, "4(x2),3" -> {4, 4, 3}.
std::vector<int> expand_tasks_per_node(const std::string& name, const std::string& value) {
  auto bad = [&](const std::string& why) -> std::vector<int> {
    TDIST_FAIL("environment variable ", name, "='", value, "' is malformed (", why,
               "): expected a comma-separated list of COUNT or COUNT(xREPEAT), e.g. \"4(x2),3\"");
  };
  std::vector<int> counts;
  size_t pos = 0;
  while (true) {
    size_t comma = value.find(',', pos);
    std::string item = value.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    std::string count_text = item;
    std::string repeat_text = "1";
    if (size_t paren = item.find('('); paren != std::string::npos) {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')')
        return bad("'" + item + "'");
      count_text = item.substr(0, paren);
      repeat_text = item.substr(paren + 2, item.size() - paren - 3);
    }
    int64_t count = 0, repeat = 0;
    if (!parse_int64(count_text, count) || count < 1 || count > std::numeric_limits<int>::max())
      return bad("count '" + count_text + "'");
    if (!parse_int64(repeat_text, repeat) || repeat < 1 || repeat > (1 << 24))
      return bad("repeat '" + repeat_text + "'");
    counts.insert(counts.end(), static_cast<size_t>(repeat), static_cast<int>(count));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return counts;
}

// First host of a Slurm host list, or an empty string with `why` set when the list is malformed.
// Syntax: entries separated by commas outside brackets; an entry is a name with bracketed range
// lists, e.g. "rack[1-2]-gpu[003-005,009]". The first host takes the first number of every
// bracket, keeping its zero padding.
std::string first_host_of(const std::string& nodelist, std::string& why) {
  const std::string in_list = " in Slurm host list '" + nodelist + "'";
  if (nodelist.empty()) {
    why = "expected a Slurm host list, got an empty string";
    return {};
  }
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    const char c = nodelist[i];
    if (c == ']') {
      why = "unbalanced ']'" + in_list;
      return {};
    }
    if (c != '[') {
      host += c;
      ++i;
      continue;
    }
    const size_t close = nodelist.find(']', i);
    if (close == std::string::npos) {
      why = "unbalanced '['" + in_list;
      return {};
    }
    const std::string ranges = nodelist.substr(i + 1, close - i - 1);
    const std::string first = ranges.substr(0, ranges.find_first_of(",-"));
    if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) {
      why = "bracket '[" + ranges + "]' does not start with a number" + in_list;
      return {};
    }
    host += first;
    i = close + 1;
  }
  if (host.empty()) why = "empty first host name" + in_list;
  return host;
}

LaunchEnv parse_slurm(const EnvLookup& lookup) {
  const std::string why =
      "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID together "
      "(is this process started by srun?)";
  LaunchEnv env;
  env.launcher = "slurm";
  env.rank = require_int(lookup, "SLURM_PROCID", why);
  env.world_size = require_int(lookup, "SLURM_NTASKS", why);
  env.local_rank = require_int(lookup, "SLURM_LOCALID", why);

  std::string tpn_name = "SLURM_STEP_TASKS_PER_NODE";
  auto tpn = lookup(tpn_name);
  if (!tpn) {
    tpn_name = "SLURM_TASKS_PER_NODE";
    tpn = lookup(tpn_name);
  }
  if (!tpn) TDIST_FAIL("neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set: ", why);
  std::vector<int> tasks_per_node = expand_tasks_per_node(tpn_name, *tpn);
  int node_id = 0;
  if (auto node = lookup("SLURM_NODEID")) {
    node_id = parse_int_var("SLURM_NODEID", *node);
  } else if (tasks_per_node.size() > 1) {
    TDIST_FAIL("SLURM_NODEID is not set but ", tpn_name, "='", *tpn,
               "' lists several nodes: cannot tell this node's task count");
  }
  if (node_id < 0 || static_cast<size_t>(node_id) >= tasks_per_node.size())
    TDIST_FAIL("SLURM_NODEID=", node_id, " is out of range: ", tpn_name, "='", *tpn, "' describes ",
               tasks_per_node.size(), " node(s)");
  env.local_world_size = tasks_per_node[node_id];

  if (auto addr = lookup("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else {
    std::string list_name = "SLURM_STEP_NODELIST";
    auto list = lookup(list_name);
    if (!list) {
      list_name = "SLURM_NODELIST";
      list = lookup(list_name);
    }
    if (!list)
      TDIST_FAIL(
          "MASTER_ADDR, SLURM_STEP_NODELIST and SLURM_NODELIST are all unset: "
          "cannot tell where rank 0 runs; set MASTER_ADDR");
    std::string why;
    env.master_addr = first_host_of(*list, why);
    if (!why.empty()) TDIST_FAIL("environment variable ", list_name, "='", *list, "' is malformed: ", why);
  }

  int port = kDefaultMasterPort;
  if (auto job = lookup("SLURM_JOB_ID")) {
    // Same on every rank of the job, and different for jobs sharing a node (mostly): the step id
    // is mixed in so that concurrent steps of one job do not collide.
    int64_t job_id = 0;
    if (!parse_int64(*job, job_id) || job_id < 0)
      TDIST_FAIL("environment variable SLURM_JOB_ID='", *job, "' is not a non-negative integer");
    int64_t step_id = 0;
    if (auto step = lookup("SLURM_STEP_ID")) parse_int64(*step, step_id);  // absent in batch step
    int64_t mixed = (job_id % 1000003) * 31 + (step_id & 0xffff);
    port = kSlurmPortBase + static_cast<int>(mixed % kSlurmPortSpan);
  }
  env.master_port = port_from_env(lookup, port);

  validate(env, FieldNames{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", tpn_name + " (this node's entry)",
                           "MASTER_ADDR", "MASTER_PORT"});
  return env;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  std::string why;
  std::string host = first_host_of(nodelist, why);
  if (!why.empty()) TDIST_FAIL("invalid argument 'nodelist': ", why);
  return host;
}

LaunchEnv parse_launch_env(const EnvLookup& lookup) {
  TDIST_CHECK_ARG(static_cast<bool>(lookup), "lookup", "expected a callable, got an empty function");
  if (lookup("RANK") || lookup("WORLD_SIZE")) return parse_torchrun(lookup);
  if (lookup("OMPI_COMM_WORLD_RANK") || lookup("OMPI_COMM_WORLD_SIZE")) return parse_openmpi(lookup);
  if (lookup("SLURM_PROCID")) return parse_slurm(lookup);

  LaunchEnv env;  // a world of one; MASTER_ADDR/MASTER_PORT still honoured when set
  if (auto addr = lookup("MASTER_ADDR")) env.master_addr = *addr;
  env.master_port = port_from_env(lookup, kDefaultMasterPort);
  validate(env, kTorchrunNames);
  return env;
}

LaunchEnv launch_env_from_process() {
  return parse_launch_env([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

LaunchEnv make_launch_env(int rank, int world_size, int local_rank, int local_world_size, std::string master_addr,
                          int master_port) {
  LaunchEnv env;
  env.rank = rank;
  env.world_size = world_size;
  env.local_rank = local_rank;
  env.local_world_size = local_world_size;
  env.master_addr = std::move(master_addr);
  env.master_port = master_port;
  env.launcher = "explicit";
  validate(env, kExplicitNames);
  return env;
}

}  // namespace tdist
