// Put bandwidth between GPUs, every rank pushing to the next one at once (a ring; with 2 ranks,
// both directions of one link). tdist's block-scope put and copy-engine put, each beside a plain
// baseline in the same run: an int4 store loop through the LSA peer pointer, and a raw
// cudaMemcpyAsync to it; and the copy-engine put cut over 2 and 4 parallel streams, and shared with
// SMs. Medians of CUDA-event timings; the reported figure is the slowest rank's.
//
//   tdistrun -n 2 build/bench/bench_put_bandwidth [--bytes N] [--iters N] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../tools/common/bench_report.hpp"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/json.hpp"
#include "tdist/device.cuh"
#include "tdist/runtime/stream.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/timing.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;
using namespace tdist::device;

namespace {

// Each block puts one contiguous share of the buffer.
__global__ void block_put_kernel(SymmetricHeapView heap, char* dst, const char* src, u64 bytes, int peer) {
  const u64 share = (bytes / gridDim.x + 15) / 16 * 16;
  const u64 start = blockIdx.x * share;
  if (start < bytes)
    putmem_nbi_block(heap, dst + start, src + start, bytes - start < share ? bytes - start : share, peer);
}

// The baseline: a grid-stride int4 store loop into the peer pointer.
__global__ void plain_store_kernel(int4* dst, const int4* src, u64 count) {
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<u64>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

struct Row {
  std::string method;
  int sms;
  double tdist_gbps, baseline_gbps, reference_gbps;
};

// GB/s per direction of one put of `bytes`, on the slowest rank (a link is only as fast as its
// slower direction).
template <typename Launch>
double median_gbps(World& world, cudaStream_t stream, size_t bytes, int iters, Launch&& launch) {
  return bytes / (slowest_rank_median_ms(world, stream, iters, launch) * 1e6);
}

}  // namespace

int run(size_t bytes, int iters, const std::string& json_path, int argc, char** argv) {
  bytes = bytes / 16 * 16;
  World world;
  if (world.world_size() < 2) throw cli::UsageError("needs at least 2 ranks (tdistrun -n 2 bench_put_bandwidth)");
  const int peer = (world.rank() + 1) % world.world_size();
  SymmetricHeap heap(world, 2 * bytes + (4ull << 20));
  char* dst = heap.allocate_array<char>(bytes);
  char* src;
  TDIST_CUDA_CHECK(cudaMalloc(&src, bytes));
  TDIST_CUDA_CHECK(cudaMemset(src, 0x5A + world.rank(), bytes));  // non-zero data
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int num_sms = sm_count(world.device());
  char* peer_dst = heap.peer_ptr(dst, peer);

  // Reference figures measured on 2 x H200 with the same launch shapes (shared/BASELINES.md).
  auto reference = [](int sms) {
    return sms == 8 ? 287.0 : sms == 16 ? 294.0 : sms == 32 ? 343.0 : sms == 132 ? 364.0 : 0.0;
  };
  std::vector<Row> rows;
  std::vector<int> sm_counts = {8, 16, 32, num_sms};
  for (int sms : sm_counts) {
    // Launch shape of the baseline probe: 2 blocks of 512 threads per SM asked for.
    const int blocks = 2 * sms, threads = 512;
    const double t = median_gbps(world, stream, bytes, iters, [&] {
      block_put_kernel<<<blocks, threads, 0, stream>>>(heap.view(), dst, src, bytes, peer);
    });
    const double b = median_gbps(world, stream, bytes, iters, [&] {
      plain_store_kernel<<<blocks, threads, 0, stream>>>(reinterpret_cast<int4*>(peer_dst),
                                                         reinterpret_cast<const int4*>(src), bytes / 16);
    });
    TDIST_CUDA_CHECK(cudaGetLastError());
    rows.push_back({"SM put (block scope)", sms, t, b, reference(sms)});
  }
  {
    const double t = median_gbps(world, stream, bytes, iters, [&] { put_async(heap, dst, src, bytes, peer, stream); });
    const double b = median_gbps(world, stream, bytes, iters, [&] {
      TDIST_CUDA_CHECK(cudaMemcpyAsync(peer_dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    });
    rows.push_back({"copy-engine put", 0, t, b, 390.0});
    // The same put cut into equal parts on parallel streams: whether more than one copy engine
    // together beat one on the link. Baseline: the single cudaMemcpyAsync above.
    for (int parts : {2, 4}) {
      std::vector<cudaStream_t> side(parts);
      cudaEvent_t fork, done[4];
      TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      for (int i = 0; i < parts; ++i) {
        TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&side[i], cudaStreamNonBlocking));
        TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
      }
      const size_t part = bytes / parts / 16 * 16;
      const double tp = median_gbps(world, stream, bytes, iters, [&] {
        TDIST_CUDA_CHECK(cudaEventRecord(fork, stream));
        for (int i = 0; i < parts; ++i) {
          const size_t off = i * part, len = i + 1 == parts ? bytes - off : part;
          TDIST_CUDA_CHECK(cudaStreamWaitEvent(side[i], fork));
          put_async(heap, dst + off, src + off, len, peer, side[i]);
          TDIST_CUDA_CHECK(cudaEventRecord(done[i], side[i]));
          TDIST_CUDA_CHECK(cudaStreamWaitEvent(stream, done[i]));
        }
      });
      rows.push_back({"copy-engine put, " + std::to_string(parts) + " streams", 0, tp, b, 390.0});
      for (int i = 0; i < parts; ++i) {
        TDIST_CUDA_CHECK(cudaEventDestroy(done[i]));
        TDIST_CUDA_CHECK(cudaStreamDestroy(side[i]));
      }
      TDIST_CUDA_CHECK(cudaEventDestroy(fork));
    }
    // The copy engine and SMs together: the copy engine puts the first `ce_share` of the buffer
    // from a side stream while `sms` SMs put the rest (block-scope puts) on the main stream.
    cudaStream_t side;
    cudaEvent_t fork, done;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    for (int sms : {16, 32}) {
      for (int ce_pct : {60, 75}) {
        const size_t ce_bytes = bytes * ce_pct / 100 / 16 * 16;
        const double tc = median_gbps(world, stream, bytes, iters, [&] {
          TDIST_CUDA_CHECK(cudaEventRecord(fork, stream));
          TDIST_CUDA_CHECK(cudaStreamWaitEvent(side, fork));
          put_async(heap, dst, src, ce_bytes, peer, side);
          TDIST_CUDA_CHECK(cudaEventRecord(done, side));
          block_put_kernel<<<2 * sms, 512, 0, stream>>>(heap.view(), dst + ce_bytes, src + ce_bytes, bytes - ce_bytes,
                                                        peer);
          TDIST_CUDA_CHECK(cudaStreamWaitEvent(stream, done));
        });
        rows.push_back({"copy engine " + std::to_string(ce_pct) + "% + SMs", sms, tc, b, 390.0});
      }
    }
    TDIST_CUDA_CHECK(cudaEventDestroy(done));
    TDIST_CUDA_CHECK(cudaEventDestroy(fork));
    TDIST_CUDA_CHECK(cudaStreamDestroy(side));
  }

  if (world.rank() == 0) {
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    std::printf(
        "\nput bandwidth per direction, %d ranks on %s, %zu MB per put, all ranks pushing at once, median of %d\n",
        world.world_size(), prop.name, bytes >> 20, iters);
    std::printf("%-22s %5s %12s %14s %8s %16s %8s\n", "method", "SMs", "tdist GB/s", "baseline GB/s", "ratio",
                "BASELINES.md GB/s", "ratio");
    for (const Row& r : rows) {
      const std::string sms = r.sms ? std::to_string(r.sms) : "-";
      std::printf("%-22s %5s %12.0f %14.0f %8.2f %16.0f %8.2f\n", r.method.c_str(), sms.c_str(), r.tdist_gbps,
                  r.baseline_gbps, r.tdist_gbps / r.baseline_gbps, r.reference_gbps,
                  r.reference_gbps > 0 ? r.tdist_gbps / r.reference_gbps : 0.0);
    }
    if (!json_path.empty()) {
      // Schema tdist.bench/1: per method, tdist's put and its baseline (a plain store loop or cudaMemcpy).
      json::Value doc = bench::document("put_bandwidth", prop.name, world.world_size(), "bytes", argc, argv);
      doc["bytes"] = bytes;
      doc["iters"] = iters;
      for (const Row& r : rows) {
        for (const bool tdist_row : {true, false}) {
          const double gbps = tdist_row ? r.tdist_gbps : r.baseline_gbps;
          json::Value row =
              json::Object{{"op", "put"},        {"bytes", bytes}, {"impl", tdist_row ? "tdist" : "baseline"},
                           {"method", r.method}, {"sms", r.sms},   {"us", bytes / gbps * 1e-3},
                           {"algbw_gbps", gbps}};
          if (tdist_row && r.reference_gbps > 0) row["reference_gbps"] = r.reference_gbps;
          doc["rows"].push_back(row);
        }
      }
      json::write_file(json_path, doc);
    }
  }
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  TDIST_CUDA_CHECK(cudaFree(src));
  heap.free(dst);
  return 0;
}

int main(int argc, char** argv) {
  size_t bytes = 256ull << 20;
  int iters = 20;
  std::string json_path;
  tdist::cli::Parser p("bench_put_bandwidth",
                       "Put bandwidth over NVLink per direction, every rank pushing to the next at once: tdist's SM\n"
                       "and copy-engine puts beside plain store loops and cudaMemcpy. Run under tdistrun -n 2.");
  p.option("--bytes", "BYTES", "bytes per put, K/M/G suffixes (default 256M)",
           [&](const std::string& v) { bytes = tdist::cli::parse_size(v, "--bytes"); });
  p.option("--iters", "N", "timings per figure, the median is kept (default 20)", &iters, 3, 1000000);
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &json_path);
  p.parse(argc, argv);
  if (bytes < 16) p.fail("--bytes expects at least 16 bytes");
  return tdist::cli::run_main("bench_put_bandwidth", [&] { return run(bytes, iters, json_path, argc, argv); });
}
