#include "tdist/runtime/world.hpp"

#include <cuda_runtime_api.h>
#include <nccl_device.h>  // ncclTeamLsa (host part of the device API)

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/process.hpp"
#include "tdist/version.hpp"

namespace tdist {
namespace {

using Clock = std::chrono::steady_clock;

Bytes to_bytes(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  return Bytes(p, p + size);
}

int select_device(int requested, int local_rank) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0)
    TDIST_FAIL("no CUDA device is usable (", cudaGetErrorString(err), "); tdist needs one GPU per rank");
  const int device = requested >= 0 ? requested : local_rank;
  if (device >= count)
    TDIST_FAIL("this rank wants GPU ", device, (requested >= 0 ? " (WorldOptions::device)" : " (LOCAL_RANK)"),
               " but only ", count, " are visible; start at most one rank per GPU");
  TDIST_CUDA_CHECK(cudaSetDevice(device));
  return device;
}

}  // namespace

World::World(const WorldOptions& options) : timeout_(options.timeout) {
  const LaunchEnv env = options.env ? *options.env : launch_env_from_process();
  rank_ = env.rank;
  world_size_ = env.world_size;
  local_rank_ = env.local_rank;
  local_world_size_ = env.local_world_size;
  device_ = select_device(options.device, local_rank_);

  TcpStoreOptions store_options;
  store_options.host = env.master_addr;
  store_options.port = env.master_port;
  store_options.rank = rank_;
  store_options.world_size = world_size_;
  store_options.timeout = timeout_;
  store_ = std::make_unique<TcpStore>(store_options);

  ncclUniqueId id;
  if (rank_ == 0) {
    TDIST_NCCL_CHECK(ncclGetUniqueId(&id));
    store_->set("tdist/nccl_unique_id", to_bytes(&id, sizeof(id)));
  }
  const Bytes id_bytes = store_->get("tdist/nccl_unique_id");
  TDIST_CHECK(id_bytes.size() == sizeof(id), "the NCCL unique id from rank 0 has ", id_bytes.size(), " bytes, expected ",
              sizeof(id), " (ranks built against different NCCL versions?)");
  std::memcpy(&id, id_bytes.data(), sizeof(id));

  // Every rank is known to be alive right before the collective init (a missing rank times out in
  // this barrier, naming it), so the blocking init below cannot wait for a rank that never came.
  // A non-blocking communicator would make every later NCCL call asynchronous as well.
  store_->barrier("tdist/before_nccl_init");
  TDIST_NCCL_CHECK(ncclCommInitRank(&comm_, world_size_, id, rank_));
  owns_comm_ = true;
  init_from_comm();
}

World::World(ncclComm_t existing, std::chrono::milliseconds timeout) : timeout_(timeout), comm_(existing) {
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
  if (!owns_comm_ || comm_ == nullptr) return;
  // Finalize flushes outstanding NCCL work; a failure must not throw from a destructor.
  if (ncclCommFinalize(comm_) == ncclSuccess) ncclCommDestroy(comm_);
  else ncclCommAbort(comm_);
}

void World::init_from_comm() {
  set_process_rank(rank_);
  log_startup(device_);
  const ncclTeam_t lsa = ncclTeamLsa(comm_);
  lsa_rank_ = lsa.rank;
  lsa_size_ = lsa.nRanks;
}

std::vector<Bytes> World::all_gather(const std::string& tag, const Bytes& mine) {
  ++collective_count_;
  if (store_) return store_->all_gather(detail::concat("tdist/ag/", collective_count_, "/", tag), mine);
  return all_gather_nccl(mine);
}

void World::barrier(const std::string& tag) {
  ++collective_count_;
  if (store_) return store_->barrier(detail::concat("tdist/barrier/", collective_count_, "/", tag));
  all_gather_nccl({});
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
  const auto values = all_gather(what, to_bytes(value.data(), value.size()));
  bool same = true;
  for (const auto& v : values) same = same && v == values[rank_];
  if (same) return;
  std::ostringstream os;
  os << "ranks disagree on " << what << ":";
  for (size_t r = 0; r < values.size(); ++r)
    os << " rank " << r << "=" << std::string(values[r].begin(), values[r].end()) << (r + 1 < values.size() ? "," : "");
  TDIST_FAIL(os.str());
}

// Two NCCL all-gathers (lengths, then padded payloads) on a private stream, polled with a deadline.
std::vector<Bytes> World::all_gather_nccl(const Bytes& mine) {
  const auto deadline = Clock::now() + timeout_;
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
      if (Clock::now() > deadline)
        throw TimeoutError(detail::concat(__FILE__, ":", __LINE__, ": host all-gather through NCCL did not finish within ",
                                          timeout_.count(), " ms: a rank did not join"));
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
