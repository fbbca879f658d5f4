#include "tdist/runtime/world.hpp"

#include <cuda_runtime_api.h>
#include <nccl_device.h>  // ncclTeamLsa (host part of the device API)
#include <unistd.h>       // gethostname

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/process.hpp"
#include "src/runtime/nccl_watchdog.hpp"
#include "tdist/runtime/device_fault.hpp"
#include "tdist/runtime/stream.hpp"
#include "tdist/runtime/wait_config.hpp"
#include "tdist/version.hpp"

namespace tdist {
namespace {

using Clock = std::chrono::steady_clock;

// How often a watchdog wait looks at NCCL's state, and at the store for dead or failed ranks.
constexpr auto kPollInterval = std::chrono::milliseconds(1);
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(200);
// Counter of ranks whose NCCL initialisation failed, and each one's reason, in the store.
const std::string kInitFailures = "tdist/nccl_init/failures";
std::string init_failure_key(int rank) { return "tdist/nccl_init/failed/" + std::to_string(rank); }

Bytes to_bytes(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  return Bytes(p, p + size);
}

int select_device(int requested, int local_rank, bool share_gpus) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0)
    TDIST_FAIL("no CUDA device is usable (", cudaGetErrorString(err), "); tdist needs one GPU per rank");
  const int device = requested >= 0 ? requested : share_gpus ? local_rank % count : local_rank;
  if (device >= count)
    TDIST_FAIL("this rank wants GPU ", device, (requested >= 0 ? " (WorldOptions::device)" : " (LOCAL_RANK)"),
               " but only ", count,
               " are visible; start at most one rank per GPU (or set TDIST_SHARE_GPUS=1 to test with "
               "several ranks on one GPU)");
  TDIST_CUDA_CHECK(cudaSetDevice(device));
  return device;
}

// NCCL refuses two ranks on one GPU of one host. Under TDIST_SHARE_GPUS each rank names a host of
// its own (NCCL_HOSTID, read by NCCL at init; a value the user set is kept), so NCCL connects the
// ranks over sockets and never compares their GPUs; the load/store team is then tdist's to form
// (World::init_from_comm, SymmetricHeap).
void claim_own_nccl_host(int rank) {
  const std::string host_id = detail::concat("tdist-shared-gpu-rank-", rank);
  setenv("NCCL_HOSTID", host_id.c_str(), /*overwrite=*/0);
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "(unknown host)";
  return name;
}

}  // namespace

World::World(const WorldOptions& options)
    : timeout_(options.timeout),
      shares_gpus_(env::flag("TDIST_SHARE_GPUS")),
      call_checker_(call_check_mode_from_env()) {
  const LaunchEnv env = options.env ? *options.env : launch_env_from_process();
  rank_ = env.rank;
  world_size_ = env.world_size;
  local_rank_ = env.local_rank;
  local_world_size_ = env.local_world_size;
  device_ = select_device(options.device, local_rank_, shares_gpus_);
  if (shares_gpus_) claim_own_nccl_host(rank_);

  TcpStoreOptions store_options;
  store_options.host = env.master_addr;
  store_options.port = env.master_port;
  store_options.rank = rank_;
  store_options.world_size = world_size_;
  store_options.timeout = timeout_;
  store_ = std::make_unique<TcpStore>(store_options);

  ncclUniqueId id;
  if (rank_ == 0) {
    id = new_unique_id();
    store_->set("tdist/nccl_unique_id", to_bytes(&id, sizeof(id)));
  }
  const Bytes id_bytes = store_->get("tdist/nccl_unique_id");
  TDIST_CHECK(id_bytes.size() == sizeof(id), "the NCCL unique id from rank 0 has ", id_bytes.size(),
              " bytes, expected ", sizeof(id), " (ranks built against different NCCL versions?)");
  std::memcpy(&id, id_bytes.data(), sizeof(id));

  // Every rank is known to be alive right before the collective init (a missing rank times out in
  // this barrier, naming it).
  store_->barrier("tdist/before_nccl_init");
  if (env::flag("TDIST_NCCL_BOUNDED_INIT", true)) {
    init_comm_bounded(id);
  } else {
    // Unbounded: a rank dying during the init blocks the others (kept to rule the bounded path
    // out when diagnosing an init problem).
    ncclComm_t comm = nullptr;
    TDIST_NCCL_CHECK(ncclCommInitRank(&comm, world_size_, id, rank_));
    comm_ = comm;
  }
  owns_comm_ = true;
  init_from_comm();
}

