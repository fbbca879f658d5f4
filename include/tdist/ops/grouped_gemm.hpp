// tdist::GroupedGemm: the m-grouped GEMM of MoE layers on Hopper (sm_90a): G groups (experts), group
// g multiplies its rows of A by its own weight B_g. bf16 or fp16 inputs, fp32 accumulation, output in
// the input type; or e4m3 inputs with block scales and bf16 output (GroupedGemmFp8Args, below).
// docs/gemm.md ("Grouped GEMM", "FP8").
//
// Layout ("m-grouped contiguous"; kernels/gemm/grouped_scheduler.cuh):
//   A        M_total x K row-major (lda >= K): every group's rows, group after group
//   B        G x N x K: B_g = rows [g N, (g + 1) N) of a (G N) x K row-major matrix (ldb >= K)
//   D        M_total x N row-major (ldd >= N)
//   offsets  G + 1 row offsets, int32 or int64, in device memory: group g owns rows
//            [offsets[g], offsets[g + 1]) of A and D, and D[those rows] = A[those rows] x B_g^T.
//            offsets[0] == 0, non-decreasing, each a multiple of grouped_gemm_alignment() (pad every
//            group's row count up to it: grouped_gemm_offsets() does so from the counts), and
//            offsets[G] <= M_total. Padding rows are computed like the others; an empty group costs
//            nothing; rows [offsets[G], M_total) of D are left untouched.
// The offsets are read by the kernel only (no host synchronisation: the routing that wrote them can
// run on the same stream, and the call can be captured in a CUDA graph); offsets breaking the rules
// give undefined rows of D (never accesses outside A, B and D). K and every leading dimension are
// multiples of 8, every pointer 16-byte aligned; N is any size.
//
//   tdist::GroupedGemm gg;
//   gg.run({.a = x, .b = w, .d = y, .offsets = offs, .m = m_total, .n = n, .k = k, .num_groups = experts}, stream);
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "tdist/kernels/gemm/grouped_scheduler.cuh"
#include "tdist/ops/gemm.hpp"

namespace tdist {

namespace detail {
template <typename Scheduler, typename Params>
class GemmRuntime;
class Fp8GroupedRuntime;
class PairOrderKernel;
}  // namespace detail

enum class IndexType { kInt32, kInt64 };

// Rows per group are padded to a multiple of this (a multiple of every tile's BLOCK_M).
constexpr int64_t grouped_gemm_alignment() { return kernels::gemm::kGroupedAlignment; }

struct GroupedGemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* offsets = nullptr;  // device memory, num_groups + 1 entries
  IndexType offsets_type = IndexType::kInt32;
  int64_t m = 0;  // M_total: rows of A and D
  int64_t n = 0, k = 0;
  int num_groups = 0;  // G >= 1
  DType dtype = DType::kBFloat16;
  int64_t lda = 0, ldb = 0, ldd = 0;  // 0: dense (K, K, N)
  // Optional: A's rows read through an index instead of from `a` (which is then ignored; lda too):
  // row r of A is token a_gather->token_of_row[r]'s row, -1 a padding row read as zeros
  // (kernels/gemm/grouped_scheduler.cuh, RowGather: token rows in `local` and `gathered`, ld_bytes
  // apart, a multiple of 16 and at least K elements). The MoE ops use it to skip materialising the
  // expert-ordered copy of their tokens.
  std::optional<kernels::gemm::RowGather> a_gather = std::nullopt;
};

struct GroupedGemmRunOptions {
  std::optional<GemmTile> tile;            // empty: choose_gemm_tile(M_total, N, K)
  int group_m = 8;                         // m-tiles per raster group (L2 reuse of B_g)
  int64_t first_row = 0;                   // the walk starts at the m-tile holding this row and wraps
  const uint32_t* m_tile_order = nullptr;  // device, optional: the m-tiles (of the tile's BLOCK_M) in
                                           // visit order, a permutation of [0, ceil(offsets[G] / BLOCK_M));
                                           // replaces first_row
  const uint32_t* m_tile_count = nullptr;  // device, optional with m_tile_order: visit only its first
                                           // *m_tile_count entries (tiles of the listed m-tiles only)
  int tile_lists = 1;                      // > 1 (at most 8): m_tile_order holds this many lists,
                                           // tile_list_stride entries apart, m_tile_count one count
                                           // each; their tiles run list after list in one launch
                                           // (GroupedScheduler's listed walk; both pointers needed)
  int64_t tile_list_stride = 0;            // with tile_lists > 1: entries between two lists' starts
  int max_ctas = 0;                        // persistent CTAs at most; 0: the SM count
  uint32_t* order_scratch = nullptr;       // device, optional: u32[grouped_gemm_scratch_entries(M_total)].
                                           // With a 2-CTA cluster tile, no m_tile_order and first_row
                                           // 0, run() first writes there the order that keeps each
                                           // group's m-tiles in pairs, so that the cluster shares B for
                                           // all of them (kernels/gemm/grouped_pair_order.cuh); without
                                           // it, the plain walk shares B for fewer pairs
};

