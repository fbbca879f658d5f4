#include "src/ops/overlap/baselines.hpp"

#include "src/ops/nccl_dtype.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/error.hpp"

namespace tdist::overlap {

namespace {

// `even()` when every rank owns as many rows, else `per_root(r)` for every rank r in one NCCL group.
template <typename Even, typename PerRoot>
void by_rows(const kernels::gemm::RowChunks& rows, Even even, PerRoot per_root) {
  if (rows.m % rows.num_ranks == 0) {
    TDIST_NCCL_CHECK(even());
    return;
  }
  TDIST_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < rows.num_ranks; ++r) TDIST_NCCL_CHECK(per_root(r));
  TDIST_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace

void nccl_all_gather_rows(const void* local, void* gathered, const kernels::gemm::RowChunks& rows, size_t row_elems,
                          DType dtype, World& world, cudaStream_t stream) {
  // An AllGather moves bytes: counted as such, any element type goes (e4m3 rows, which NCCL has no
  // reduction type for, too).
  const int rank = world.rank();
  ncclComm_t comm = world.comm();
  auto* out = static_cast<char*>(gathered);
  const size_t row_bytes = row_elems * dtype_size(dtype);
  by_rows(
      rows, [&] { return ncclAllGather(local, gathered, rows.rows(rank) * row_bytes, ncclUint8, comm, stream); },
      [&](int r) {
        return ncclBroadcast(r == rank ? local : nullptr, out + rows.begin(r) * row_bytes, rows.rows(r) * row_bytes,
                             ncclUint8, r, comm, stream);
      });
  world.watch_nccl(stream, "AllGather of rows");
}

void nccl_reduce_scatter_rows(const void* partial, void* out, const kernels::gemm::RowChunks& rows, size_t row_elems,
                              DType dtype, World& world, cudaStream_t stream) {
  const ncclDataType_t t = detail::nccl_type(dtype);
  const int rank = world.rank();
  ncclComm_t comm = world.comm();
  const auto* in = static_cast<const char*>(partial);
  const size_t row_bytes = row_elems * dtype_size(dtype);
  by_rows(
      rows, [&] { return ncclReduceScatter(partial, out, rows.rows(rank) * row_elems, t, ncclSum, comm, stream); },
      [&](int r) {
        return ncclReduce(in + rows.begin(r) * row_bytes, r == rank ? out : nullptr, rows.rows(r) * row_elems, t,
                          ncclSum, r, comm, stream);
      });
  world.watch_nccl(stream, "ReduceScatter of rows");
}

}  // namespace tdist::overlap
