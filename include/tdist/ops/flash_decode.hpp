// Decode attention: one query token per sequence against its KV cache, split along the sequence
// (flash decoding) so that even one sequence fills the GPU, on Hopper. docs/flash_decode.md has the
// layouts, the split model and a worked sequence-parallel step.
//
//   tdist::FlashDecode decode;                          // this GPU; kernels compile on first use
//   tdist::FlashDecodeArgs a;                           // q, out, lse, cache, lengths: see below
//   decode.run(a, stream);                              // out, lse; no host synchronisation
//   decode.check_errors();                              // later (syncs): bad block table / lengths
//
//   tdist::DistributedFlashDecode dist(world, heap, {.max_batch = 32, .q_heads = 32, .head_dim = 128});
//   dist.run(a, stream);   // a's cache = this rank's part of every sequence; out = attention over all
//
// Both run on a stream without host synchronisation and can be captured in a CUDA graph (the
// lengths are read on the device; the split count is fixed by a.max_seq_len at capture).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "tdist/common/dtype.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

// One decode step's operands. Device pointers; every tensor 16-byte aligned, row-major:
//   q            T[batch][q_heads][head_dim]
//   k_cache, v_cache
//     paged      T[num_pages][page_size][kv_heads][head_dim], block_table i32[batch][max_pages]
//     contiguous T[batch][page_size][kv_heads][head_dim] (block_table == nullptr; page_size is
//                then the capacity of a sequence and num_pages must equal batch)
//     page_stride elements from one page (or contiguous sequence) to the next, the same in k_cache
//                and v_cache; 0: dense, page_size x kv_heads x head_dim. A page's rows stay dense.
//                FlashInfer's combined cache T[num_pages][2][page_size][kv_heads][head_dim] is
//                k_cache = its base, v_cache = base + page_size x kv_heads x head_dim, and twice
//                that for page_stride.
//   seq_lens     i32[batch], tokens of each sequence in the cache (0 allowed), device memory
//   out          T[batch][q_heads][head_dim]
//   lse          f32[batch][q_heads] or nullptr: natural-log sum of exp(logits), -inf when empty
// T = dtype (bf16 or fp16). Query head h attends KV head h / (q_heads / kv_heads).
struct FlashDecodeArgs {
  DType dtype = DType::kBFloat16;
  int64_t batch = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;  // 64, 128 or 256
  const void* q = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int64_t num_pages = 0;
  int64_t page_size = 0;    // paged: 1..256
  int64_t page_stride = 0;  // elements between pages (layout above); 0: dense
  const int32_t* block_table = nullptr;
  int64_t max_pages = 0;  // block_table's row length (paged)
  const int32_t* seq_lens = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  float softmax_scale = 0.f;  // logits = softmax_scale * q.k (e.g. 1 / sqrt(head_dim))
  float softcap = 0.f;        // > 0: logits = softcap * tanh(logits / softcap)
  int64_t max_seq_len = 0;    // the longest length seq_lens may hold; 0: the capacity
};

// Tokens a sequence can hold: max_pages x page_size (paged) or page_size (contiguous).
int64_t flash_decode_capacity(const FlashDecodeArgs& a);

// Checks what the host can see (shapes, dtypes, alignment, limits); throws tdist::Error naming the
// argument. Block-table entries and lengths are checked on the device (check_errors()).
void check_flash_decode_args(const FlashDecodeArgs& a);

// How a call is cut into CTAs: grid (kv_heads * head_chunks, num_splits, batch).
struct FlashDecodeSplitPlan {
  int heads_per_cta = 1;  // query heads sharing a KV head that one CTA computes (1..16, divides the group)
  int head_chunks = 1;    // group / heads_per_cta
  int num_splits = 1;     // pieces of each sequence
};

