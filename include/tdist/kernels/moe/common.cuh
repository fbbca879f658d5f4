// What the MoE kernels (routing.cuh, combine.cuh) share: plain C++ for the host, nvcc and NVRTC.
#pragma once

#include "tdist/kernels/gemm/grouped_scheduler.cuh"

namespace tdist::kernels::moe {

using device::u32;
using device::u64;

constexpr u32 kMoeTile = gemm::kGroupedAlignment;  // rows per tile and per padding unit
constexpr u32 kMaxMoeExperts = 1024;               // the routing kernels' shared histograms
constexpr u32 kMaxMoeRanks = 8;

}  // namespace tdist::kernels::moe
