// Reference values of the collectives' GPU tests: inputs computed from (seed, rank, index), exact in
// every dtype, and a check kernel that recomputes each op's result in double.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "tdist/common/dtype.hpp"
#include "gpu/test_values.cuh"
#include "tdist/device.cuh"

namespace tdist::test::collective_reference {

using tdist::device::u64;

// Input element `i` of `rank`: test::input_value with its zero moved to 1/64 (a zero output is then a
// real error), a multiple of 1/64 in [-1, 1], exact in bf16, f16 and f32, so sums of up to 8 ranks
// are exact in fp32 and the only error of a reduction is the final rounding.
__host__ __device__ inline float input_value(u64 seed, int rank, u64 i) {
  const float v = test::input_value(seed, rank, i);
  return v != 0.0f ? v : 1.0f / 64.0f;
}

enum class Op { kAllReduce, kAllGather, kReduceScatter };

// p[i] = input_value(seed ^ *counter, rank, first + i); `counter` (may be null) lets a graph
// regenerate fresh inputs on each replay.
template <typename T>
__global__ void fill_kernel(T* p, u64 count, u64 seed, const u64* counter, int rank, u64 first) {
  const u64 s = seed ^ (counter ? *counter * 0x2545F4914F6CDD1Dull : 0);
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<u64>(gridDim.x) * blockDim.x)
    p[i] = to_t<T>(input_value(s, rank, first + i));
}

// Compares out[0, out_count) with the op's expected result in double, times `scale`; counts the
// mismatches.
template <typename T>
__global__ void check_kernel(const T* out, u64 out_count, Op op, u64 c, int n, int me, u64 seed, const u64* counter,
                             double tol, unsigned long long* bad, unsigned long long* first_bad, double scale = 1.0) {
  const u64 s = seed ^ (counter ? *counter * 0x2545F4914F6CDD1Dull : 0);
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < out_count;
       i += static_cast<u64>(gridDim.x) * blockDim.x) {
    double expect = 0;
    if (op == Op::kAllGather) {
      expect = input_value(s, static_cast<int>(i / c), i % c);
    } else {
      const u64 j = op == Op::kAllReduce ? i : me * c + i;
      for (int r = 0; r < n; ++r) expect += input_value(s, r, j);
    }
    expect *= scale;
    const double got = to_f(out[i]);
    if (!(fabs(got - expect) <= tol * fabs(expect) + 1e-30)) {
      atomicAdd(bad, 1ull);
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void bump_kernel(u64* counter) { ++*counter; }

double tolerance(DType t) {
  // Half an ulp of the output type, relative (inputs and fp32 sums are exact).
  return t == DType::kFloat32 ? 1e-6 : t == DType::kFloat16 ? 1.0 / 1024 : 1.0 / 128;
}

template <typename F>
void dispatch(DType t, F&& f) {
  if (t == DType::kFloat32)
    f(float{});
  else if (t == DType::kFloat16)
    f(__half{});
  else
    f(__nv_bfloat16{});
}

const char* op_name(Op op) {
  return op == Op::kAllReduce ? "all_reduce" : op == Op::kAllGather ? "all_gather" : "reduce_scatter";
}

}  // namespace tdist::test::collective_reference