// Entries of GroupedGemmRunOptions::order_scratch for M_total rows (any tile).
constexpr int64_t grouped_gemm_scratch_entries(int64_t m_total) { return m_total / 64 + 1; }
// The order grouped_pair_order writes on the device, from each group's m-tile count (the groups'
// m-tiles consecutive from 0, in group order): for tests and tools.
std::vector<uint32_t> grouped_pair_order(const std::vector<int64_t>& tiles_per_group);

// Checks the arguments and returns them with the leading dimensions filled in. Throws tdist::Error
// naming the argument: dtype, m, n, k (> 0, multiple of 8), num_groups (1 .. 2^31 / N), lda, ldb,
// ldd, a, b, d (null, 16-byte alignment), offsets (null, aligned to its type).
GroupedGemmArgs check_grouped_gemm_args(const GroupedGemmArgs& args);
// The kernel's schedule for checked args and a tile (options.group_m, first_row, m_tile_order).
kernels::gemm::GroupedScheduler grouped_gemm_schedule(const GroupedGemmArgs& checked_args, const GemmTile& tile,
                                                      const GroupedGemmRunOptions& options);
// The GemmArgs of the whole M_total x N x K problem (A, D, and B as its first N rows): launch shape,
// A and D tensor maps.
GemmArgs grouped_gemm_problem(const GroupedGemmArgs& checked_args);

// Host helpers: offsets (G + 1) of groups of `counts` rows, each padded up to grouped_gemm_alignment();
// and the check of host offsets against the rules above (throws naming "offsets").
std::vector<int64_t> grouped_gemm_offsets(const std::vector<int64_t>& counts);
void check_grouped_gemm_offsets(const std::vector<int64_t>& offsets, int64_t m_total);

// The JIT requests of the grouped instances (one per shipped tile, both dtypes), as registered for
// tdist-compile, and the name expression of one.
// (With gathered A: the gather instances, named after GatherGroupedScheduler.)
std::vector<jit::CompileRequest> grouped_gemm_compile_requests();
std::string grouped_gemm_kernel_name(DType dtype, const GemmTile& tile, bool gathered_a = false);

// ---- FP8 (e4m3 in, bf16 out) with block scales: kernels/gemm/sm90_fp8_gemm.cuh ----
//
// The same m-grouped contiguous layout and offsets as above, with e4m3 operands and fp32 scales in
// DeepSeek-V3's blocks (KB = ceil(K / 128), NB = ceil(N / 128)):
//   A         e4m3 M_total x K row-major (lda >= K, a multiple of 16)
//   a_scales  f32: A's scale of row r and K block kb at a_scales[r * a_scales_row_stride + kb *
//             a_scales_kb_stride]; both strides 0: row-major [M_total][KB] (strides KB, 1). Rows of
//             A are tokens, so one scale per token and 128 channels (1 x 128 blocks).
//   B         e4m3 G x N x K (ldb >= K, a multiple of 16)
//   b_scales  f32 [G][NB][KB]: one scale per 128 x 128 block of each B_g
//   D         bf16 M_total x N (ldd >= N, a multiple of 8)
// Value of A[r][c] = A[r][c] x a_scale(r, c / 128); of B_g[j][c] = B_g[j][c] x b_scales[g][j / 128][c / 128].
// K is a multiple of 16 (not necessarily of 128).
// Gathered A (a_gather, as GroupedGemmArgs's): row r of A is token t = token_of_row[r]'s e4m3 row
// (from RowGather's local or gathered rows), its scales token t's: a_scales_local's row
// t - local_begin for the local tokens, a_scales' row t for the others, both with the strides
// above (so the scales travel with their rows); a padding row (t = -1) is zeros.
struct GroupedGemmFp8Args {
  const void* a = nullptr;
  const float* a_scales = nullptr;
  int64_t a_scales_row_stride = 0, a_scales_kb_stride = 0;
  const void* b = nullptr;
  const float* b_scales = nullptr;
  void* d = nullptr;
  const void* offsets = nullptr;  // device memory, num_groups + 1 entries (rules above)
  IndexType offsets_type = IndexType::kInt32;
  int64_t m = 0, n = 0, k = 0;
  int num_groups = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;                                // 0: dense (K, K, N)
  std::optional<kernels::gemm::RowGather> a_gather = std::nullopt;  // A (and lda) then ignored
  const float* a_scales_local = nullptr;  // with a_gather: the local tokens' scales (local_rows > 0)
};

