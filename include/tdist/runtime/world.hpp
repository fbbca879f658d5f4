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
// The comparison of an op's call across ranks (check_same_call) is bounded by the device wait
// timeout instead (call_compare_bound): a peer that does not come is one the op's own kernels
// would wait for.
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

#include "tdist/runtime/call_checker.hpp"
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

// How long a call comparison (World::check_same_call) waits for the other ranks: the device wait
// timeout (TDIST_WAIT_TIMEOUT_S), which the op's own kernels would hit waiting for a peer that did not
// come, or the host timeout when that is shorter. Init, barriers and the other host collectives keep
// the host timeout: there peers may legitimately be slow (loading, compiling); after a device wait
// gave up (a peer may be dead) they take this bound too. `setting` names the variable that set
// `timeout`, for the error.
struct CallCompareBound {
  std::chrono::milliseconds timeout;
  const char* setting;
};
CallCompareBound call_compare_bound(std::chrono::milliseconds host_timeout, double wait_timeout_seconds);
// The error of a comparison that timed out: the store's or NCCL's timeout error (`error`: the ranks
// missing), this rank's call, the bound, and under `first` the hint that an absent rank may be running
// a call it has seen before.
std::string call_compare_timeout_message(const std::string& error, const std::string& call,
                                         const CallCompareBound& bound, CallCheckMode mode);

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
  // TDIST_SHARE_GPUS=1 (the same on every rank; a test mode): ranks may share a GPU (rank on GPU
  // LOCAL_RANK % count) and time-slice it, so kernels are correct but their timings mean nothing.
  // NCCL runs over sockets (each rank names its own NCCL_HOSTID), the symmetric heap is mapped with
  // CUDA IPC and every rank is in the load/store team; all ranks must run on one machine.
  bool shares_gpus() const { return shares_gpus_; }

  // Host collectives, for bootstrap-sized data. `tag` names the call in timeout errors.
  std::vector<Bytes> all_gather(const std::string& tag, const Bytes& mine);
  void barrier(const std::string& tag);

  // Element-wise maximum over the ranks (every rank passes a vector of the same size), e.g. the
  // reduce hook of tdist::jit::Autotuner, so that all ranks pick the same winner.
  std::vector<double> max_across_ranks(const std::string& tag, const std::vector<double>& values);

  // Throws tdist::Error naming `what` and each rank's value when the ranks disagree.
  void check_same_on_all_ranks(const std::string& what, const std::string& value);

  // Call checking (call_checker.hpp; TDIST_CHECK_CALLS=first by default, always, off): before a
  // collective or overlapped op runs, the ranks compare its signature (op, counts, dtype, method
  // requested, buffer kinds) over the store, or through NCCL without one; a mismatch raises
  // tdist::Error on every rank naming each rank's call, instead of a device timeout on some ranks
  // and wrong data on the others. `key` is the call's CallKey; `describe()` gives its text and
  // runs only when the call is compared (the first call of a signature under `first`, every call
  // under `always`). A comparison that finds every rank alike remembers the key. One whose peers do
  // not arrive within call_compare_bound (the device wait timeout) raises tdist::TimeoutError naming
  // this rank's call and the missing ranks. `stream` is the
  // op's: a World without a store does not compare calls while it captures a graph (its
  // comparison would run on the GPU inside the capture); they are compared at their first call
  // outside capture. Collective: every rank calls it with the same mode.
  template <typename Describe>
  void check_same_call(uint64_t key, cudaStream_t stream, Describe&& describe) {
    if (call_checker_.must_compare(key)) compare_call(key, stream, describe());
  }
  // The same, keyed by the call's text.
  void check_same_call(const std::string& call);
  // The mode must be the same on every rank (World's constructors compare TDIST_CHECK_CALLS);
  // changing it keeps the signatures seen so far.
  void set_call_check_mode(CallCheckMode mode) { call_checker_.set_mode(mode); }
  CallCheckMode call_check_mode() const { return call_checker_.mode(); }
  const CallChecker& call_checker() const { return call_checker_; }

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
  // Aborted, or a device wait of this process gave up (runtime/device_fault.hpp): peers may be dead
  // and the ranks' flags are out of step, so teardown releases this rank's resources without meeting
  // the others (a meeting through NCCL would queue a kernel that a dead peer never lets finish).
  bool out_of_step() const;

 private:
  using Clock = std::chrono::steady_clock;
  void init_comm_bounded(const ncclUniqueId& id);
  // Polls `comm` until its pending operation finishes; on an NCCL error, the deadline, a dead
  // rank or another rank's init failure, aborts it (if asked) and throws via fail_init.
  void wait_comm(ncclComm_t comm, const char* stage, Clock::time_point deadline, bool abort_on_failure);
  [[noreturn]] void fail_init(const char* stage, const std::string& why, bool timed_out);
  std::string failed_ranks_message();
  void init_from_comm();
  // all_gather / check_same_on_all_ranks bounded by `timeout` rather than the host timeout.
  std::vector<Bytes> all_gather(const std::string& tag, const Bytes& mine, std::chrono::milliseconds timeout);
  void check_same_on_all_ranks(const std::string& what, const std::string& value, std::chrono::milliseconds timeout);
  std::vector<Bytes> all_gather_nccl(const Bytes& mine, std::chrono::milliseconds timeout);
  // `timeout`, or the device wait timeout when shorter and a device fault is recorded.
  std::chrono::milliseconds host_wait_bound(std::chrono::milliseconds timeout) const;
  void compare_call(uint64_t key, cudaStream_t stream, const std::string& call);
  // Every rank's TDIST_CHECK_CALLS alike, and TDIST_SHARE_GPUS with its host name, or an error naming
  // each rank's values.
  void check_same_settings();

  int rank_ = 0, world_size_ = 1, local_rank_ = 0, local_world_size_ = 1, device_ = 0;
  int lsa_rank_ = 0, lsa_size_ = 1;
  std::chrono::milliseconds timeout_;
  bool shares_gpus_ = false;
  std::unique_ptr<TcpStore> store_;  // null when wrapping an existing communicator
  std::atomic<ncclComm_t> comm_{nullptr};  // null once aborted (the watchdog's thread may abort)
  bool owns_comm_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex watchdog_mu_;
  std::unique_ptr<detail::NcclWatchdog> nccl_watchdog_;  // started at the first watched NCCL call
  uint64_t collective_count_ = 0;  // makes store tags unique per call
  CallChecker call_checker_;
};

// Sets `world`'s call check mode for a scope, then restores it (every rank alike): e.g. off around
// timed candidate calls, which the ranks agreed on as a whole and which a host exchange per call
// would slow down. The signatures seen stay remembered.
class ScopedCallCheckMode {
 public:
  ScopedCallCheckMode(World& world, CallCheckMode mode) : world_(world), was_(world.call_check_mode()) {
    world.set_call_check_mode(mode);
  }
  ~ScopedCallCheckMode() { world_.set_call_check_mode(was_); }
  ScopedCallCheckMode(const ScopedCallCheckMode&) = delete;
  ScopedCallCheckMode& operator=(const ScopedCallCheckMode&) = delete;

 private:
  World& world_;
  CallCheckMode was_;
};

}  // namespace tdist
