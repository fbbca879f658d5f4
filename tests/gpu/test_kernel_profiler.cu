// The intra-kernel profiler on the GPU (runtime/kernel_profiler.hpp, device/profile.cuh), at any
// world size (1 included): the profiler is enabled before the ops are built, so their JIT kernels
// compile with the recorder, then
//   * the fused AllGather-GEMM (bf16, odd M and N, fresh inputs, D poisoned with NaN first) is right
//     against a float64 reference (max |err| <= 1e-2 max |ref|), and its events hold: every block
//     with tiles has a producer and a math track; each track is a sequence of tile spans (waits only
//     inside the producer's, for peer chunks) with timestamps monotonic and nothing dropped; the
//     tiles of all blocks are 0 .. T-1 once each, block b holding those with t mod G = b, the same
//     list on both tracks; the math track ends a tile no earlier than the producer's last wait of it
//     ended; at world size > 1 some tile waited for a peer's chunk;
//   * the AllGather push (odd byte count, poisoned symmetric output) is bit-exact, and every block's
//     track is: the opening exchange, per chunk a copy to each peer in staggered order, the closing
//     exchange;
//   * decode attention (single GPU on each rank, two sequences of 4000 and 1500 tokens) is right
//     against a float64 reference, and every CTA of its split grid recorded [user [wait] [tile]]
//     (no tile span where a split is empty), every combine CTA [user [wait]] with its wait ending
//     after the last split CTA did;
//   * disabled at run time the same kernels record nothing and stay right; enabled again they
//     record again (the JIT writes the new buffer into the loaded modules);
//   * the trace of every rank, gathered on rank 0, has no unmatched, truncated or dropped record and
//     one B/E pair per begin/end record (written to --trace=PATH when given, for the docs' picture).
//
//   build-gpu/tools/tdistrun -n 2 -- build-gpu/tests/gpu_test_kernel_profiler [--trace=trace.json]
// Prints "rank R: N passed, M failed" last.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "gpu/test_values.cuh"
#include "tdist/common/device_buffer.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/flash_decode.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/kernel_profiler.hpp"

using namespace tdist;
using device::ProfileEvent;
using device::ProfileKernel;
using device::ProfileRecord;
using tdist::kernels::gemm::RowChunks;
using T = __nv_bfloat16;

namespace {

#define GRID_STRIDE(i, count)                                                        \
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<u64>(gridDim.x) * blockDim.x)
using u64 = unsigned long long;

__global__ void fill_kernel(T* p, u64 count, u64 seed, int rank) {
  GRID_STRIDE(i, count) p[i] = test::to_t<T>(test::input_value(seed, rank, i));
}

// ref[i][j] = sum_k A[i][k] B[j][k] in float64, A the gathered rows of every rank (regenerated).
__global__ void reference_kernel(double* ref, u64 m, u64 n, u64 k, RowChunks rows, u64 seed_a, u64 seed_b, int rank) {
  GRID_STRIDE(e, m * n) {
    const u64 i = e / n, j = e % n;
    const int r = rows.chunk_of(i);
    const u64 base = (i - rows.begin(r)) * k;
    double s = 0;
    for (u64 kk = 0; kk < k; ++kk)
      s += static_cast<double>(test::input_value(seed_a, r, base + kk)) *
           static_cast<double>(test::input_value(seed_b, rank, j * k + kk));
    ref[e] = s;
  }
}

void fill(T* p, u64 count, u64 seed, int rank, cudaStream_t s) {
  if (count > 0) fill_kernel<<<264, 256, 0, s>>>(p, count, seed, rank);
  TDIST_CUDA_CHECK(cudaGetLastError());
}

// The tracks of one kernel, by (block, track).
std::map<std::pair<uint32_t, uint32_t>, const ProfileTrack*> tracks_of(const ProfileSnapshot& s, ProfileKernel k) {
  std::map<std::pair<uint32_t, uint32_t>, const ProfileTrack*> out;
  for (const ProfileTrack& t : s.tracks)
    if (t.kernel == k) out[{t.block, t.track}] = &t;
  return out;
}