// The split model: of every split count, the one with the lowest estimated time. A split CTA reads
// its pieces' K and V rows (4 x head_dim bytes a token) through a chain of round trips, so what it
// reads per second depends on how many CTAs share its SM, and the GPU's bandwidth caps the whole.
// The grid runs in waves of what fits at once (ctas_per_sm x num_sms); a wave of n CTAs of `per`
// tokens (avg on average) takes the smooth maximum (exponent kBoundBlend) of
//   its slowest SM:   per x k / R(k)     k = ceil(n / num_sms) of its CTAs resident, R(k) = k x
//                                        kLoneCtaRate / (1 + kSharedSmFalloff x (k - 1))
//   the bandwidth:    n x avg / num_sms
// in units of one token's bytes at an SM's share of the copy bandwidth (kSmShareGBps), plus
// kWaveStartUs (the chain before a wave's first bytes); more than one split adds the merge,
// kMergeUs and kMergeRoundUs per round of the combine kernel's loads (combine_batch_splits(head_dim)
// splits). Pieces are whole steps (kTokensPerStep), and splits that this rounding would leave empty
// are not launched. The constants were measured on an H200 (132 SMs, 4.26 TB/s copy; head dim 128,
// bf16, 16- and 64-token pages) by timing every split count of 16 cases (docs/flash_decode.md,
// "The split model, measured"): one CTA alone on its SM reads at 0.87 of the SM's share, two at
// 1.38 together.
struct FlashDecodeSplitModel {
  static constexpr int kCtasPerSm = 2;           // when the kernel's occupancy is not known
  static constexpr int64_t kTokensPerStep = 64;  // a CTA's step: 4 warps x one 16-token tile
  static constexpr int kMaxSplits = 256;
  static constexpr double kLoneCtaRate = 0.87;
  static constexpr double kSharedSmFalloff = 0.26;
  static constexpr double kSmShareGBps = 32.3;
  static constexpr double kBoundBlend = 6.0;
  static constexpr double kWaveStartUs = 1.5;
  static constexpr double kMergeUs = 0.5;
  static constexpr double kMergeRoundUs = 0.9;
};
// The model's estimate (us) of one call cut into `splits` pieces per sequence (after the whole-step
// rounding), `cta_groups` = batch x kv_heads x head chunks CTAs per split.
double flash_decode_estimate_us(int64_t cta_groups, int64_t head_dim, int64_t max_seq_len, int64_t splits, int num_sms,
                                int ctas_per_sm);
// Query heads of one KV head that a CTA computes: the largest divisor of the group up to 16 (the
// rows of the kernel's MMA tile).
int flash_decode_heads_per_cta(int64_t group);
FlashDecodeSplitPlan plan_flash_decode(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t max_seq_len, int num_sms,
                                       int ctas_per_sm = FlashDecodeSplitModel::kCtasPerSm);

// `splits` (clamped to 1..kMaxSplits) less those that pieces of whole steps leave empty.
int flash_decode_nonempty_splits(int64_t max_seq_len, int64_t splits);

// An SM's limits (cudaDeviceProp: regsPerMultiprocessor, maxThreadsPerMultiProcessor,
// maxBlocksPerMultiProcessor, sharedMemPerMultiprocessor, reservedSharedMemPerBlock); Hopper's here.
struct SmLimits {
  int regs = 65536;
  int max_threads = 2048;
  int max_ctas = 32;
  size_t smem = 233472;
  size_t smem_reserved_per_cta = 1024;
};
// CTAs of `threads` threads, `regs_per_thread` registers (allocated per warp in units of 256) and
// `smem_bytes` of shared memory that one SM holds at once (>= 1).
int resident_ctas_per_sm(int regs_per_thread, int threads, size_t smem_bytes, const SmLimits& sm);

class FlashDecodeKernels;

// Single-GPU decode attention on the current device.
class FlashDecode {
 public:
  FlashDecode();
  ~FlashDecode();
  FlashDecode(const FlashDecode&) = delete;
  FlashDecode& operator=(const FlashDecode&) = delete;

  // Writes a.out and a.lse. The split workspace grows on a call that needs more (not allowed while
  // the stream is being captured: run the largest shape once before capturing).
  void run(const FlashDecodeArgs& a, cudaStream_t stream);

  // Synchronises the device; throws naming block_table or seq_lens when a call since the last
  // check met an entry outside the cache or a length outside [0, capacity] (that page was skipped,
  // that length clamped), and clears the record.
  void check_errors();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

struct DistributedFlashDecodeConfig {
  int64_t max_batch = 0;
  int64_t q_heads = 0;
  int64_t head_dim = 0;
};

// Sequence-parallel decode attention: each rank holds its part of every sequence's KV (its own
// pages and lengths, possibly none) and the same q; run() computes this rank's partial output and
// log-sum-exp, exchanges them with every rank of the LSA team through low-latency lines and merges
// them, so every rank ends with the attention over the whole sequences. Collective: every rank
// makes the same calls, with the same batch, heads, dtype and q.
class DistributedFlashDecode {
 public:
  // Collective: allocates 2 x world x max_batch x q_heads x (head_dim + 1) x 8 bytes from `heap`.
  DistributedFlashDecode(World& world, SymmetricHeap& heap, const DistributedFlashDecodeConfig& config);
  // Over a caller's buffer of heap_bytes(config, world) bytes, zeroed, allocated collectively:
  // `heap` describes it as a heap of its own (rank, world, every rank's mapping of it in
  // lsa_bases, which must hold every rank), and `buffer` is this rank's (lsa_bases[rank]).
  DistributedFlashDecode(const device::SymmetricHeapView& heap, void* buffer,
                         const DistributedFlashDecodeConfig& config);
  ~DistributedFlashDecode();
  DistributedFlashDecode(const DistributedFlashDecode&) = delete;
  DistributedFlashDecode& operator=(const DistributedFlashDecode&) = delete;

  void run(const FlashDecodeArgs& a, cudaStream_t stream);
  void check_errors();
  static size_t heap_bytes(const DistributedFlashDecodeConfig& config, int world_size);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist
