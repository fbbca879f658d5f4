// tdist::Gemm: D = A x B^T on Hopper (sm_90a), bf16 or fp16 inputs, fp32 accumulation, output in the
// input type. The layer the fused AllGather-GEMM and GEMM-ReduceScatter stand on. docs/gemm.md.
//
// Layout ("TN", cuBLAS's default for LLM layers: y = x W^T with W stored out_features x in_features):
//   A  M x K row-major, leading dimension lda >= K (elements)
//   B  N x K row-major, leading dimension ldb >= K
//   D  M x N row-major, leading dimension ldd >= N
// K > 0 and a multiple of 8; lda, ldb, ldd multiples of 8 and every pointer 16-byte aligned (TMA's
// rules); M and N are any size (0 is a no-op), none of M, N, K needs to be a tile multiple.
//
//   tdist::Gemm gemm;                                   // kernels compile (or load) on first use
//   gemm.run({.a = a, .b = b, .d = d, .m = m, .n = n, .k = k, .dtype = tdist::DType::kBFloat16}, stream);
//
// The kernel (include/tdist/kernels/gemm/sm90_gemm.cuh) is persistent: min(tiles, SMs) CTAs walk the
// tiles in the order of a TileScheduler (grouped raster, optionally starting at a given row and
// wrapping, as AllGather-GEMM needs).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tdist/common/device_info.hpp"
#include "tdist/common/dtype.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"

namespace tdist {

namespace detail {
template <typename Scheduler, typename Params>
class GemmRuntime;
}  // namespace detail

// One kernel instance's tile shape (template parameters of sm90_gemm_tn).
struct GemmTile {
  int block_m = 128;  // 64 or 128: one consumer warpgroup per 64 rows
  int block_n = 256;  // multiple of 16, 16 .. 256
  int block_k = 64;   // 64 (one 128-byte swizzle row of 2-byte elements)
  int stages = 4;     // shared-memory ring depth
  int cluster_m = 1;  // CTAs per cluster along M: 1, or 2 sharing each B tile by TMA multicast

  std::string name() const;  // "128x256x64_s4_c1"
  bool operator==(const GemmTile&) const = default;
};

// Throws tdist::Error (naming "tile") when the kernel cannot be built with this shape.
void check_gemm_tile(const GemmTile& tile);
// Dynamic shared memory and threads of an instance.
size_t gemm_shared_bytes(const GemmTile& tile, DType dtype);
unsigned gemm_threads(const GemmTile& tile);
// The tiles tdist ships (compiled by tdist-compile --all, candidates of the autotuner).
const std::vector<GemmTile>& gemm_tiles();
// The tile the heuristic picks for an M x N x K problem on `num_sms` SMs: the best of gemm_tiles()
// by wave efficiency weighted by the tile's own efficiency. `gathered_a`: A's rows are gathered by the
// producer's cp.async (the grouped GEMM's a_gather), which feeds about kGatheredFedColumns columns of
// MMA a stage: a narrower tile waits for its A. `block_m` > 0: only the tiles of that many rows (a
// TDIST_GEMM_TILE of another height is then passed over).
GemmTile choose_gemm_tile(int64_t m, int64_t n, int64_t k, int num_sms, bool gathered_a = false, int block_m = 0);
// Measured on H200 over eleven MoE first projections of 4096 tokens or more (K 2048-7168, N 768-14336,
// 8-128 experts): the 128 x 128 tile with gathered A took 1.14-1.18x its time on the same rows loaded
// by TMA, the tiles of 192 columns and more no longer (docs/gemm.md, "Gathered A").
inline constexpr double kGatheredFedColumns = 149.0;
// `tile` with the cluster that pays for a B of this placement, for the plain and the grouped GEMM and
// the MoE ops (not the dense fused ops' instances): a 2-CTA cluster multicasting B when B's rows are not 32-byte
// aligned (`b` or the row stride `ldb` x element size), where L2's traffic bounds the GEMM, the tile
// has 128 rows, and the rows that multiply one B (M / num_groups: M is every group's rows for the
// grouped GEMM) span enough m-tiles on average for the cluster's two tiles to share it: more than one
// where the walk keeps each B's m-tiles in pairs (`pair_walk`: a dense GEMM, a grouped one in pair
// order), two or more where groups may start at odd m-tiles. TDIST_GEMM_CLUSTER=1 or 2, read at each
// call, forces the cluster. A tile that already has a cluster is returned as it is.
GemmTile with_b_multicast(const GemmTile& tile, int64_t m, const void* b, int64_t ldb, DType dtype,
                          int64_t num_groups = 1, bool pair_walk = true);

struct GemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::kBFloat16;
  int64_t lda = 0, ldb = 0, ldd = 0;  // 0: dense (K, K, N)
};

// Checks the arguments (dtype, sizes, K % 8, leading dimensions, 16-byte alignment, null pointers)
// and returns them with the leading dimensions filled in. Throws tdist::Error naming the argument.
GemmArgs check_gemm_args(const GemmArgs& args);

struct GemmRunOptions {
  std::optional<GemmTile> tile;  // empty: choose_gemm_tile (or the tuned one, after tune()); read by Gemm only
  int group_m = 8;               // m-tiles per raster group (L2 reuse)
  int64_t first_row = 0;         // the walk starts at the m-tile holding this row and wraps
  int max_ctas = 0;              // persistent CTAs at most; 0: the SM count
};

// tdist's GEMM runs on this compute capability only (compute_capability, common/device_info.hpp;
// sm_90a: its wgmma and TMA code is arch-specific).
constexpr int kGemmComputeCapability = 90;

class Gemm {
 public:
  // Reads the current device's SM count; compiles nothing yet.
  Gemm();
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // D = A x B^T on `stream`. No host synchronisation; graph-capturable once the instance is loaded
  // (the first call of an instance compiles or loads it).
  void run(const GemmArgs& args, cudaStream_t stream, const GemmRunOptions& options = {});

  // Times the shipped tiles on these arguments (D is overwritten) with jit::Autotuner and keeps the
  // winner for this (M, N, K, dtype); later run() calls without an explicit tile use it. The winner
  // is stored in the cache folder, so later processes skip the timing.
  GemmTile tune(const GemmArgs& args, cudaStream_t stream);

  // The loaded kernel of an instance (compiled or read from the cache on first use).
  const jit::Kernel& kernel(DType dtype, const GemmTile& tile);
  int num_sms() const { return num_sms_; }

 private:
  int num_sms_ = 0;
  std::unique_ptr<detail::GemmRuntime<kernels::gemm::TileScheduler, kernels::gemm::NoTileHooks>> runtime_;
  std::mutex mu_;  // guards tuned_
  std::map<std::string, GemmTile> tuned_;
};

}  // namespace tdist
