// How the M rows of A are split over the ranks, shared by the host program (main.cpp, plain C++)
// and the JIT-compiled kernel (gemm_wait_flags.cu): rank r owns rows [begin(r), begin(r) + rows(r)),
// and the first M % num_ranks ranks own one row more than the others. With M < num_ranks the last
// ranks own no row at all.
#pragma once

#include <tdist/device/common.cuh>

namespace ag_gemm {

using tdist::device::u64;

struct RowSplit {
  u64 m;          // rows of A
  int num_ranks;  // chunks

  TDIST_HOST_DEVICE u64 rows(int r) const { return m / num_ranks + (static_cast<u64>(r) < m % num_ranks ? 1 : 0); }

  TDIST_HOST_DEVICE u64 begin(int r) const {
    const u64 extra = m % num_ranks, ru = static_cast<u64>(r);
    return ru * (m / num_ranks) + (ru < extra ? ru : extra);
  }

  // The rank whose chunk holds `row` (row < m).
  TDIST_HOST_DEVICE int chunk_of(u64 row) const {
    const u64 base = m / num_ranks, extra = m % num_ranks, long_rows = extra * (base + 1);
    return static_cast<int>(row < long_rows ? row / (base + 1) : extra + (row - long_rows) / base);
  }
};

}  // namespace ag_gemm
