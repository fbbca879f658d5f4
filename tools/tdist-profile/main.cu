// tdist-profile: runs tdist's instrumented ops (the fused AllGather-GEMM, the AllGather push, decode
// attention) with the intra-kernel profiler and writes a Chrome / Perfetto trace of every rank
// (docs/profiling.md).
//
//   tdistrun -n 2 build/tools/tdist-profile --out trace.json [--ops ag_gemm,ag_push,flash_decode]
//       [--m 8192 --n 4096 --k 8192] [--bytes 64M] [--batch 1 --tokens 32768]
//   python3 bench/plot_trace.py trace.json trace.png
//
// Each op runs once to warm up (compile, first call), then --calls times profiled. Rank 0 writes the
// merged trace (pid = rank); --per-rank also writes each rank's own trace beside it.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/flash_decode.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/kernel_profiler.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

struct Options {
  bool ag_gemm = true, ag_push = true, flash_decode = false;  // --ops
  int64_t m = 8192, n = 4096, k = 8192;
  uint64_t bytes = 64ull << 20;
  int64_t batch = 1, tokens = 32768, q_heads = 32, kv_heads = 8, page = 16;  // decode attention
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

// Decode attention's calls as a timeline (docs/flash_decode.md, "the CTAs' timeline"): per call, when
// the CTAs of each kernel passed each event, in us from the previous call's last combine exit (the
// first call: from its first entry), as first / median / last over the CTAs.
void print_decode_timeline(const ProfileSnapshot& s) {
  using E = device::ProfileEvent;
  const auto split = blocks_by_launch(s, device::ProfileKernel::kFlashDecodeSplit);
  const auto combine = blocks_by_launch(s, device::ProfileKernel::kFlashDecodeCombine);
  if (split.empty()) return;
  using Blocks = std::vector<std::vector<device::ProfileRecord>>;
  // When each block first recorded `e` (kUserBegin: its entry, kUserEnd: its exit, the run's first
  // and last records), in us after `base`, as "first/median/last"; "-" where no block did.
  auto spread = [](const Blocks& blocks, E e, uint64_t base) {
    std::vector<double> v;
    for (const auto& b : blocks) {
      const device::ProfileRecord* r = e == E::kUserBegin ? &b.front() : e == E::kUserEnd ? &b.back() : nullptr;
      for (size_t i = 0; r == nullptr && i < b.size(); ++i)
        if (b[i].event == static_cast<unsigned short>(e)) r = &b[i];
      if (r != nullptr) v.push_back((static_cast<double>(r->time_ns) - static_cast<double>(base)) * 1e-3);
    }
    if (v.empty()) return std::string("-");
    std::sort(v.begin(), v.end());
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.1f/%.1f/%.1f", v.front(), v[v.size() / 2], v.back());
    return std::string(buf);
  };
  std::printf("rank %d decode attention, us from the previous call's last combine exit (first/median/last CTA):\n",
              s.rank);
  std::printf("%4s %20s %20s %20s %20s %20s | %20s %20s\n", "call", "split entry", "grid wait end", "first tile",
              "loop end", "exit", "combine wait end", "combine exit");
  uint64_t base = UINT64_MAX;
  for (const auto& b : split[0]) base = std::min<uint64_t>(base, b.front().time_ns);
  const Blocks none;
  for (size_t k = 0; k < split.size(); ++k) {
    const Blocks& c = k < combine.size() ? combine[k] : none;
    std::printf("%4zu %20s %20s %20s %20s %20s | %20s %20s\n", k, spread(split[k], E::kUserBegin, base).c_str(),
                spread(split[k], E::kWaitEnd, base).c_str(), spread(split[k], E::kTileBegin, base).c_str(),
                spread(split[k], E::kTileEnd, base).c_str(), spread(split[k], E::kUserEnd, base).c_str(),
                spread(c, E::kWaitEnd, base).c_str(), spread(c, E::kUserEnd, base).c_str());
    base = 0;
    for (const auto& b : c.empty() ? split[k] : c) base = std::max<uint64_t>(base, b.back().time_ns);
  }
}

constexpr int64_t kDecodeHeadDim = 128;

// Decode attention for the profile: a paged cache of 16-token pages (or --page) in shuffled order,
// bf16, head dim 128, copies rotated so that each call reads its cache from HBM. At world 1 the
// single-GPU op over whole sequences; at more ranks the sequence-parallel op, each rank holding
// 1 / world of every sequence.
class DecodeCase {
 public:
  DecodeCase(World& world, SymmetricHeap& heap, const Options& o, cudaStream_t stream) {
    const int w = world.world_size();
    const int64_t local = (o.tokens + w - 1) / w, max_pages = (local + o.page - 1) / o.page;
    const int64_t num_pages = o.batch * max_pages;
    const size_t cache_elems = static_cast<size_t>(num_pages * o.page * o.kv_heads * kDecodeHeadDim);
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    const size_t cache_bytes = 2 * cache_elems * 2;  // K and V, bf16
    sets_ = static_cast<int>(std::clamp<size_t>((3 * static_cast<size_t>(prop.l2CacheSize) + cache_bytes - 1) /
                                                    cache_bytes, 1, 8));
    for (int i = 0; i < sets_; ++i) {
      k_.emplace_back(cache_elems * 2);
      v_.emplace_back(cache_elems * 2);
      fill(k_.back().get(), cache_elems, 300 + 2 * i, stream);
      fill(v_.back().get(), cache_elems, 301 + 2 * i, stream);
    }
    q_ = DeviceBuffer(o.batch * o.q_heads * kDecodeHeadDim * 2);
    out_ = DeviceBuffer(o.batch * o.q_heads * kDecodeHeadDim * 2);
    lse_ = DeviceBuffer(o.batch * o.q_heads * 4);
    fill(q_.get(), o.batch * o.q_heads * kDecodeHeadDim, 400, stream);
    std::vector<int32_t> pages(num_pages), lens(o.batch, static_cast<int32_t>(local));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), std::mt19937_64(500 + world.rank()));
    table_ = DeviceBuffer(pages.size() * 4);
    lens_ = DeviceBuffer(lens.size() * 4);
    TDIST_CUDA_CHECK(cudaMemcpy(table_.get(), pages.data(), pages.size() * 4, cudaMemcpyHostToDevice));
    TDIST_CUDA_CHECK(cudaMemcpy(lens_.get(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    args_ = FlashDecodeArgs{.dtype = DType::kBFloat16,
                            .batch = o.batch,
                            .q_heads = o.q_heads,
                            .kv_heads = o.kv_heads,
                            .head_dim = kDecodeHeadDim,
                            .q = q_.get(),
                            .num_pages = num_pages,
                            .page_size = o.page,
                            .block_table = table_.get<int32_t>(),
                            .max_pages = max_pages,
                            .seq_lens = lens_.get<int32_t>(),
                            .out = out_.get(),
                            .lse = lse_.get<float>(),
                            .softmax_scale = 0.08838834764f,
                            .max_seq_len = local};
    if (w > 1)
      distributed_ = std::make_unique<DistributedFlashDecode>(world, heap, config(o));
    else
      single_ = std::make_unique<FlashDecode>();
  }

  static DistributedFlashDecodeConfig config(const Options& o) {
    return {.max_batch = o.batch, .q_heads = o.q_heads, .head_dim = kDecodeHeadDim};
  }
  // Profiler slots the split kernel's grid needs (its CTAs; the combine's grid is smaller).
  static int64_t blocks(const Options& o, int world, int sms) {
    const int64_t local = (o.tokens + world - 1) / world;
    const FlashDecodeSplitPlan plan = plan_flash_decode(o.batch, o.q_heads, o.kv_heads, kDecodeHeadDim, local, sms);
    return o.batch * o.kv_heads * plan.head_chunks * plan.num_splits;
  }

  void run(cudaStream_t stream) {
    args_.k_cache = k_[next_ % sets_].get();
    args_.v_cache = v_[next_ % sets_].get();
    ++next_;
    if (distributed_)
      distributed_->run(args_, stream);
    else
      single_->run(args_, stream);
  }
  void check_errors() { distributed_ ? distributed_->check_errors() : single_->check_errors(); }

 private:
  int sets_ = 1, next_ = 0;
  std::vector<DeviceBuffer> k_, v_;
  DeviceBuffer q_, out_, lse_, table_, lens_;
  FlashDecodeArgs args_;
  std::unique_ptr<FlashDecode> single_;
  std::unique_ptr<DistributedFlashDecode> distributed_;
};

int run(const Options& o) {
  World world;
  const int rank = world.rank(), w = world.world_size();
  const int sms = sm_count(world.device());
  // Before the ops are built: their kernels compile with the recorder. Every block of the decode
  // split kernel gets a slot (batch 1 at 32K tokens: 256 CTAs); its tracks need 6 records a call.
  // Without --records, a track holds what fits in 1 GiB for the whole buffer, at most the default.
  KernelProfilerOptions profile{.records_per_track = o.records};
  if (o.flash_decode) {
    profile.max_blocks = static_cast<int>(std::clamp<int64_t>(DecodeCase::blocks(o, w, sms), 2 * sms, 1 << 14));
    if (o.records == 0) {
      const int64_t tracks = int64_t{device::kNumProfileKernels} * profile.max_blocks * profile.num_tracks;
      const int64_t fit = ((int64_t{1} << 30) / tracks - sizeof(device::ProfileSlotHeader)) /
                          static_cast<int64_t>(sizeof(device::ProfileRecord));
      const int64_t want = o.ag_gemm || o.ag_push ? kernel_profile_records_from_env() : std::max(16, 8 * o.calls);
      profile.records_per_track = static_cast<int>(std::clamp<int64_t>(std::min(want, fit), 16, 1 << 20));
    }
  }
  KernelProfiler::enable(profile);
  const AllGatherGemmConfig cfg{.max_m = o.m, .k = o.k, .dtype = DType::kBFloat16};
  const size_t push_out = o.bytes * static_cast<size_t>(w);
  size_t heap_bytes = size_t{64} << 20;
  if (o.ag_gemm) heap_bytes += all_gather_gemm_heap_bytes(cfg, w, sms);
  if (o.ag_push) heap_bytes += Collectives::heap_bytes(w, push_out, sms) + o.bytes + push_out;
  if (o.flash_decode && w > 1) heap_bytes += DistributedFlashDecode::heap_bytes(DecodeCase::config(o), w);
  SymmetricHeap heap(world, heap_bytes);
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<std::function<void()>> ops;
  std::vector<std::string> what;
  std::unique_ptr<AllGatherGemm> ag;
  DeviceBuffer a, b, d;
  if (o.ag_gemm) {
    ag = std::make_unique<AllGatherGemm>(world, heap, cfg);
    const int64_t rows = static_cast<int64_t>(kernels::gemm::RowChunks{static_cast<uint64_t>(o.m), w}.rows(rank));
    a = DeviceBuffer(rows * o.k * 2);
    b = DeviceBuffer(o.n * o.k * 2);
    d = DeviceBuffer(o.m * o.n * 2);
    fill(a.get(), rows * o.k, 1 + rank, stream);
    fill(b.get(), o.n * o.k, 100 + rank, stream);
    const AllGatherGemmArgs args{a.get(), b.get(), d.get(), nullptr, o.m, o.n};
    ops.push_back([&ag, args, stream] { ag->run(args, stream, OverlapMethod::kFused); });
    what.push_back(detail::concat("AllGather-GEMM M=", o.m, " N=", o.n, " K=", o.k, " bf16 fused"));
  }
  std::unique_ptr<Collectives> coll;
  void* in = nullptr;
  void* out = nullptr;
  if (o.ag_push) {
    coll = std::make_unique<Collectives>(world, heap, push_out);
    in = heap.allocate(o.bytes);
    out = heap.allocate(push_out);
    fill(in, o.bytes / 2, 200 + rank, stream);
    ops.push_back([&coll, in, out, &o, stream] {
      coll->all_gather(in, out, o.bytes / 2, DType::kBFloat16, stream, AllGatherMethod::kSmPush);
    });
    what.push_back(detail::concat("AllGather push ", o.bytes, " bytes per rank"));
  }
  std::unique_ptr<DecodeCase> decode;
  if (o.flash_decode) {
    decode = std::make_unique<DecodeCase>(world, heap, o, stream);
    ops.push_back([&decode, stream] { decode->run(stream); });
    what.push_back(detail::concat("decode attention batch ", o.batch, " tokens ", o.tokens, " heads ", o.q_heads, "/",
                                  o.kv_heads, " page ", o.page, w > 1 ? " sequence-parallel" : ""));
  }
  for (auto& op : ops) op();  // warm-up
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (decode) decode->check_errors();
  world.barrier("tdist-profile warm");
  KernelProfiler::reset();
  world.barrier("tdist-profile reset");
  // Each op's calls back to back, as a serving or training loop issues them.
  for (auto& op : ops)
    for (int i = 0; i < o.calls; ++i) op();
  const ProfileSnapshot snap = KernelProfiler::read(rank);
  print_summary(snap);
  if (o.flash_decode) print_decode_timeline(snap);

  const std::string bytes = snap.serialize();
  const auto all = world.all_gather("tdist-profile snapshots", Bytes(bytes.begin(), bytes.end()));
  std::string stem = o.out;
  if (stem.size() > 5 && stem.compare(stem.size() - 5, 5, ".json") == 0) stem.resize(stem.size() - 5);
  if (o.per_rank) write_chrome_trace(stem + ".rank" + std::to_string(rank) + ".json", {snap});
  if (rank == 0) {
    std::vector<ProfileSnapshot> ranks;
    for (const Bytes& x : all) ranks.push_back(ProfileSnapshot::deserialize(std::string(x.begin(), x.end())));
    const TraceStats st = write_chrome_trace(o.out, ranks);
    std::string ops_text;
    for (const std::string& x : what) ops_text += (ops_text.empty() ? "" : ", ") + x;
    std::printf("wrote %s: %d ranks, %llu events (%s; %d profiled calls each)\n", o.out.c_str(), w,
                static_cast<unsigned long long>(st.events), ops_text.c_str(), o.calls);
  }
  world.barrier("tdist-profile done");
  if (out) heap.free(out);
  if (in) heap.free(in);
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  KernelProfiler::disable();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  cli::Parser p("tdist-profile",
                "Runs tdist's instrumented ops (by default the fused AllGather-GEMM, bf16, and the AllGather push)\n"
                "with the intra-kernel profiler and writes a Chrome / Perfetto trace of every rank. Under a\n"
                "launcher, one GPU per rank: tdistrun -n 2 tdist-profile --out trace.json");
  p.option("--ops", "LIST", "comma-separated, of ag_gemm, ag_push, flash_decode (default ag_gemm,ag_push)",
           [&](const std::string& v) {
             o.ag_gemm = o.ag_push = o.flash_decode = false;
             size_t at = 0;
             while (at <= v.size()) {
               const size_t end = std::min(v.find(',', at), v.size());
               const std::string op = v.substr(at, end - at);
               if (op == "ag_gemm") o.ag_gemm = true;
               else if (op == "ag_push") o.ag_push = true;
               else if (op == "flash_decode") o.flash_decode = true;
               else p.fail("--ops: expected ag_gemm, ag_push or flash_decode, got '" + op + "'");
               at = end + 1;
             }
           });
  p.option("--m", "M", "rows of the gathered A (default 8192)", &o.m, 1, int64_t{1} << 30);
  p.option("--n", "N", "columns of D per rank, a multiple of 8 (default 4096)", &o.n, 8, int64_t{1} << 30);
  p.option("--k", "K", "inner dimension, a multiple of 8 (default 8192)", &o.k, 8, int64_t{1} << 30);
  p.option("--bytes", "BYTES", "AllGather push bytes per rank, even (default 64M)",
           [&](const std::string& v) { o.bytes = cli::parse_size(v, "--bytes"); });
  p.option("--batch", "B", "decode attention: sequences (default 1)", &o.batch, 1, 65535);
  p.option("--tokens", "T", "decode attention: tokens of each sequence, over all ranks (default 32768)", &o.tokens, 1,
           int64_t{1} << 30);
  p.option("--q-heads", "H", "decode attention: query heads (default 32)", &o.q_heads, 1, 65535);
  p.option("--kv-heads", "H", "decode attention: KV heads, dividing --q-heads (default 8)", &o.kv_heads, 1, 65535);
  p.option("--page", "P", "decode attention: tokens per page, 1..256 (default 16)", &o.page, 1, 256);
  p.option("--calls", "N", "profiled calls of each op (default 1)", &o.calls, 1, 1000);
  p.option("--records", "N", "records per track, 16 to 1048576 (default: TDIST_KERNEL_PROFILE_RECORDS, else 4096)",
           &o.records, 16, 1 << 20);
  p.option("--out", "FILE", "the merged trace, written by rank 0 (default kernel_trace.json)", &o.out);
  p.flag("--per-rank", "also write FILE's stem + .rank<R>.json on every rank", &o.per_rank);
  p.parse(argc, argv);
  if (o.n % 8 != 0 || o.k % 8 != 0) p.fail("--n and --k must be multiples of 8");
  if (o.bytes == 0 || o.bytes % 2 != 0) p.fail("--bytes must be even and above 0 (bf16 elements)");
  if (o.q_heads % o.kv_heads != 0) p.fail("--q-heads must be a multiple of --kv-heads");
  if (!o.ag_gemm && !o.ag_push && !o.flash_decode) p.fail("--ops: expected at least one op");
  return cli::run_main("tdist-profile", [&] { return run(o); });
}