void check_common(const ProfileTrack& t, const char* what) {
  TDIST_CHECK(t.records.size() == t.claimed, what, " block ", t.block, " track ", t.track, ": ",
              t.claimed - t.records.size(), " records dropped");
  for (size_t i = 1; i < t.records.size(); ++i)
    TDIST_CHECK(t.records[i].time_ns >= t.records[i - 1].time_ns, what, " block ", t.block, " track ", t.track,
                ": time goes back at record ", i);
}

struct GemmTiles {
  std::vector<uint32_t> tiles;  // in order
  int waits = 0;
};

// Parses one AllGather-GEMM track: tile spans, waits (producer only) for peer chunks inside them.
// `last_wait_end[t]`: the producer's last wait end in tile t (0: none).
GemmTiles parse_gemm_track(const ProfileTrack& t, int rank, int world, std::map<uint32_t, uint64_t>& last_wait_end) {
  const bool producer = t.track == 0;
  check_common(t, "ag_gemm");
  GemmTiles g;
  size_t i = 0;
  const auto& r = t.records;
  auto fail = [&](const char* why) {
    TDIST_FAIL("ag_gemm block ", t.block, " track ", t.track, " record ", i, " (event ", i < r.size() ? r[i].event : 99,
               "): ", why);
  };
  while (i < r.size()) {
    if (r[i].event != static_cast<unsigned short>(ProfileEvent::kTileBegin)) fail("expected a tile begin");
    const uint32_t tile = r[i].payload;
    ++i;
    while (producer && i < r.size() && r[i].event == static_cast<unsigned short>(ProfileEvent::kWaitBegin)) {
      const uint32_t chunk = r[i].payload;
      if (chunk >= static_cast<uint32_t>(world) || chunk == static_cast<uint32_t>(rank))
        fail("a wait for no peer chunk");
      ++i;
      if (i >= r.size() || r[i].event != static_cast<unsigned short>(ProfileEvent::kWaitEnd) || r[i].payload != chunk)
        fail("expected the wait's end");
      last_wait_end[tile] = r[i].time_ns;
      ++g.waits;
      ++i;
    }
    if (i >= r.size() || r[i].event != static_cast<unsigned short>(ProfileEvent::kTileEnd) || r[i].payload != tile)
      fail("expected the tile's end");
    ++i;
    g.tiles.push_back(tile);
  }
  return g;
}

void check_gemm_events(const ProfileSnapshot& s, int rank, int world) {
  const auto tracks = tracks_of(s, ProfileKernel::kAllGatherGemm);
  TDIST_CHECK(!tracks.empty(), "no ag_gemm track recorded");
  std::map<uint32_t, std::vector<uint32_t>> producer_tiles, math_tiles;
  std::map<uint32_t, uint64_t> last_wait_end, math_end;
  int waits = 0;
  for (const auto& [key, t] : tracks) {
    TDIST_CHECK(key.second <= 1, "ag_gemm track ", key.second, " (expected 0 producer, 1 math)");
    std::map<uint32_t, uint64_t> unused;
    const GemmTiles g = parse_gemm_track(*t, rank, world, key.second == 0 ? last_wait_end : unused);
    waits += g.waits;
    (key.second == 0 ? producer_tiles : math_tiles)[key.first] = g.tiles;
    if (key.second == 1)
      for (size_t i = 0; i + 1 < t->records.size(); i += 2) math_end[t->records[i].payload] = t->records[i + 1].time_ns;
  }
  TDIST_CHECK(producer_tiles.size() == math_tiles.size(), "ag_gemm: ", producer_tiles.size(), " producer tracks, ",
              math_tiles.size(), " math tracks");
  const uint32_t blocks = static_cast<uint32_t>(producer_tiles.size());
  std::vector<int> seen;
  for (const auto& [b, tiles] : producer_tiles) {
    TDIST_CHECK(b < blocks, "ag_gemm: block ", b, " recorded but only ", blocks, " blocks have tracks");
    TDIST_CHECK(math_tiles.count(b) && math_tiles[b] == tiles, "ag_gemm block ", b,
                ": the math track's tiles differ from the producer's");
    for (size_t i = 0; i < tiles.size(); ++i) {
      TDIST_CHECK(tiles[i] == b + i * blocks, "ag_gemm block ", b, ": tile ", tiles[i], " at position ", i,
                  ", expected ", b + i * blocks);
      if (seen.size() <= tiles[i]) seen.resize(tiles[i] + 1, 0);
      ++seen[tiles[i]];
    }
  }
  for (size_t t = 0; t < seen.size(); ++t) TDIST_CHECK(seen[t] == 1, "ag_gemm: tile ", t, " ran ", seen[t], " times");
  for (const auto& [tile, end] : last_wait_end)
    TDIST_CHECK(math_end.at(tile) >= end, "ag_gemm tile ", tile, ": the math ended it before its last wait ended");
  if (world > 1) TDIST_CHECK(waits > 0, "ag_gemm: no tile waited for a peer's chunk");
}

