// Basic definitions shared by the device API. Compiles under nvcc and NVRTC alike, so it
// includes no standard header: NVRTC ships none.
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf; NVRTC declares it itself
#endif

#if defined(__CUDACC__)
#define TDIST_DEVICE __device__ __forceinline__
#define TDIST_HOST_DEVICE __host__ __device__ __forceinline__
#else  // descriptors such as SymmetricHeapView are also used by host-only translation units
#define TDIST_DEVICE inline
#define TDIST_HOST_DEVICE inline
#endif

// Full unrolling in code shared with the host compiler (which would warn of an unknown pragma).
#if defined(__CUDACC__)
#define TDIST_UNROLL _Pragma("unroll")
#else
#define TDIST_UNROLL
#endif

namespace tdist::device {

using u32 = unsigned int;
using u64 = unsigned long long;

// Largest load/store-accessible (LSA) team a descriptor can address: one NVLink domain.
// 72 covers an NVL72 rack; 8-GPU nodes use the first 8 slots.
constexpr int kMaxLsaRanks = 72;

// Memory-model scope of a synchronising access (PTX .gpu or .sys). Flags written by another
// GPU over NVLink need kSystem; flags shared only by blocks of one GPU may use kGpu.
enum class Scope { kGpu, kSystem };

// Comparison of a flag against an expected value in waits.
enum class Cmp { kEq, kNe, kGt, kGe, kLt, kLe };

// How a signal updates its flag.
enum class SignalOp { kSet, kAdd };

template <typename T>
TDIST_DEVICE bool compare(T seen, Cmp cmp, T expected) {
  switch (cmp) {
    case Cmp::kEq: return seen == expected;
    case Cmp::kNe: return seen != expected;
    case Cmp::kGt: return seen > expected;
    case Cmp::kGe: return seen >= expected;
    case Cmp::kLt: return seen < expected;
    default: return seen <= expected;
  }
}

TDIST_HOST_DEVICE const char* cmp_name(Cmp cmp) {
  switch (cmp) {
    case Cmp::kEq: return "==";
    case Cmp::kNe: return "!=";
    case Cmp::kGt: return ">";
    case Cmp::kGe: return ">=";
    case Cmp::kLt: return "<";
    default: return "<=";
  }
}

}  // namespace tdist::device
