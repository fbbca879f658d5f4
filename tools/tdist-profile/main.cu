// tdist-profile: runs the fused AllGather-GEMM and the AllGather push with the intra-kernel profiler
// and writes a Chrome / Perfetto trace of every rank (docs/profiling.md).
//
//   tdistrun -n 2 build/tools/tdist-profile --out trace.json [--m 8192 --n 4096 --k 8192] [--bytes 64M]
//   python3 bench/plot_trace.py trace.json trace.png
//
// Each op runs once to warm up (compile, first call), then --calls times profiled. Rank 0 writes the
// merged trace (pid = rank); --per-rank also writes each rank's own trace beside it.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/kernel_profiler.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

struct Options {
  int64_t m = 8192, n = 4096, k = 8192;
  uint64_t bytes = 64ull << 20;
  int calls = 1;
  int records = 0;
  std::string out = "kernel_trace.json";
  bool per_rank = false;
};

// Values in [-1, 1): what the GEMM computes does not change its timing, but NaN or Inf inputs could.
__global__ void fill_kernel(__nv_bfloat16* p, unsigned long long count, unsigned seed) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    p[i] = __float2bfloat16(static_cast<float>(x % 2048) / 1024.0f - 1.0f);
  }
}

void fill(void* p, size_t elements, unsigned seed, cudaStream_t s) {
  if (elements == 0) return;
  fill_kernel<<<264, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), elements, seed);
  TDIST_CUDA_CHECK(cudaGetLastError());
}

// Per kernel: tracks, spans of each kind and the time spent in waits (one line per kernel).
void print_summary(const ProfileSnapshot& s) {
  struct Sums {
    int tracks = 0;
    uint64_t tiles = 0, waits = 0, copies = 0, wait_ns = 0, max_wait_ns = 0;
  };
  std::map<int, Sums> per_kernel;
  for (const ProfileTrack& t : s.tracks) {
    Sums& x = per_kernel[static_cast<int>(t.kernel)];
    ++x.tracks;
    uint64_t wait_begin = 0;
    for (const device::ProfileRecord& r : t.records) {
      const auto e = static_cast<device::ProfileEvent>(r.event);
      if (e == device::ProfileEvent::kTileEnd) ++x.tiles;
      if (e == device::ProfileEvent::kCopyLand) ++x.copies;
      if (e == device::ProfileEvent::kWaitBegin) wait_begin = r.time_ns;
      if (e == device::ProfileEvent::kWaitEnd) {
        ++x.waits;
        x.wait_ns += r.time_ns - wait_begin;
        x.max_wait_ns = std::max<uint64_t>(x.max_wait_ns, r.time_ns - wait_begin);
      }
    }
  }
  for (const auto& [k, x] : per_kernel)
    std::printf("rank %d %s: %d tracks, %llu tile spans, %llu copies, %llu waits (%.1f us in all, longest %.1f us)\n",
                s.rank, profile_kernel_name(static_cast<device::ProfileKernel>(k)), x.tracks,
                static_cast<unsigned long long>(x.tiles), static_cast<unsigned long long>(x.copies),
                static_cast<unsigned long long>(x.waits), x.wait_ns * 1e-3, x.max_wait_ns * 1e-3);
  if (s.dropped_records() + s.lost_records > 0)
    std::printf("rank %d: %llu records dropped (raise --records), %llu lost (blocks past the buffer's slots)\n", s.rank,
                static_cast<unsigned long long>(s.dropped_records()), static_cast<unsigned long long>(s.lost_records));
}