// NCCL's initialisation is bounded by running it non-blocking and polling its state against the
// deadline, the store's dead ranks and the other ranks' failures; on any of them the communicator
// is aborted (ncclCommAbort never blocks) and this rank throws naming the stage.
//
// A non-blocking communicator makes every later NCCL call asynchronous too (a collective may
// return ncclInProgress and launch from a helper thread, which breaks stream order and graph
// capture), so the job's communicator is a blocking one split off the non-blocking one. The split
// is launched through the non-blocking parent and so is bounded the same way; the parent is then
// finalised (bounded) and destroyed.
void World::init_comm_bounded(const ncclUniqueId& id) {
  const auto deadline = Clock::now() + timeout_;
  ncclConfig_t parent_config = NCCL_CONFIG_INITIALIZER;
  parent_config.blocking = 0;
  ncclComm_t parent = nullptr;
  ncclUniqueId unique = id;
  ncclResult_t r = ncclCommInitRankConfig(&parent, world_size_, unique, rank_, &parent_config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (parent != nullptr) ncclCommAbort(parent);
    fail_init("NCCL communicator init (ncclCommInitRankConfig)", ncclGetErrorString(r), false);
  }
  wait_comm(parent, "NCCL communicator init", deadline, /*abort_on_failure=*/true);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t child = nullptr;
  r = ncclCommSplit(parent, /*color=*/0, /*key=*/rank_, &child, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    ncclCommAbort(parent);
    if (child != nullptr) ncclCommAbort(child);
    fail_init("NCCL communicator split (ncclCommSplit)", ncclGetErrorString(r), false);
  }
  try {
    // The split runs through the non-blocking parent, which reports its completion.
    wait_comm(parent, "NCCL communicator split (parent)", deadline, /*abort_on_failure=*/false);
    if (child == nullptr) TDIST_FAIL("ncclCommSplit returned no communicator");
    wait_comm(child, "NCCL communicator split", deadline, /*abort_on_failure=*/true);
  } catch (...) {
    ncclCommAbort(parent);
    throw;
  }
  comm_ = child;

  // The parent has served its purpose; its finalize is non-blocking, so it is bounded as well.
  // Whatever goes wrong here costs only the parent: abort it, the job's communicator is ready.
  bool finalized = false;
  if (const ncclResult_t f = ncclCommFinalize(parent); f == ncclSuccess || f == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    while (ncclCommGetAsyncError(parent, &state) == ncclSuccess && state == ncclInProgress && Clock::now() < deadline)
      std::this_thread::sleep_for(kPollInterval);
    finalized = state == ncclSuccess;
  }
  if (!finalized || ncclCommDestroy(parent) != ncclSuccess) ncclCommAbort(parent);
}

void World::wait_comm(ncclComm_t comm, const char* stage, Clock::time_point deadline, bool abort_on_failure) {
  auto next_peer_check = Clock::now() + kPeerCheckInterval;
  while (true) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return;
    std::string why;
    bool timed_out = false;
    if (state != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      why = detail::concat(ncclGetErrorString(state), last && *last ? std::string(" (") + last + ")" : "");
    } else if (Clock::now() > deadline) {
      why = detail::concat("not finished within ", timeout_.count(),
                           " ms (the host timeout: the one passed to init, or TDIST_HOST_TIMEOUT_S)");
      timed_out = true;
    } else if (store_ && Clock::now() >= next_peer_check) {
      next_peer_check = Clock::now() + kPeerCheckInterval;
      try {
        store_->check_alive();  // throws naming the ranks that died
        if (store_->add(kInitFailures, 0) > 0) why = failed_ranks_message();
      } catch (const Error& e) {
        why = e.what();
      }
    }
    if (!why.empty()) {
      if (abort_on_failure) ncclCommAbort(comm);
      fail_init(stage, why, timed_out);
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

std::string World::failed_ranks_message() {
  std::string out;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_ || !store_->check({init_failure_key(r)})) continue;
    const Bytes why = store_->get(init_failure_key(r));
    out += detail::concat(out.empty() ? "" : "; ", "rank ", r, " failed: ", std::string(why.begin(), why.end()));
  }
  return out.empty() ? std::string("another rank failed") : out;
}