// `bytes`: the push's bytes per rank. Every block records its exchanges, so the tracks count the
// blocks; block b's range and chunks follow block_range (collectives/common.cuh) and kPushChunkBytes.
void check_push_events(const ProfileSnapshot& s, int rank, int world, u64 bytes) {
  const auto tracks = tracks_of(s, ProfileKernel::kAllGatherPush);
  TDIST_CHECK(!tracks.empty(), "no ag_push track recorded");
  const u64 blocks = tracks.size();
  const u64 piece = ((bytes + blocks - 1) / blocks + 15) / 16 * 16;
  for (const auto& [key, t] : tracks) {
    TDIST_CHECK(key.first < blocks, "ag_push: block ", key.first, " recorded, but only ", blocks,
                " blocks have tracks");
    const u64 lo = std::min<u64>(key.first * piece, bytes), hi = std::min<u64>(lo + piece, bytes);
    const u64 chunks = (hi - lo + (64 << 10) - 1) / (64 << 10);
    check_common(*t, "ag_push");
    TDIST_CHECK(key.second == 0, "ag_push: track ", key.second, " (expected 0)");
    const auto& r = t->records;
    auto is = [&](size_t i, ProfileEvent e, uint32_t payload) {
      return i < r.size() && r[i].event == static_cast<unsigned short>(e) && r[i].payload == payload;
    };
    size_t i = 0;
    TDIST_CHECK(is(0, ProfileEvent::kWaitBegin, 0) && is(1, ProfileEvent::kWaitEnd, 0), "ag_push block ", key.first,
                ": no opening exchange");
    i = 2;
    int copies = 0;
    while (i < r.size() && r[i].event == static_cast<unsigned short>(ProfileEvent::kCopyIssue)) {
      const int expected_peer = (rank + 1 + copies % (world - 1)) % world;
      TDIST_CHECK(is(i, ProfileEvent::kCopyIssue, expected_peer) && is(i + 1, ProfileEvent::kCopyLand, expected_peer),
                  "ag_push block ", key.first, ": copy ", copies, " is not to peer ", expected_peer);
      i += 2;
      ++copies;
    }
    TDIST_CHECK(static_cast<u64>(copies) == chunks * (world - 1), "ag_push block ", key.first, ": ", copies,
                " copies, expected ", chunks, " chunks x ", world - 1, " peers");
    TDIST_CHECK(is(i, ProfileEvent::kWaitBegin, 1) && is(i + 1, ProfileEvent::kWaitEnd, 1) && i + 2 == r.size(),
                "ag_push block ", key.first, ": no closing exchange as its last records");
  }
}

