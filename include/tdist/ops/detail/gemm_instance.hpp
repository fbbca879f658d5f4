// The glue of one sm90 GEMM instance, below the user API of ops/gemm.hpp: its name expression and
// compile request, the TMA descriptors of its operands, its launch shape, schedule and parameter
// list. Used by the typed runtime (ops/detail/gemm_runtime.hpp), tdist::Gemm, tdist::GroupedGemm and
// the CPU tests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/gemm.hpp"

namespace tdist {

// The largest M, N, K and row count of B the GEMMs take: TMA coordinates and the kernels' indices
// are 32-bit.
constexpr int64_t kGemmMaxDim = (int64_t{1} << 31) - 1;
// M and N in [0, kGemmMaxDim], K in (0, kGemmMaxDim]; throws tdist::Error naming m, n or k.
void check_gemm_dims(int64_t m, int64_t n, int64_t k);

// The kernel's name expression: tdist::kernels::gemm::sm90_gemm_tn<T, BM, BN, BK, S, C, Hooks> (the
// TileScheduler instance). Typed alternative: detail::GemmRuntime (include/tdist/ops/detail/gemm_runtime.hpp).
std::string gemm_kernel_name(DType dtype, const GemmTile& tile,
                             const std::string& hook = "tdist::kernels::gemm::NoTileHooks");
// One JIT request per tile (both dtypes as name expressions), as registered for tdist-compile.
jit::CompileRequest gemm_compile_request(const GemmTile& tile,
                                         const std::string& hook = "tdist::kernels::gemm::NoTileHooks");
std::vector<jit::CompileRequest> gemm_compile_requests();

// The parameters of a 2-D tensor map, as cuTensorMapEncodeTiled takes them: dims[0] is the
// contiguous one. Zero fill out of range (loads; stores skip out-of-range elements), the given L2
// promotion and swizzle (the inner box is exactly that many bytes).
struct GemmTensorMapSpec {
  const void* base = nullptr;
  uint64_t dims[2] = {0, 0};          // A, B: {K, rows}; D: {N, M}
  uint64_t row_stride_bytes = 0;      // leading dimension x element size
  uint32_t box[2] = {0, 0};           // A, B: {BLOCK_K, BLOCK_M or BLOCK_N}; D: {EPI_N, 64}
  uint32_t swizzle_bytes = 128;       // 128, 64 or 32
  uint32_t l2_promotion_bytes = 256;  // 256, 128, 64 or 0 (A and B: 128 where rows are not 32-byte aligned)
};
// Specs of A, B (TMA loads) and D (TMA stores of one consumer warpgroup's 64 x EPI_N chunk,
// kernels::gemm::gemm_epi_cols) for checked args and a tile.
GemmTensorMapSpec gemm_tensor_map_a(const GemmArgs& args, const GemmTile& tile);
GemmTensorMapSpec gemm_tensor_map_b(const GemmArgs& args, const GemmTile& tile);
// B over `b_rows` rows instead of N (the grouped GEMM's G x N rows).
GemmTensorMapSpec gemm_tensor_map_b_rows(const GemmArgs& args, const GemmTile& tile, int64_t b_rows);
GemmTensorMapSpec gemm_tensor_map_d(const GemmArgs& args, const GemmTile& tile);

// 128 bytes, as CUtensorMap (kept opaque here so this header needs no <cuda.h>).
struct alignas(128) GemmTensorMap {
  unsigned long long opaque[16];
};
// Encodes through cuTensorMapEncodeTiled, found with cudaGetDriverEntryPointByVersion (no libcuda
// link). Needs a GPU driver.
GemmTensorMap encode_gemm_tensor_map(const GemmTensorMapSpec& spec, DType dtype);

namespace detail {
// The best of `tiles` for an M x N problem on `num_sms` SMs: wave fill x used area x the tile's own
// efficiency (choose_gemm_tile over gemm_tiles(), choose_fp8_gemm_tile over fp8_gemm_tiles()), x
// block_n / fed_columns for tiles narrower than the columns a stage's A operand feeds (0: TMA-fed);
// block_m > 0: among the tiles of that many rows only.
GemmTile choose_tile_among(const std::vector<GemmTile>& tiles, int64_t m, int64_t n, int num_sms,
                           double fed_columns = 0.0, int block_m = 0);
// The shipped tile that environment variable `variable` names (GemmTile::name()), in place of the
// heuristic's choice, for tuning experiments; read at each call. Empty when it is unset; a name not in
// `shipped` is an error listing them.
std::optional<GemmTile> forced_tile(const char* variable, const std::vector<GemmTile>& shipped);
// Whether a tile of this shape may run in a 2-CTA cluster (with_b_multicast's choice, and the cluster
// instances the runtimes ship): the 128-row tiles.
inline bool takes_cluster(const GemmTile& t) { return t.block_m == 128; }
}  // namespace detail

// The launch of one instance: grid, block, shared memory, cluster (pure; used by Gemm and tests).
jit::LaunchConfig gemm_launch_config(const GemmArgs& args, const GemmTile& tile, int num_sms, int max_ctas,
                                     cudaStream_t stream);
kernels::gemm::TileScheduler gemm_schedule(const GemmArgs& args, const GemmTile& tile, int group_m, int64_t first_row);
// The parameters of sm90_gemm_tn in declaration order, all but the last (the Hooks value):
// tmap_a, tmap_b, tmap_d (encoded here: needs a GPU driver), d, ldd, m, n, k, sched. A launcher appends its
// hooks (kernels::gemm::NoTileHooks{} for the plain GEMM) with add().
jit::KernelArgs gemm_kernel_args(const GemmArgs& checked_args, const GemmTile& tile,
                                 const kernels::gemm::TileScheduler& sched);

}  // namespace tdist
