#include "src/ops/overlap/baselines.hpp"

#include "src/ops/nccl_dtype.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/error.hpp"

namespace tdist::overlap {

void nccl_all_gather_rows(const void* local, void* gathered, const kernels::gemm::RowChunks& rows, size_t row_elems,
                          DType dtype, int rank, ncclComm_t comm, cudaStream_t stream) {
  const ncclDataType_t t = detail::nccl_type(dtype);
  const int world = rows.num_ranks;
  const size_t row_bytes = row_elems * dtype_size(dtype);
  if (rows.m % world == 0) {
    TDIST_NCCL_CHECK(ncclAllGather(local, gathered, rows.rows(rank) * row_elems, t, comm, stream));
    return;
  }
  TDIST_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < world; ++r)
    TDIST_NCCL_CHECK(ncclBroadcast(r == rank ? local : nullptr,
                                   static_cast<char*>(gathered) + rows.begin(r) * row_bytes, rows.rows(r) * row_elems,
                                   t, r, comm, stream));
  TDIST_NCCL_CHECK(ncclGroupEnd());
}

void nccl_reduce_scatter_rows(const void* partial, void* out, const kernels::gemm::RowChunks& rows, size_t row_elems,
                              DType dtype, int rank, ncclComm_t comm, cudaStream_t stream) {
  const ncclDataType_t t = detail::nccl_type(dtype);
  const int world = rows.num_ranks;
  const size_t row_bytes = row_elems * dtype_size(dtype);
  if (rows.m % world == 0) {
    TDIST_NCCL_CHECK(ncclReduceScatter(partial, out, rows.rows(rank) * row_elems, t, ncclSum, comm, stream));
    return;
  }
  TDIST_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < world; ++r)
    TDIST_NCCL_CHECK(ncclReduce(static_cast<const char*>(partial) + rows.begin(r) * row_bytes,
                                r == rank ? out : nullptr, rows.rows(r) * row_elems, t, ncclSum, r, comm, stream));
  TDIST_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace tdist::overlap
