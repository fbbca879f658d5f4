// Decode attention: tdist's single-GPU kernel against the HBM floor (the KV bytes at this GPU's
// measured copy bandwidth) and against a simple kernel (one CTA per query head, no split), and the
// sequence-parallel op (each rank holding 1 / world of every sequence) against the single-GPU
// kernel on the whole cache. Paged cache (16-token pages in shuffled order), bf16.
//
//   tdistrun -n 2 -- bench_flash_decode [--quick] [--json FILE]
//
// Rows: impl "tdist" (single GPU, method "single"), "floor" (bytes / copy bandwidth), "simple",
// and "tdist" method "distributed" (world_size ranks); each with us and the KV bytes read.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../tools/common/bench_report.hpp"
#include "fill_random.cuh"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/json.hpp"
#include "tdist/ops/flash_decode.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/timing.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

constexpr int kPage = 16;
constexpr int kDim = 128;

// The simple baseline: one CTA of kDim threads per (sequence, query head), thread j owning dim j,
// scores through a block reduction, online softmax over the whole sequence. No split, no vectors.
__global__ void simple_decode(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const int* table,
                              const int* lens, __nv_bfloat16* out, int q_heads, int kv_heads, int max_pages,
                              float scale) {
  __shared__ float red[kDim / 32];
  const int b = blockIdx.y, h = blockIdx.x, j = threadIdx.x, kh = h / (q_heads / kv_heads);
  const float qj = __bfloat162float(q[(static_cast<size_t>(b) * q_heads + h) * kDim + j]) * scale;
  float m = -1e30f, l = 0.f, acc = 0.f;
  for (int t = 0; t < lens[b]; ++t) {
    const size_t row = (static_cast<size_t>(table[b * max_pages + t / kPage]) * kPage + t % kPage) * kv_heads + kh;
    float s = qj * __bfloat162float(k[row * kDim + j]);
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (j % 32 == 0) red[j / 32] = s;
    __syncthreads();
    s = 0.f;
    for (int w = 0; w < kDim / 32; ++w) s += red[w];
    __syncthreads();
    const float mn = fmaxf(m, s), a = __expf(m - mn), p = __expf(s - mn);
    l = l * a + p;
    acc = acc * a + p * __bfloat162float(v[row * kDim + j]);
    m = mn;
  }
  out[(static_cast<size_t>(b) * q_heads + h) * kDim + j] = __float2bfloat16(l > 0.f ? acc / l : 0.f);
}

struct Model {
  const char* name;
  int q_heads, kv_heads;
};

}  // namespace

