// Where this process sits in a job, read from the environment its launcher set.
//
// Recognised launchers, first match wins:
//   torchrun / tdistrun : RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   Open MPI            : OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (+ MASTER_ADDR/PORT)
//   Slurm (srun)        : SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE or
//                         SLURM_TASKS_PER_NODE, master = first host of SLURM_STEP_NODELIST/SLURM_NODELIST
// With none of them set, the process is a world of one (rank 0 of 1).
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace tdist {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  // "torchrun", "openmpi", "slurm", "explicit" or "none"
};

// Reads one environment variable; std::nullopt when unset. Injected so tests need not touch the
// process environment.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Parses and validates the launch environment. Throws tdist::Error naming the variable and the
// expected form when a value is malformed or inconsistent (rank outside [0, world_size), ...).
LaunchEnv parse_launch_env(const EnvLookup& lookup);

// parse_launch_env over the real process environment.
LaunchEnv launch_env_from_process();

// Validates explicit values (the "explicit" launcher) with the same checks.
LaunchEnv make_launch_env(int rank, int world_size, int local_rank, int local_world_size, std::string master_addr,
                          int master_port);

// Expands the first host of a Slurm host list: "node[03-05,07],gpu1" -> "node03".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace tdist
