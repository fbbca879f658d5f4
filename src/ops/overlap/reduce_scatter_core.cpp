#include "src/ops/overlap/reduce_scatter_core.hpp"

#include <algorithm>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/detail/overlap_model.hpp"

namespace tdist::overlap {

void check_reduce_config(const GemmReduceScatterConfig& c) {
  TDIST_CHECK_ARG(c.max_m > 0 && c.max_m < (int64_t{1} << 31), "config.max_m", "expected 0 < max_m < 2^31, got ",
                  c.max_m);
  TDIST_CHECK_ARG(c.max_n > 0 && c.max_n % 8 == 0 && c.max_n < (int64_t{1} << 31), "config.max_n",
                  "expected 0 < max_n < 2^31 and a multiple of 8, got ", c.max_n);
}

size_t reduce_sequential_bytes(const GemmReduceScatterConfig& c) {
  return static_cast<size_t>(std::max<int64_t>(c.max_m, 1)) * std::max<int64_t>(c.max_n, 8) * dtype_size(c.dtype);
}

ReduceScatterLayout::ReduceScatterLayout(const GemmReduceScatterConfig& c, int world_size)
    : cap_rows((check_reduce_config(c), (c.max_m + world_size - 1) / world_size)),
      recv(layout.add<char>(static_cast<size_t>(world_size) * cap_rows * c.max_n * dtype_size(c.dtype), "recv")),
      flags(layout.add<u64>(static_cast<size_t>(kMaxOverlapPieces) * world_size, "piece flags")) {}

ReduceScatterCore::ReduceScatterCore(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& c,
                                     const std::string& op)
    : config(c),
      layout(c, world.world_size()),
      rt(world, heap, c.dtype, reduce_sequential_bytes(c), /*with_addend=*/true, op),
      block_(heap, layout.layout, op),
      recv_(block_[layout.recv]),
      flags_(block_[layout.flags]),
      staging_(static_cast<size_t>(c.max_m) * c.max_n * dtype_size(c.dtype)),
      counts_(counts_bytes()) {}

ReduceScatterCore::~ReduceScatterCore() { cudaDeviceSynchronize(); }

int ReduceScatterCore::pieces_of(OverlapComm comm, OverlapMethod method, int64_t m, int64_t n, int64_t k) const {
  if (method != OverlapMethod::kChunked) return 1;
  return overlap_row_pieces({comm, m, n, k, rt.size(), config.dtype});
}

void ReduceScatterCore::run(const void* a, const void* b, int64_t m, int64_t n, int64_t k, OverlapMethod method,
                            int pieces, void* out, void* extra_flags, size_t extra_bytes, const RowsDone& rows_done,
                            cudaStream_t stream) {
  const int rank = rt.rank(), world = rt.size();
  const DType t = config.dtype;
  const kg::RowChunks rows = split(m);
  auto* ready = counts_.get<u64>();
  auto* tiles_done = reinterpret_cast<u32*>(ready + world);
  const bool fused = method == OverlapMethod::kFused;
  rt.begin_call({{flags_, pieces * world * sizeof(u64)},
                 {extra_flags, extra_bytes},
                 {fused ? counts_.get() : nullptr, counts_bytes()}},
                stream);

  auto piece_rows = [&](int owner) { return kg::RowChunks{rows.rows(owner), pieces}; };
  auto row_ptr = [&](auto* base, u64 row) { return byte_at(base, row * n * elem()); };
  auto rows_gemm = [&](u64 first, u64 count, void* d) {  // rows [first, first + count) of A
    return gemm_problem(byte_at(a, first * k * elem()), b, d, static_cast<int64_t>(count), n, k, t);
  };
  // This rank's partial of piece p of owner's rows (in staging) -> owner's slot[rank], then its flag.
  auto send = [&](int owner, int p, cudaStream_t s) {
    const kg::RowChunks sub = piece_rows(owner);
    put_signal_async(rt.heap(), row_ptr(slot(rank, n), sub.begin(p)),
                     row_ptr(staging(), rows.begin(owner) + sub.begin(p)), sub.rows(p) * n * elem(),
                     flags_ + p * world + rank, 1, owner, s);
  };
  kg::ReduceParams rp{};
  rp.n = static_cast<u64>(n);

  if (pieces > 1) {
    // Peers' rows first, piece by piece, each sent as soon as it is computed; then this rank's own
    // pieces, each adding the previous rank's partial (the first to arrive: that rank computes
    // these rows first) in the GEMM's epilogue, and with more than two ranks the other partials
    // in place after it.
    for (int i = 1; i < world; ++i) {
      const int owner = (rank + i) % world;
      const kg::RowChunks sub = piece_rows(owner);
      for (int p = 0; p < pieces; ++p) {
        const u64 first = rows.begin(owner) + sub.begin(p);
        rt.cublas().run(rows_gemm(first, sub.rows(p), row_ptr(staging(), first)), stream);
        rt.side().fork(stream);  // the send waits for this piece's GEMM only
        send(owner, p, rt.side().get());
      }
    }
    const int prev = (rank + world - 1) % world;
    const kg::RowChunks sub = piece_rows(rank);
    for (int p = 0; p < pieces; ++p) {
      rt.wait_flags(flags_, p * world + prev, 1, -1, stream);
      const u64 first = sub.begin(p), count = sub.rows(p);
      void* d = row_ptr(out, first);
      rt.cublas().run_add(rows_gemm(rows.begin(rank) + first, count, d), row_ptr(slot(prev, n), first), stream);
      if (world > 2) {
        rt.wait_flags(flags_, p * world, world, p * world + rank, stream);
        rp.num_sources = 0;
        rp.src[rp.num_sources++] = d;
        for (int s = 0; s < world; ++s)
          if (s != rank && s != prev) rp.src[rp.num_sources++] = row_ptr(slot(s, n), first);
        rp.skip_wait = -1;
        rp.flags = nullptr;
        rp.out = d;
        rp.rows = count;
        rt.reduce(rp, stream);
      }
      rows_done(p, first, count);
    }
    rt.side().join(stream);
    return;
  }

  // One piece: the whole chunk per GEMM, then one fp32 reduction of every source.
  rp.num_sources = world;
  rp.skip_wait = rank;
  rp.flags = flags_;
  for (int s = 0; s < world; ++s) rp.src[s] = slot(s, n);
  if (fused) {
    const GemmTile tile = rt.tile_for(m, n, k);
    const kg::ChunkPublishParams hp{tiles_done, ready, rows, static_cast<u32>(tile.block_m),
                                    static_cast<u32>((n + tile.block_n - 1) / tile.block_n)};
    // The GEMM walks the next rank's rows first and this rank's own last, on every SM but one:
    // there the side stream's flag waits run (a one-thread kernel with the device timeout) and
    // release each peer's rows to the copy engine as soon as their chunk is stored. The GEMM is
    // enqueued first so that nothing of the side stream can sit ahead of it in a shared hardware
    // queue; the side stream still starts from the barrier.
    rt.side().mark(stream);
    rt.hooked_gemm(gemm_problem(a, b, staging(), m, n, k, t), tile, hp,
                   static_cast<int64_t>(rows.begin((rank + 1) % world)), std::max(rt.num_sms() - 1, 1), stream);
    rt.side().fork_from_mark();
    for (int i = 1; i < world; ++i) {
      const int owner = (rank + i) % world;
      if (rows.rows(owner) > 0) rt.wait_flags(ready, owner, 1, -1, rt.side().get());
      send(owner, 0, rt.side().get());
    }
    rp.src[rank] = row_ptr(staging(), rows.begin(rank));
  } else {
    for (int i = 1; i <= world; ++i) {
      const int owner = (rank + i) % world;
      void* d = owner == rank ? slot(rank, n) : row_ptr(staging(), rows.begin(owner));
      if (rows.rows(owner) > 0) rt.cublas().run(rows_gemm(rows.begin(owner), rows.rows(owner), d), stream);
      if (owner != rank) {
        rt.side().fork(stream);  // the send waits for this chunk's GEMM only
        send(owner, 0, rt.side().get());
      }
    }
  }
  rp.out = out;
  rp.rows = rows.rows(rank);
  rt.reduce(rp, stream);
  rows_done(0, 0, rows.rows(rank));
  rt.side().join(stream);
}

}  // namespace tdist::overlap