int run(bool quick, int iters, const std::string& json_path, int argc, char** argv) {
  World world;
  const int n = world.world_size(), me = world.rank();
  SymmetricHeap heap(world, size_t{256} << 20);
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));

  // This GPU's copy bandwidth (read + write bytes per second) on 2 GiB.
  double copy_gbps = 0;
  {
    const size_t bytes = size_t{1} << 31;
    DeviceBuffer a(bytes), b(bytes);
    const double ms = slowest_rank_median_ms(world, stream, iters, [&] {
      TDIST_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    copy_gbps = 2.0 * bytes / (ms * 1e6);
  }

  const Model models[] = {{"llama3-8b", 32, 8}, {"llama3-70b", 64, 8}};
  const std::vector<int64_t> batches = quick ? std::vector<int64_t>{1, 8} : std::vector<int64_t>{1, 8, 32};
  const std::vector<int64_t> lengths =
      quick ? std::vector<int64_t>{4096, 32768} : std::vector<int64_t>{4096, 32768, 131072};
  FlashDecode single;
  json::Value doc = bench::document("flash_decode", prop.name, n, "bf16", argc, argv);
  doc["copy_gbps"] = copy_gbps;
  doc["iters"] = iters;
  if (me == 0) {
    std::printf("\ndecode attention, bf16, page %d, head dim %d, %s, copy bandwidth %.0f GB/s, %d ranks\n", kPage, kDim,
                prop.name, copy_gbps, n);
    std::printf("%-11s %5s %7s %10s %10s %8s %10s %8s %12s %8s\n", "model", "batch", "tokens", "tdist us", "floor us",
                "of copy", "simple us", "speedup", "distrib. us", "ratio");
  }
  std::mt19937_64 rng(12345);
  for (const Model& model : models) {
    for (int64_t batch : batches) {
      for (int64_t tokens : lengths) {
        const int64_t max_pages = (tokens + kPage - 1) / kPage, num_pages = batch * max_pages;
        const size_t kv_elems = static_cast<size_t>(num_pages) * kPage * model.kv_heads * kDim;
        const double kv_bytes = 2.0 * batch * tokens * model.kv_heads * kDim * sizeof(__nv_bfloat16);
        DeviceBuffer q(batch * model.q_heads * kDim * 2), k(kv_elems * 2), v(kv_elems * 2),
            out(batch * model.q_heads * kDim * 2), lse(batch * model.q_heads * 4), table(num_pages * 4),
            lens(batch * 4), local_lens(batch * 4);
        fill_random<<<1024, 256, 0, stream>>>(q.get<unsigned short>(), batch * model.q_heads * kDim, 1, true);
        fill_random<<<4096, 256, 0, stream>>>(k.get<unsigned short>(), kv_elems, 2, true);
        fill_random<<<4096, 256, 0, stream>>>(v.get<unsigned short>(), kv_elems, 3, true);
        std::vector<int32_t> pages(num_pages);
        std::iota(pages.begin(), pages.end(), 0);
        std::shuffle(pages.begin(), pages.end(), rng);
        TDIST_CUDA_CHECK(cudaMemcpy(table.get(), pages.data(), pages.size() * 4, cudaMemcpyHostToDevice));
        // Whole sequences for the single-GPU runs; the distributed run reads this rank's share of
        // each sequence (its first tokens / world tokens' pages: the same bytes a rank would hold).
        const int64_t local = (tokens + n - 1) / n;
        std::vector<int32_t> whole(batch, static_cast<int32_t>(tokens)), share(batch, static_cast<int32_t>(local));
        TDIST_CUDA_CHECK(cudaMemcpy(lens.get(), whole.data(), batch * 4, cudaMemcpyHostToDevice));
        TDIST_CUDA_CHECK(cudaMemcpy(local_lens.get(), share.data(), batch * 4, cudaMemcpyHostToDevice));
        TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));

        FlashDecodeArgs a;
        a.dtype = DType::kBFloat16;
        a.batch = batch;
        a.q_heads = model.q_heads;
        a.kv_heads = model.kv_heads;
        a.head_dim = kDim;
        a.q = q.get();
        a.k_cache = k.get();
        a.v_cache = v.get();
        a.num_pages = num_pages;
        a.page_size = kPage;
        a.block_table = table.get<int32_t>();
        a.max_pages = max_pages;
        a.seq_lens = lens.get<int32_t>();
        a.out = out.get();
        a.lse = lse.get<float>();
        a.softmax_scale = 0.08838834764f;
        a.max_seq_len = tokens;
        const double t_single = slowest_rank_median_ms(world, stream, iters, [&] { single.run(a, stream); }) * 1e3;
        single.check_errors();
        const double t_floor = kv_bytes / (copy_gbps * 1e3);
        double t_simple = 0;
        if (tokens <= 32768 || batch == 1) {  // minutes otherwise
          t_simple =
              slowest_rank_median_ms(world, stream, std::min(iters, 5),
                                     [&] {
                                       simple_decode<<<dim3(model.q_heads, batch), kDim, 0, stream>>>(
                                           q.get<__nv_bfloat16>(), k.get<__nv_bfloat16>(), v.get<__nv_bfloat16>(),
                                           table.get<int>(), lens.get<int>(), out.get<__nv_bfloat16>(), model.q_heads,
                                           model.kv_heads, static_cast<int>(max_pages), a.softmax_scale);
                                     }) *
              1e3;
        }
        double t_dist = 0;
        if (n > 1) {
          DistributedFlashDecode dist(world, heap, {.max_batch = batch, .q_heads = model.q_heads, .head_dim = kDim});
          FlashDecodeArgs d = a;
          d.seq_lens = local_lens.get<int32_t>();
          d.max_seq_len = local;
          t_dist = slowest_rank_median_ms(world, stream, iters, [&] { dist.run(d, stream); }) * 1e3;
          dist.check_errors();
        }
        if (me == 0) {
          std::printf("%-11s %5lld %7lld %10.1f %10.1f %7.0f%% %10.1f %8.1f %12.1f %8.2f\n", model.name,
                      static_cast<long long>(batch), static_cast<long long>(tokens), t_single, t_floor,
                      100.0 * t_floor / t_single, t_simple, t_simple > 0 ? t_simple / t_single : 0.0, t_dist,
                      t_dist > 0 ? t_dist / t_single : 0.0);
          std::fflush(stdout);
          auto row = [&](const char* impl, const char* method, double us, int ranks) {
            json::Value r = json::Object{{"op", "flash_decode"},
                                         {"model", model.name},
                                         {"batch", batch},
                                         {"tokens", tokens},
                                         {"q_heads", model.q_heads},
                                         {"kv_heads", model.kv_heads},
                                         {"head_dim", kDim},
                                         {"impl", impl},
                                         {"method", method},
                                         {"ranks", ranks},
                                         {"us", us},
                                         {"bytes", kv_bytes},
                                         {"algbw_gbps", kv_bytes / (us * 1e3)}};
            doc["rows"].push_back(r);
          };
          row("tdist", "single", t_single, 1);
          row("floor", "copy bandwidth", t_floor, 1);
          if (t_simple > 0) row("simple", "one CTA per head", t_simple, 1);
          if (t_dist > 0) row("tdist", "distributed", t_dist, n);
        }
      }
    }
  }
  if (me == 0 && !json_path.empty()) json::write_file(json_path, doc);
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

int main(int argc, char** argv) {
  bool quick = false;
  int iters = 20;
  std::string json_path;
  tdist::cli::Parser p("bench_flash_decode",
                       "Decode attention: tdist's split-KV kernel beside the HBM floor and a simple kernel, and the\n"
                       "sequence-parallel op beside the single-GPU kernel. Run under tdistrun -n 2 (or alone).");
  p.flag("--quick", "batches 1 and 8, 4K and 32K tokens", &quick);
  p.option("--iters", "N", "timings per figure, the median is kept (default 20)", &iters, 3, 1000000);
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &json_path);
  p.parse(argc, argv);
  return tdist::cli::run_main("bench_flash_decode", [&] { return run(quick, iters, json_path, argc, argv); });
}