// Decode attention's tracks (one call): every split CTA of the grid is [user [wait] [tile] ] with
// the tile span absent for a split left empty; every combine CTA is [user [wait] ], its wait ending
// no earlier than the last split CTA ended (it waits for the split grid). The grid is batch x
// kv_heads x splits (4 heads a CTA: one chunk per KV head), the splits read from the payloads.
void check_decode_events(const ProfileSnapshot& s, int64_t batch, int64_t kv_heads) {
  using E = ProfileEvent;
  const auto split = tracks_of(s, ProfileKernel::kFlashDecodeSplit);
  const auto combine = tracks_of(s, ProfileKernel::kFlashDecodeCombine);
  TDIST_CHECK(!split.empty() && !combine.empty(), "decode: ", split.size(), " split and ", combine.size(),
              " combine tracks");
  auto kinds = [](const ProfileTrack& t) {
    std::vector<E> k;
    for (const ProfileRecord& r : t.records) k.push_back(static_cast<E>(r.event));
    return k;
  };
  const std::vector<E> full{E::kUserBegin, E::kWaitBegin, E::kWaitEnd, E::kTileBegin, E::kTileEnd, E::kUserEnd};
  const std::vector<E> bare{E::kUserBegin, E::kWaitBegin, E::kWaitEnd, E::kUserEnd};
  uint32_t splits = 0;
  uint64_t last_end = 0;
  int empty = 0;
  for (const auto& [key, t] : split) {
    check_common(*t, "decode split");
    const std::vector<E> k = kinds(*t);
    TDIST_CHECK(k == full || k == bare, "decode split block ", key.first, ": ", k.size(),
                " records, not [user [wait] [tile]]");
    splits = std::max(splits, t->records.front().payload + 1);
    last_end = std::max<uint64_t>(last_end, t->records.back().time_ns);
    empty += k == bare;
  }
  TDIST_CHECK(static_cast<int64_t>(split.size()) == batch * kv_heads * splits, "decode: ", split.size(),
              " split tracks, expected batch x kv_heads x ", splits, " splits");
  TDIST_CHECK(splits > 1 && empty > 0, "decode: ", splits, " splits, ", empty,
              " empty: expected the short sequence to leave splits empty");
  for (const auto& [key, t] : combine) {
    check_common(*t, "decode combine");
    TDIST_CHECK(kinds(*t) == bare, "decode combine block ", key.first, ": not [user [wait]]");
    TDIST_CHECK(t->records[2].time_ns >= last_end, "decode combine block ", key.first, ": its wait ended ",
                last_end - t->records[2].time_ns, " ns before the last split CTA did");
  }
}

struct Env {
  World& world;
  SymmetricHeap& heap;
  cudaStream_t stream;
  u64 seed;
};

// The fused AllGather-GEMM once (after a warm-up call unless `warm`); checks D; returns nothing.
struct AgGemmCase {
  static constexpr int64_t kM = 4097, kN = 1000, kK = 520;
  Env& env;
  AllGatherGemm op;
  DeviceBuffer a, b, d, ref;
  std::vector<double> ref_host;
  explicit AgGemmCase(Env& e)
      : env(e),
        op(e.world, e.heap, AllGatherGemmConfig{.max_m = kM, .k = kK, .dtype = DType::kBFloat16}),
        a(RowChunks{kM, e.world.world_size()}.rows(e.world.rank()) * kK * sizeof(T)),
        b(kN * kK * sizeof(T)),
        d(kM * kN * sizeof(T)),
        ref(kM * kN * sizeof(double)) {}