void World::fail_init(const char* stage, const std::string& why, bool timed_out) {
  const std::string message = detail::concat(stage, " failed on rank ", rank_, " of ", world_size_, ": ", why);
  // Tell the others, so that they stop waiting for this rank now rather than at their deadline.
  if (store_) {
    try {
      store_->set(init_failure_key(rank_), Bytes(message.begin(), message.end()));
      store_->add(kInitFailures, 1);
    } catch (const Error&) {
      // The store is gone too: the others learn it from their own store connections.
    }
  }
  if (timed_out) throw TimeoutError(detail::concat(__FILE__, ":", __LINE__, ": ", message));
  TDIST_FAIL(message);
}

ncclUniqueId World::new_unique_id() {
  ncclUniqueId id;
  TDIST_NCCL_CHECK(ncclGetUniqueId(&id));
  return id;
}

World::World(const ncclUniqueId& id, int rank, int world_size, int device, std::chrono::milliseconds timeout)
    : timeout_(timeout), shares_gpus_(env::flag("TDIST_SHARE_GPUS")), call_checker_(call_check_mode_from_env()) {
  TDIST_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size, "rank", "expected 0 <= rank < world_size (",
                  world_size, "), got ", rank);
  TDIST_CHECK_ARG(device >= 0, "device", "expected a CUDA device index, got ", device);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  TDIST_CHECK(err == cudaSuccess && count > 0, "no CUDA device is usable (", cudaGetErrorString(err), ")");
  TDIST_CHECK_ARG(device < count, "device", "device ", device, " requested, ", count, " visible");
  rank_ = rank;
  world_size_ = world_size;
  device_ = device;
  TDIST_CUDA_CHECK(cudaSetDevice(device_));
  if (shares_gpus_) claim_own_nccl_host(rank_);
  if (env::flag("TDIST_NCCL_BOUNDED_INIT", true)) {
    init_comm_bounded(id);
  } else {
    ncclUniqueId unique = id;
    ncclComm_t comm = nullptr;
    TDIST_NCCL_CHECK(ncclCommInitRank(&comm, world_size_, unique, rank_));
    comm_ = comm;
  }
  owns_comm_ = true;
  init_from_comm();
  local_rank_ = lsa_rank_;
  local_world_size_ = lsa_size_;
}

World::World(ncclComm_t existing, std::chrono::milliseconds timeout)
    : timeout_(timeout),
      shares_gpus_(env::flag("TDIST_SHARE_GPUS")),
      comm_(existing),
      call_checker_(call_check_mode_from_env()) {
  TDIST_CHECK_ARG(existing != nullptr, "existing", "expected an initialised ncclComm_t, got nullptr");
  TDIST_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
  TDIST_NCCL_CHECK(ncclCommCount(comm_, &world_size_));
  TDIST_NCCL_CHECK(ncclCommCuDevice(comm_, &device_));
  TDIST_CUDA_CHECK(cudaSetDevice(device_));
  init_from_comm();
  // Local placement is not part of a communicator: derive it from the LSA team (one node's GPUs).
  local_rank_ = lsa_rank_;
  local_world_size_ = lsa_size_;
}

World::~World() {
  nccl_watchdog_.reset();  // first: its thread may abort the communicator
  if (!owns_comm_ || comm_ == nullptr || aborted_) return;  // aborted: nothing left to release
  // With an asynchronous error pending, or after a device wait gave up (a peer may be dead), NCCL
  // work may never finish: finalize would block on it, so abort instead (ncclCommAbort never
  // blocks). Otherwise finalize flushes the outstanding work. A failure must not throw from a
  // destructor.
  ncclResult_t state = ncclSuccess;
  const bool healthy = ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclSuccess && !out_of_step();
  if (healthy && ncclCommFinalize(comm_) == ncclSuccess)
    ncclCommDestroy(comm_);
  else
    ncclCommAbort(comm_);
}

