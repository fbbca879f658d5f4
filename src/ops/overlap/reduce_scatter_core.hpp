// The ReduceScatter half that GemmReduceScatter and GemmAllReduce share: every rank computes partial
// products of every rank's rows, sends each peer's rows to it as soon as they are computed (copy
// engine, a flag per piece), and reduces the partials of its own rows.
#pragma once

#include <functional>

#include "src/ops/overlap/runtime.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/symmetric_layout.hpp"

namespace tdist::overlap {

// The symmetric buffers of one ReduceScatter core (P = overlap_row_pieces of the call, each owner's
// rows cut as RowChunks{rows(owner), P}):
//   recv   T[world][cap][N]  slot s holds source rank s's partial of this rank's rows
//                            (cap = ceil(max_m / world) rows; row stride N of the call)
//   flags  u64[P][world]     flags[p * world + s] = 1 once piece p of slot s has landed
struct ReduceScatterLayout {
  SymmetricLayout layout;
  int64_t cap_rows;
  SymmetricLayout::Region<char> recv;
  SymmetricLayout::Region<u64> flags;
  ReduceScatterLayout(const GemmReduceScatterConfig& c, int world_size);
  // recv's slot of source `s` for calls of N = n.
  char* slot(char* recv_base, int s, int64_t n, DType dtype) const {
    return recv_base + static_cast<size_t>(s) * cap_rows * n * dtype_size(dtype);
  }
};

// Checks max_m and max_n of a config (errors name config.max_m / config.max_n).
void check_reduce_config(const GemmReduceScatterConfig& c);
// The largest collective of the sequential method: the whole M x N partial.
size_t reduce_sequential_bytes(const GemmReduceScatterConfig& c);

class ReduceScatterCore {
 public:
  // `op`: the op's name, for fault messages.
  ReduceScatterCore(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& c, const std::string& op);
  ~ReduceScatterCore();

  GemmReduceScatterConfig config;
  ReduceScatterLayout layout;
  OverlapRuntime rt;

  size_t elem() const { return dtype_size(config.dtype); }
  kg::RowChunks split(int64_t m) const { return {static_cast<u64>(m), rt.size()}; }
  // Ordinary memory, T[max_m][max_n]: this rank's partial products of the peers' rows (and, with one
  // piece and the fused method, of its own); the baseline's and the sequential method's full partial.
  char* staging() const { return staging_.get<char>(); }
  char* slot(int source, int64_t n) const { return layout.slot(recv_, source, n, config.dtype); }

  // Called once rows [first, first + count) of this rank's chunk, piece `piece`, are reduced in `out`
  // (stream order on the caller's stream).
  using RowsDone = std::function<void(int piece, u64 first, u64 count)>;

  // Pieces of each rank's rows in a call (the fused GEMM's chunks are not cut).
  int pieces_of(OverlapComm comm, OverlapMethod method, int64_t m, int64_t n, int64_t k) const;

  // Fused or chunked: this rank's reduced rows into `out` (row stride n), in `pieces` pieces (the
  // caller's pieces_of). `extra_flags` (`extra_bytes`, may be null) are reset with the others
  // before the barrier.
  void run(const void* a, const void* b, int64_t m, int64_t n, int64_t k, OverlapMethod method, int pieces, void* out,
           void* extra_flags, size_t extra_bytes, const RowsDone& rows_done, cudaStream_t stream);

 private:
  SymmetricBlock block_;
  char* recv_ = nullptr;
  u64* flags_ = nullptr;
  DeviceBuffer staging_;
  // The fused GEMM's hook counters: u64 chunk_ready[world], then u32 chunk_tiles_done[world].
  DeviceBuffer counts_;
  size_t counts_bytes() const { return rt.size() * (sizeof(u64) + sizeof(u32)); }
};

}  // namespace tdist::overlap