  void prepare(u64 seed) {
    const int rank = env.world.rank(), w = env.world.world_size();
    const RowChunks rows{kM, w};
    fill(a.get<T>(), rows.rows(rank) * kK, seed, rank, env.stream);
    fill(b.get<T>(), kN * kK, seed ^ 0x5bd1e995ull, rank, env.stream);
    reference_kernel<<<1024, 256, 0, env.stream>>>(ref.get<double>(), kM, kN, kK, rows, seed, seed ^ 0x5bd1e995ull,
                                                   rank);
    TDIST_CUDA_CHECK(cudaGetLastError());
    ref_host.resize(kM * kN);
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(ref_host.data(), ref.get(), kM * kN * sizeof(double), cudaMemcpyDeviceToHost, env.stream));
  }

  void run_and_check() {
    TDIST_CUDA_CHECK(cudaMemsetAsync(d.get(), 0xFF, kM * kN * sizeof(T), env.stream));  // NaN
    op.run(AllGatherGemmArgs{a.get(), b.get(), d.get(), nullptr, kM, kN}, env.stream, OverlapMethod::kFused);
    std::vector<T> out(kM * kN);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(out.data(), d.get(), out.size() * sizeof(T), cudaMemcpyDeviceToHost, env.stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    double max_ref = 0, max_err = 0;
    size_t worst = 0;
    for (size_t i = 0; i < out.size(); ++i) max_ref = std::max(max_ref, std::fabs(ref_host[i]));
    for (size_t i = 0; i < out.size(); ++i) {
      const double err = std::fabs(static_cast<double>(test::to_f(out[i])) - ref_host[i]);
      if (!(err <= max_err)) max_err = err, worst = i;  // NaN counts as the worst
      if (std::isnan(err)) break;
    }
    TDIST_CHECK(max_err <= 1e-2 * max_ref, "ag_gemm: D[", worst / kN, "][", worst % kN, "] = ", test::to_f(out[worst]),
                ", reference ", ref_host[worst], " (max |err| ", max_err, ", max |ref| ", max_ref, ")");
  }
};

struct PushCase {
  static constexpr u64 kBytes = (3u << 20) + 6;  // per rank: bf16 elements (3 MiB + 6 bytes)
  static constexpr u64 kCount = kBytes / sizeof(T);
  Env& env;
  Collectives coll;
  T* in;
  T* out;
  explicit PushCase(Env& e)
      : env(e),
        coll(e.world, e.heap, kBytes * e.world.world_size()),
        in(static_cast<T*>(e.heap.allocate(kBytes))),
        out(static_cast<T*>(e.heap.allocate(kBytes * e.world.world_size()))) {}

  void run_and_check(u64 seed) {
    const int rank = env.world.rank(), w = env.world.world_size();
    fill(in, kCount, seed, rank, env.stream);
    TDIST_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, kBytes * w, env.stream));
    coll.all_gather(in, out, kCount, DType::kBFloat16, env.stream, AllGatherMethod::kSmPush);
    std::vector<T> host(kCount * w);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(host.data(), out, kBytes * w, cudaMemcpyDeviceToHost, env.stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    for (int r = 0; r < w; ++r)
      for (u64 i = 0; i < kCount; ++i) {
        const float want = test::input_value(seed, r, i), got = test::to_f(host[r * kCount + i]);
        TDIST_CHECK(got == want, "ag_push: out[", r, " * count + ", i, "] = ", got, ", expected ", want);
      }
  }
};

// Decode attention alone on each rank, contiguous cache: 32 query and 8 KV heads, head dim 128, two
// sequences of 4000 and 1500 tokens (the second leaves splits empty); out against a float64
// reference of softmax attention, out poisoned with NaN first.
struct DecodeCase {
  static constexpr int64_t kBatch = 2, kQHeads = 32, kKvHeads = 8, kDim = 128, kCapacity = 4000;
  static constexpr int32_t kLens[kBatch] = {4000, 1500};
  Env& env;
  FlashDecode op;
  DeviceBuffer q{kBatch * kQHeads * kDim * sizeof(T)}, k{kBatch * kCapacity * kKvHeads * kDim * sizeof(T)},
      v{kBatch * kCapacity * kKvHeads * kDim * sizeof(T)}, out{kBatch * kQHeads * kDim * sizeof(T)},
      lens{kBatch * sizeof(int32_t)};
  std::vector<double> ref;
  explicit DecodeCase(Env& e) : env(e) {}