void World::abort(const std::string& why) noexcept {
  if (comm_ == nullptr || aborted_.exchange(true)) return;
  if (!owns_comm_) {
    // The caller's communicator is the caller's to abort (it would destroy it afterwards).
    std::fprintf(stderr,
                 "tdist: rank %d: the NCCL communicator passed to World has work that cannot finish (%s); "
                 "abort it with ncclCommAbort rather than finalizing it\n",
                 rank_, why.c_str());
    return;
  }
  std::fprintf(stderr, "tdist: rank %d aborts its NCCL communicator: %s\n", rank_, why.c_str());
  // The communicator has work queued that will never complete; aborting it is the only way to
  // release the stream and to keep the destructor's finalize from blocking. It frees the
  // communicator: later calls find no communicator rather than a freed one.
  ncclCommAbort(comm_.exchange(nullptr));
}

bool World::out_of_step() const { return aborted_ || device_fault_recorded(); }

void World::watch_nccl(cudaStream_t stream, const std::string& what) {
  // Off by default: on 2 x H200 the abort named the stuck op but the survivor's stream did not drain
  // after ncclCommAbort, and an earlier version's event polling broke a graph capture of another
  // thread (now polled in the relaxed capture mode, not yet run on GPUs).
  static const double timeout_s = env::seconds("TDIST_NCCL_TIMEOUT_S", 0.0, 0.0, env::kMaxTimeoutSeconds);
  if (timeout_s <= 0 || !owns_comm_) return;  // off, or a caller's communicator (the caller's to abort)
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TDIST_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  std::lock_guard<std::mutex> lock(watchdog_mu_);
  if (!nccl_watchdog_)
    nccl_watchdog_ = std::make_unique<detail::NcclWatchdog>(device_, timeout_s, [this](const std::string& op,
                                                                                      double seconds) {
      const std::string why = detail::concat("the NCCL ", op, " did not finish within ", seconds,
                                             " s (TDIST_NCCL_TIMEOUT_S): a peer died, hung, or called another op");
      try {
        record_host_fault(device::WaitSite::kNcclOp, rank_, seconds, why);  // device waits give up too
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tdist: rank %d: recording the NCCL timeout failed: %s\n", rank_, e.what());
      }
      abort(why);
    });
  nccl_watchdog_->watch(stream, what);
}

void World::init_from_comm() {
  set_process_rank(rank_);
  log_startup(device_);
  const ncclTeam_t lsa = ncclTeamLsa(comm_);
  lsa_rank_ = lsa.rank;
  lsa_size_ = lsa.nRanks;
  check_same_settings();
  if (shares_gpus_) {
    // NCCL sees a host per rank (a team of one each); the ranks share this machine's GPUs, so all of
    // them form the load/store team (the heap maps the peers' memory with CUDA IPC).
    lsa_rank_ = rank_;
    lsa_size_ = world_size_;
  }
}

std::vector<Bytes> World::all_gather(const std::string& tag, const Bytes& mine) {
  return all_gather(tag, mine, timeout_);
}

std::vector<Bytes> World::all_gather(const std::string& tag, const Bytes& mine, std::chrono::milliseconds timeout) {
  ++collective_count_;
  timeout = host_wait_bound(timeout);
  if (store_) return store_->all_gather(detail::concat("tdist/ag/", collective_count_, "/", tag), mine, timeout);
  return all_gather_nccl(mine, timeout);
}

void World::barrier(const std::string& tag) {
  ++collective_count_;
  // The store tells a dead rank at once; NCCL cannot, so its barrier is bounded.
  if (store_) return store_->barrier(detail::concat("tdist/barrier/", collective_count_, "/", tag));
  all_gather_nccl({}, host_wait_bound(timeout_));
}

