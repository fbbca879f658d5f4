// The NCCL halves of the cuBLAS + NCCL sequences that the overlapped ops must beat (their method
// kBaseline), written as a user would: one NCCL collective over row chunks of RowChunks{m, world};
// when the ranks' row counts differ (m not divisible by the world size), one broadcast or reduce per
// root inside a group. The NCCL work gets the World's deadline (World::watch_nccl).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "tdist/common/dtype.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"  // RowChunks
#include "tdist/runtime/world.hpp"

namespace tdist::overlap {

// Every rank's rows (`local`: this rank's, row_elems elements each) into `gathered` (M rows).
void nccl_all_gather_rows(const void* local, void* gathered, const kernels::gemm::RowChunks& rows, size_t row_elems,
                          DType dtype, World& world, cudaStream_t stream);
// The sum over ranks of `partial` (M rows), this rank's rows of it into `out`.
void nccl_reduce_scatter_rows(const void* partial, void* out, const kernels::gemm::RowChunks& rows, size_t row_elems,
                              DType dtype, World& world, cudaStream_t stream);

}  // namespace tdist::overlap