  void prepare(u64 seed) {
    const int rank = env.world.rank();
    fill(q.get<T>(), kBatch * kQHeads * kDim, seed, rank, env.stream);
    fill(k.get<T>(), kBatch * kCapacity * kKvHeads * kDim, seed + 1, rank, env.stream);
    fill(v.get<T>(), kBatch * kCapacity * kKvHeads * kDim, seed + 2, rank, env.stream);
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(lens.get(), kLens, sizeof(kLens), cudaMemcpyHostToDevice, env.stream));  // a static array
    ref.assign(kBatch * kQHeads * kDim, 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t h = 0; h < kQHeads; ++h) {
        const int64_t kh = h / (kQHeads / kKvHeads);
        auto qv = [&](int64_t d) { return test::input_value(seed, rank, (b * kQHeads + h) * kDim + d); };
        auto at = [&](int64_t t, int64_t d) { return ((b * kCapacity + t) * kKvHeads + kh) * kDim + d; };
        std::vector<double> logit(kLens[b]);
        double mx = -INFINITY;
        for (int64_t t = 0; t < kLens[b]; ++t) {
          double dot = 0;
          for (int64_t d = 0; d < kDim; ++d) dot += qv(d) * test::input_value(seed + 1, rank, at(t, d));
          logit[t] = dot * scale;
          mx = std::max(mx, logit[t]);
        }
        double sum = 0;
        for (double& l : logit) sum += (l = std::exp(l - mx));
        for (int64_t t = 0; t < kLens[b]; ++t)
          for (int64_t d = 0; d < kDim; ++d)
            ref[(b * kQHeads + h) * kDim + d] += logit[t] / sum * test::input_value(seed + 2, rank, at(t, d));
      }
  }

  void run_and_check() {
    TDIST_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xFF, kBatch * kQHeads * kDim * sizeof(T), env.stream));  // NaN
    FlashDecodeArgs a{.dtype = DType::kBFloat16,
                      .batch = kBatch,
                      .q_heads = kQHeads,
                      .kv_heads = kKvHeads,
                      .head_dim = kDim,
                      .q = q.get(),
                      .k_cache = k.get(),
                      .v_cache = v.get(),
                      .num_pages = kBatch,
                      .page_size = kCapacity,
                      .seq_lens = lens.get<int32_t>(),
                      .out = out.get(),
                      .softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kDim)))};
    op.run(a, env.stream);
    std::vector<T> host(ref.size());
    TDIST_CUDA_CHECK(cudaMemcpyAsync(host.data(), out.get(), host.size() * sizeof(T), cudaMemcpyDeviceToHost,
                                     env.stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    op.check_errors();
    for (size_t i = 0; i < host.size(); ++i) {
      const double got = test::to_f(host[i]), err = std::fabs(got - ref[i]);
      TDIST_CHECK(err <= 2e-2, "decode: out[", i / kDim, "][", i % kDim, "] = ", got, ", reference ", ref[i]);
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string trace_path;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--trace=", 8) == 0 && argv[i][8] != '\0') {
      trace_path = argv[i] + 8;
    } else {
      std::fprintf(stderr, "usage: %s [--trace=PATH]\n", argv[0]);
      return 2;
    }
  }
  World world;
  test::Suite suite(world);
  const int rank = world.rank(), w = world.world_size();
  // Before the ops: their kernels compile with the recorder.
  suite.run("enable the profiler", [&] { KernelProfiler::enable(KernelProfilerOptions{.records_per_track = 8192}); });
  if (!KernelProfiler::enabled()) return suite.finish();
  SymmetricHeap heap(world, 1ull << 30);
  Env env{world, heap, nullptr, test::all_gather_u64(world, "seed", test::fresh_seed(0))[0]};
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
  if (rank == 0) std::printf("kernel_profiler test: %d ranks, seed %llx\n", w, env.seed);

  AgGemmCase gemm(env);
  PushCase push(env);
  DecodeCase decode(env);
  ProfileSnapshot snap;
  suite.run("ag_gemm fused + ag_push + decode attention, profiled: results right", [&] {
    gemm.prepare(env.seed);
    decode.prepare(env.seed + 5);
    gemm.run_and_check();  // warm-up: compiles, and the flags' first call
    push.run_and_check(env.seed + 1);
    decode.run_and_check();
    test::sync_all(world, "warm");
    KernelProfiler::reset();
    gemm.run_and_check();
    push.run_and_check(env.seed + 2);
    decode.run_and_check();
    snap = KernelProfiler::read(rank);
  });
  suite.run("ag_gemm events: tiles, waits inside them, monotonic, nothing dropped",
            [&] { check_gemm_events(snap, rank, w); });
  suite.run("ag_push events: exchanges around the copies to each peer",
            [&] { check_push_events(snap, rank, w, PushCase::kBytes); });
  suite.run("decode attention events: every split CTA, the combine after the last",
            [&] { check_decode_events(snap, DecodeCase::kBatch, DecodeCase::kKvHeads); });
  suite.run("no record lost", [&] {
    TDIST_CHECK(snap.lost_records == 0 && snap.dropped_records() == 0, snap.lost_records, " lost, ",
                snap.dropped_records(), " dropped");
  });

  suite.run("trace of every rank: balanced, nothing repaired", [&] {
    const auto all = world.all_gather("profile", [&] {
      const std::string bytes = snap.serialize();
      return Bytes(bytes.begin(), bytes.end());
    }());
    if (rank != 0) return;
    std::vector<ProfileSnapshot> ranks;
    uint64_t records = 0, marks = 0;
    for (const Bytes& b : all) {
      ranks.push_back(ProfileSnapshot::deserialize(std::string(b.begin(), b.end())));
      for (const ProfileTrack& t : ranks.back().tracks) {
        records += t.records.size();
        for (const ProfileRecord& r : t.records) marks += r.event == static_cast<unsigned short>(ProfileEvent::kMark);
      }
    }
    TraceStats stats;
    const json::Value doc = chrome_trace(ranks, &stats);
    TDIST_CHECK(stats.unmatched == 0 && stats.truncated == 0 && stats.dropped == 0 && stats.lost == 0,
                "repairs: ", stats.unmatched, " unmatched, ", stats.truncated, " truncated, ", stats.dropped,
                " dropped");
    TDIST_CHECK(stats.events == records, stats.events, " events for ", records, " records");
    if (!trace_path.empty()) {
      write_chrome_trace(trace_path, ranks);
      std::printf("wrote %s: %llu events, %zu ranks\n", trace_path.c_str(),
                  static_cast<unsigned long long>(stats.events), ranks.size());
    }
    (void)marks;
  });

  suite.run("disabled: the same kernels record nothing and stay right", [&] {
    test::sync_all(world, "before disable");
    KernelProfiler::disable();
    gemm.run_and_check();
    push.run_and_check(env.seed + 3);
    decode.run_and_check();
    TDIST_CHECK(!KernelProfiler::enabled(), "still enabled");
  });
  suite.run("enabled again: the loaded kernels record into the new buffer", [&] {
    test::sync_all(world, "before enable");
    KernelProfiler::enable(KernelProfilerOptions{.records_per_track = 8192});
    gemm.run_and_check();
    push.run_and_check(env.seed + 4);
    decode.run_and_check();
    const ProfileSnapshot again = KernelProfiler::read(rank);
    check_gemm_events(again, rank, w);
    check_push_events(again, rank, w, PushCase::kBytes);
    check_decode_events(again, DecodeCase::kBatch, DecodeCase::kKvHeads);
  });
  test::sync_all(world, "end");
  KernelProfiler::disable();
  TDIST_CUDA_CHECK(cudaStreamDestroy(env.stream));
  return suite.finish();
}