std::chrono::milliseconds World::host_wait_bound(std::chrono::milliseconds timeout) const {
  // After a device wait gave up, a peer may be dead: a host collective that still runs (an op set up
  // or compared after the fault) gives up at the device wait timeout, as call comparisons do, not
  // minutes later. Through NCCL the first to give up aborts the communicator, and later ones fail at
  // once. Teardown does not meet at all then (out_of_step).
  if (!device_fault_recorded()) return timeout;
  return std::min(timeout, call_compare_bound(timeout, wait_timeout_seconds_from_env()).timeout);
}

std::vector<double> World::max_across_ranks(const std::string& tag, const std::vector<double>& values) {
  const auto* p = reinterpret_cast<const uint8_t*>(values.data());
  const auto all = all_gather(tag, Bytes(p, p + values.size() * sizeof(double)));
  std::vector<double> result = values;
  for (size_t r = 0; r < all.size(); ++r) {
    TDIST_CHECK(all[r].size() == values.size() * sizeof(double), "max_across_ranks('", tag, "'): rank ", r, " sent ",
                all[r].size() / sizeof(double), " values, this rank ", values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      double v;
      std::memcpy(&v, all[r].data() + i * sizeof(double), sizeof(double));
      result[i] = std::max(result[i], v);
    }
  }
  return result;
}

void World::check_same_on_all_ranks(const std::string& what, const std::string& value) {
  check_same_on_all_ranks(what, value, timeout_);
}

void World::check_same_on_all_ranks(const std::string& what, const std::string& value,
                                    std::chrono::milliseconds timeout) {
  const auto values = all_gather(what, to_bytes(value.data(), value.size()), timeout);
  bool same = true;
  for (const auto& v : values) same = same && v == values[rank_];
  if (same) return;
  std::ostringstream os;
  os << "ranks disagree on " << what << ":";
  for (size_t r = 0; r < values.size(); ++r)
    os << " rank " << r << "=" << std::string(values[r].begin(), values[r].end()) << (r + 1 < values.size() ? "," : "");
  TDIST_FAIL(os.str());
}

namespace {
// One tag for every op, so that ranks calling different ops meet here and see each other's call.
const std::string kCallTag = "the op called (TDIST_CHECK_CALLS)";
}  // namespace

CallCompareBound call_compare_bound(std::chrono::milliseconds host_timeout, double wait_timeout_seconds) {
  TDIST_CHECK_ARG(host_timeout.count() > 0, "host_timeout", "expected a positive duration, got ",
                  host_timeout.count(), " ms");
  TDIST_CHECK_ARG(std::isfinite(wait_timeout_seconds) && wait_timeout_seconds > 0, "wait_timeout_seconds",
                  "expected a positive number of seconds, got ", wait_timeout_seconds);
  // Whole milliseconds (the store's unit), rounded up so as never to give up before the device waits
  // would (the slack absorbs 0.007 * 1000 = 7.000000000000001); at least 1 ms.
  const auto wait = std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(wait_timeout_seconds * 1000.0 - 1e-6))));
  if (host_timeout < wait) return {host_timeout, "the host timeout, TDIST_HOST_TIMEOUT_S"};
  return {wait, "the device wait timeout, TDIST_WAIT_TIMEOUT_S"};
}

std::string call_compare_timeout_message(const std::string& error, const std::string& call,
                                         const CallCompareBound& bound, CallCheckMode mode) {
  std::string out = detail::concat("this rank compared its call ", call,
                                   " with the other ranks' (TDIST_CHECK_CALLS), and they did not arrive within ",
                                   bound.timeout.count(), " ms (", bound.setting, "): ", error);
  // A rank that did not come may be running a call it had seen before while this one is new here:
  // say so, since the timeout alone does not.
  if (mode == CallCheckMode::kFirst)
    out += ". Under TDIST_CHECK_CALLS=first a rank compares a call only the first time it sees its signature: a "
           "rank absent here may be running another call it has seen before (a mismatch); TDIST_CHECK_CALLS=always "
           "compares every call";
  else
    out += ". A rank absent here died, hung, or skipped the call";
  return out;
}

void World::check_same_call(const std::string& call) {
  check_same_call(CallKey(call).value(), nullptr, [&] { return call; });
}

void World::compare_call(uint64_t key, cudaStream_t stream, const std::string& call) {
  // Without a store the comparison is an NCCL all-gather with host synchronisation, which a graph
  // capture must not see: left to the first call outside capture (not remembered).
  if (!store_ && stream_is_capturing(stream)) return;
  // A peer that does not come here would leave the op's kernels waiting for it: give up when they
  // would (the setting read now, as each kernel module reads it when it loads), not at the host
  // timeout. The NCCL path aborts the communicator then, so that its queued all-gather does not
  // block finalize.
  const CallCompareBound bound = call_compare_bound(timeout_, wait_timeout_seconds_from_env());
  try {
    check_same_on_all_ranks(kCallTag, call, bound.timeout);
  } catch (const DeviceTimeoutError&) {
    throw;
  } catch (const TimeoutError& e) {
    throw TimeoutError(detail::concat(__FILE__, ":", __LINE__, ": rank ", rank_, ": ",
                                      call_compare_timeout_message(e.what(), call, bound, call_checker_.mode())));
  }
  call_checker_.record(key);
}

void World::check_same_settings() {
  // One exchange at construction. A rank that compares calls while another does not would wait in
  // the comparison until the host timeout; ranks that share GPUs must all do so, on one machine.
  std::string value = to_string(call_checker_.mode());
  if (shares_gpus_) value += ", GPUs shared (TDIST_SHARE_GPUS=1) on " + host_name();
  check_same_on_all_ranks("the call check setting (TDIST_CHECK_CALLS) and, under TDIST_SHARE_GPUS=1, the machine",
                          value);
}

// Two NCCL all-gathers (lengths, then padded payloads) on a private stream, polled with a deadline.
std::vector<Bytes> World::all_gather_nccl(const Bytes& mine, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto run = [&](const void* send, size_t bytes, std::vector<uint8_t>& host_out) {
    uint8_t* dev = nullptr;
    TDIST_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes * (world_size_ + 1), stream));
    TDIST_CUDA_CHECK(cudaMemcpyAsync(dev, send, bytes, cudaMemcpyHostToDevice, stream));
    TDIST_NCCL_CHECK(ncclAllGather(dev, dev + bytes, bytes, ncclUint8, comm_, stream));
    host_out.resize(bytes * world_size_);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(host_out.data(), dev + bytes, host_out.size(), cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaFreeAsync(dev, stream));
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      ncclResult_t state = ncclSuccess;
      const bool failed =
          ncclCommGetAsyncError(comm_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress);
      if (failed || Clock::now() > deadline) {
        const std::string why =
            failed
                ? detail::concat("host all-gather through NCCL failed on rank ", rank_, ": ", ncclGetErrorString(state))
                : detail::concat("host all-gather through NCCL did not finish within ", timeout.count(),
                                 " ms on rank ", rank_, ": a rank did not join or died");
        // The queued all-gather would never finish and would block every later NCCL call and the
        // finalize: abort the communicator; the stream then drains and is released.
        abort(why);
        cudaStreamDestroy(stream);
        if (failed) TDIST_FAIL(why);
        throw TimeoutError(detail::concat(__FILE__, ":", __LINE__, ": ", why));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  const uint64_t my_size = mine.size();
  std::vector<uint8_t> sizes;
  run(&my_size, sizeof(my_size), sizes);
  uint64_t max_size = 1;
  for (int r = 0; r < world_size_; ++r) {
    uint64_t s;
    std::memcpy(&s, sizes.data() + r * sizeof(uint64_t), sizeof(s));
    max_size = std::max(max_size, s);
  }
  Bytes padded(max_size, 0);
  std::copy(mine.begin(), mine.end(), padded.begin());
  std::vector<uint8_t> all;
  run(padded.data(), max_size, all);
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  std::vector<Bytes> out(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    uint64_t s;
    std::memcpy(&s, sizes.data() + r * sizeof(uint64_t), sizeof(s));
    out[r].assign(all.begin() + r * max_size, all.begin() + r * max_size + s);
  }
  return out;
}

}  // namespace tdist