// Checks the arguments and returns them with the leading dimensions and scale strides filled in.
// Throws tdist::Error naming the argument: num_groups, m, n, k (> 0, multiple of 16), lda, ldb, ldd,
// a_scales_row_stride / a_scales_kb_stride (>= 0), a, b, d (null, 16-byte alignment), a_scales,
// b_scales (null, 4-byte alignment), offsets; with a_gather its fields and a_scales_local.
GroupedGemmFp8Args check_grouped_gemm_fp8_args(const GroupedGemmFp8Args& args);
// The FP8 instances' tiles (block_k 128: one scale block per stage), the check of one, its shared
// memory, the heuristic choice (as choose_gemm_tile), names and JIT requests (tdist-compile).
const std::vector<GemmTile>& fp8_gemm_tiles();
void check_fp8_gemm_tile(const GemmTile& tile);
size_t fp8_gemm_shared_bytes(const GemmTile& tile);
GemmTile choose_fp8_gemm_tile(int64_t m, int64_t n, int num_sms);
// Its instances: A by TMA; A gathered through a row index (a_gather); gathered A whose tiles first
// wait for their rows' sources (the fused MoE AllGather's, MoeGatherWaitHooks in
// kernels/gemm/overlap.cuh; launched by that op only). The family grouped_gemm_fp8 ships the first
// two of every tile.
enum class Fp8GroupedKernel { kTma, kGatheredA, kGatheredAWaiting };
std::string grouped_gemm_fp8_kernel_name(const GemmTile& tile, Fp8GroupedKernel kind = Fp8GroupedKernel::kTma);
jit::CompileRequest grouped_gemm_fp8_compile_request(const GemmTile& tile, Fp8GroupedKernel kind);
std::vector<jit::CompileRequest> grouped_gemm_fp8_compile_requests();

// The FP8 GEMM's A from 16- or 32-bit rows, in one pass (kernels/gemm/fp8_quantize.cuh): row r of x
// (dtype bf16, fp16 or fp32; with `swiglu`, SiLU(x[r][0, k)) * x[r][k, 2 k) in fp32) -> q (e4m3) and
// one f32 scale per 128 columns, amax / 448 (the A scales of GroupedGemmFp8Args, row-major).
struct Fp8QuantizeArgs {
  const void* x = nullptr;
  DType dtype = DType::kBFloat16;
  int64_t ldx = 0;  // elements; 0: dense (k, or 2 k with swiglu)
  void* q = nullptr;
  int64_t ldq = 0;  // bytes; 0: k
  float* scales = nullptr;
  // Block kb of row r's scale at scales[r * scale_ld + kb * scale_kb_stride]: row-major (scale_ld >=
  // ceil(k / 128), scale_kb_stride 1) or column-major (scale_ld 1, scale_kb_stride >= rows). 0: row-major dense.
  int64_t scale_ld = 0;
  int64_t scale_kb_stride = 0;
  int64_t rows = 0, k = 0;
  bool swiglu = false;
};
// Checks (k > 0 and a multiple of 16, leading dimensions, 16-byte aligned x and q, 4-byte aligned
// scales; errors name the argument) and returns the args with the leading dimensions filled in.
Fp8QuantizeArgs check_fp8_quantize_args(const Fp8QuantizeArgs& args);
// On `stream`, no host synchronisation (graph-capturable once loaded); rows == 0 is a no-op. The
// instances are JIT family fp8_quantize.
void quantize_fp8_rows(const Fp8QuantizeArgs& args, cudaStream_t stream);
std::vector<jit::CompileRequest> fp8_quantize_compile_requests();

class GroupedGemm {
 public:
  // Reads the current device's SM count (a Hopper GPU); compiles nothing yet.
  GroupedGemm();
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // D = A x B_g^T per group on `stream`. No host synchronisation; graph-capturable once the instance
  // is loaded (the first call of a tile compiles or loads it). M_total == 0 or N == 0 is a no-op.
  void run(const GroupedGemmArgs& args, cudaStream_t stream, const GroupedGemmRunOptions& options = {});

  // The FP8 instance: D (bf16) = A x B_g^T over the scaled e4m3 values, per group. options.tile, if
  // given, is one that check_fp8_gemm_tile accepts; m_tile_order / m_tile_count as above.
  void run(const GroupedGemmFp8Args& args, cudaStream_t stream, const GroupedGemmRunOptions& options = {});

  // The tile run() uses for these args and options.
  GemmTile tile_for(const GroupedGemmArgs& args, const GroupedGemmRunOptions& options = {}) const;
  GemmTile tile_for(const GroupedGemmFp8Args& args, const GroupedGemmRunOptions& options = {}) const;
  int num_sms() const { return num_sms_; }

 private:
  int num_sms_ = 0;
  std::unique_ptr<detail::GemmRuntime<kernels::gemm::GroupedScheduler, kernels::gemm::NoTileHooks>> runtime_;
  std::unique_ptr<detail::GemmRuntime<kernels::gemm::GatherGroupedScheduler, kernels::gemm::NoTileHooks>> gather_;
  std::unique_ptr<detail::Fp8GroupedRuntime> fp8_;
  std::unique_ptr<detail::PairOrderKernel> pair_order_;  // loaded on the first clustered call
  std::once_flag pair_order_once_;
};

}  // namespace tdist