int run(const Options& o) {
  World world;
  const int rank = world.rank(), w = world.world_size();
  // Before the ops are built: their kernels compile with the recorder.
  KernelProfiler::enable(KernelProfilerOptions{.records_per_track = o.records});
  const int sms = sm_count(world.device());
  const AllGatherGemmConfig cfg{.max_m = o.m, .k = o.k, .dtype = DType::kBFloat16};
  const size_t push_out = o.bytes * static_cast<size_t>(w);
  const size_t heap_bytes = all_gather_gemm_heap_bytes(cfg, w, sms) + Collectives::heap_bytes(w, push_out, sms) +
                            o.bytes + push_out + (64ull << 20);
  SymmetricHeap heap(world, heap_bytes);
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  AllGatherGemm ag(world, heap, cfg);
  Collectives coll(world, heap, push_out);
  const int64_t rows = static_cast<int64_t>(kernels::gemm::RowChunks{static_cast<uint64_t>(o.m), w}.rows(rank));
  DeviceBuffer a(rows * o.k * 2), b(o.n * o.k * 2), d(o.m * o.n * 2);
  void* in = heap.allocate(o.bytes);
  void* out = heap.allocate(push_out);
  fill(a.get(), rows * o.k, 1 + rank, stream);
  fill(b.get(), o.n * o.k, 100 + rank, stream);
  fill(in, o.bytes / 2, 200 + rank, stream);
  const AllGatherGemmArgs args{a.get(), b.get(), d.get(), nullptr, o.m, o.n};
  auto once = [&] {
    ag.run(args, stream, OverlapMethod::kFused);
    coll.all_gather(in, out, o.bytes / 2, DType::kBFloat16, stream, AllGatherMethod::kSmPush);
  };
  once();  // warm-up
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  world.barrier("tdist-profile warm");
  KernelProfiler::reset();
  world.barrier("tdist-profile reset");
  for (int i = 0; i < o.calls; ++i) once();
  const ProfileSnapshot snap = KernelProfiler::read(rank);
  print_summary(snap);

  const std::string bytes = snap.serialize();
  const auto all = world.all_gather("tdist-profile snapshots", Bytes(bytes.begin(), bytes.end()));
  std::string stem = o.out;
  if (stem.size() > 5 && stem.compare(stem.size() - 5, 5, ".json") == 0) stem.resize(stem.size() - 5);
  if (o.per_rank) write_chrome_trace(stem + ".rank" + std::to_string(rank) + ".json", {snap});
  if (rank == 0) {
    std::vector<ProfileSnapshot> ranks;
    for (const Bytes& b : all) ranks.push_back(ProfileSnapshot::deserialize(std::string(b.begin(), b.end())));
    const TraceStats st = write_chrome_trace(o.out, ranks);
    std::printf(
        "wrote %s: %d ranks, %llu events (AllGather-GEMM M=%lld N=%lld K=%lld bf16 fused, AllGather push %llu "
        "bytes per rank, %d profiled calls)\n",
        o.out.c_str(), w, static_cast<unsigned long long>(st.events), static_cast<long long>(o.m),
        static_cast<long long>(o.n), static_cast<long long>(o.k), static_cast<unsigned long long>(o.bytes), o.calls);
  }
  world.barrier("tdist-profile done");
  heap.free(out);
  heap.free(in);
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  KernelProfiler::disable();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  cli::Parser p("tdist-profile",
                "Runs the fused AllGather-GEMM (bf16) and the AllGather push with the intra-kernel profiler and\n"
                "writes a Chrome / Perfetto trace of every rank. Under a launcher, one GPU per rank:\n"
                "tdistrun -n 2 tdist-profile --out trace.json");
  p.option("--m", "M", "rows of the gathered A (default 8192)", &o.m, 1, int64_t{1} << 30);
  p.option("--n", "N", "columns of D per rank, a multiple of 8 (default 4096)", &o.n, 8, int64_t{1} << 30);
  p.option("--k", "K", "inner dimension, a multiple of 8 (default 8192)", &o.k, 8, int64_t{1} << 30);
  p.option("--bytes", "BYTES", "AllGather push bytes per rank, even (default 64M)",
           [&](const std::string& v) { o.bytes = cli::parse_size(v, "--bytes"); });
  p.option("--calls", "N", "profiled calls of each op (default 1)", &o.calls, 1, 1000);
  p.option("--records", "N", "records per track, 16 to 1048576 (default: TDIST_KERNEL_PROFILE_RECORDS, else 4096)",
           &o.records, 16, 1 << 20);
  p.option("--out", "FILE", "the merged trace, written by rank 0 (default kernel_trace.json)", &o.out);
  p.flag("--per-rank", "also write FILE's stem + .rank<R>.json on every rank", &o.per_rank);
  p.parse(argc, argv);
  if (o.n % 8 != 0 || o.k % 8 != 0) p.fail("--n and --k must be multiples of 8");
  if (o.bytes == 0 || o.bytes % 2 != 0) p.fail("--bytes must be even and above 0 (bf16 elements)");
  return cli::run_main("tdist-profile", [&] { return run(o); });
}
