// tdist::World: this process's place in a multi-GPU job, its GPU, and its NCCL communicator.
//
// Built from the launcher's environment (torchrun, tdistrun, Open MPI, Slurm; launch_env.hpp),
// from explicit values, or around a communicator the caller already has. Every host wait is
// bounded by `timeout`: rendezvous through the TCP store names the ranks that did not arrive;
// NCCL's initialisation runs non-blocking under a watchdog (deadline, dead ranks in the store,
// other ranks' init failures) and is aborted on any of them, so a rank that fails or dies makes
// the others throw a tdist::Error naming the stage and the rank instead of hanging; the job's
// communicator itself is blocking, split off the non-blocking one (the split completes through
// the parent, which is waited for first). TDIST_NCCL_BOUNDED_INIT=0 falls back to a plain
// blocking ncclCommInitRank. A host all-gather through NCCL that times out
// aborts the communicator, after which the destructor does not finalize (it would block).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tdist/runtime/launch_env.hpp"
#include "tdist/runtime/tcp_store.hpp"

namespace tdist {

namespace detail {
class NcclWatchdog;
}

struct WorldOptions {
  // Where this rank sits; read from the process environment when empty.
  std::optional<LaunchEnv> env;
  // CUDA device of this rank; -1 picks LOCAL_RANK.
  int device = -1;
  // Bound on every host wait (rendezvous, NCCL init, host barriers).
  std::chrono::milliseconds timeout = TcpStoreOptions::default_timeout();
};

class World {
 public:
  // Joins the job: selects the GPU, rendezvous through the TCP store, creates the NCCL communicator.
  explicit World(const WorldOptions& options = {});
  // Joins a job whose ranks received one NCCL unique id through another bootstrap (e.g.
  // torch.distributed): selects `device`, creates the communicator within `timeout` (bounded as
  // above, without a store to learn of dead ranks) and owns it.
  World(const ncclUniqueId& id, int rank, int world_size, int device,
        std::chrono::milliseconds timeout = TcpStoreOptions::default_timeout());
  // A new NCCL unique id, made once (on one rank) and passed to the others by that bootstrap.
  static ncclUniqueId new_unique_id();
  // Wraps a communicator the caller created and keeps owning (not destroyed with the World).
  // Host collectives then run through NCCL on a private stream.
  World(ncclComm_t existing, std::chrono::milliseconds timeout = TcpStoreOptions::default_timeout());
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return local_rank_; }
  int local_world_size() const { return local_world_size_; }
  int device() const { return device_; }
  ncclComm_t comm() const { return comm_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Ranks reachable with loads and stores (NCCL's LSA team): [lsa_first_rank, + lsa_size).
  int lsa_size() const { return lsa_size_; }
  int lsa_rank() const { return lsa_rank_; }

  // Host collectives, for bootstrap-sized data. `tag` names the call in timeout errors.
  std::vector<Bytes> all_gather(const std::string& tag, const Bytes& mine);
  void barrier(const std::string& tag);

  // Element-wise maximum over the ranks (every rank passes a vector of the same size), e.g. the
  // reduce hook of tdist::jit::Autotuner, so that all ranks pick the same winner.
  std::vector<double> max_across_ranks(const std::string& tag, const std::vector<double>& values);

  // Throws tdist::Error naming `what` and each rank's value when the ranks disagree.
  void check_same_on_all_ranks(const std::string& what, const std::string& value);

  // Call checking (TDIST_CHECK_CALLS=1, or set_check_calls on every rank alike): before each
  // collective or overlapped op runs, the ranks compare the op and its arguments (counts, shapes,
  // dtype, method) over the store, about 0.1-1 ms a call; a mismatch raises tdist::Error on every
  // rank naming each rank's call, instead of a device timeout on some ranks and wrong data on the
  // others. `call` is the op's name and arguments as text. Not for calls inside a graph capture.
  void check_same_call(const std::string& call);
  void set_check_calls(bool on) { check_calls_ = on; }
  bool check_calls() const { return check_calls_; }

  // Gives the NCCL work enqueued on `stream` so far a deadline (TDIST_NCCL_TIMEOUT_S seconds; 0, the
  // default, turns it off): past it, a watchdog thread aborts the communicator, which makes NCCL's kernels
  // return, and records a device fault (runtime/device_fault.hpp), so that the next launch or
  // check_device_faults() raises DeviceTimeoutError naming `what`. Every op that calls NCCL on a
  // user stream calls this after it; a no-op while the stream is capturing a graph.
  void watch_nccl(cudaStream_t stream, const std::string& what);

  // Aborts the communicator (ncclCommAbort: never blocks), for when NCCL work can no longer
  // finish; the World is unusable afterwards and its destructor does not finalize. A communicator
  // wrapped with World(ncclComm_t) stays its owner's to abort: this only marks the World and says
  // so on stderr. Idempotent.
  void abort(const std::string& why) noexcept;
  bool aborted() const { return aborted_; }

 private:
  using Clock = std::chrono::steady_clock;
  void init_comm_bounded(const ncclUniqueId& id);
  // Polls `comm` until its pending operation finishes; on an NCCL error, the deadline, a dead
  // rank or another rank's init failure, aborts it (if asked) and throws via fail_init.
  void wait_comm(ncclComm_t comm, const char* stage, Clock::time_point deadline, bool abort_on_failure);
  [[noreturn]] void fail_init(const char* stage, const std::string& why, bool timed_out);
  std::string failed_ranks_message();
  void init_from_comm();
  std::vector<Bytes> all_gather_nccl(const Bytes& mine);

  int rank_ = 0, world_size_ = 1, local_rank_ = 0, local_world_size_ = 1, device_ = 0;
  int lsa_rank_ = 0, lsa_size_ = 1;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<TcpStore> store_;  // null when wrapping an existing communicator
  std::atomic<ncclComm_t> comm_{nullptr};  // null once aborted (the watchdog's thread may abort)
  bool owns_comm_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex watchdog_mu_;
  std::unique_ptr<detail::NcclWatchdog> nccl_watchdog_;  // started at the first watched NCCL call
  uint64_t collective_count_ = 0;  // makes store tags unique per call
  bool check_calls_ = false;
};

}  // namespace tdist
