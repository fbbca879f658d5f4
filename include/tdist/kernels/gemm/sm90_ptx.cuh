// sm_90a building blocks of the GEMM, as inline PTX: mbarriers, TMA tensor loads and stores, bulk
// async-groups, cp.async, stmatrix, wgmma fences and shared-memory matrix descriptors, setmaxnreg, named barriers.
// Compiles under nvcc and NVRTC.
#pragma once

#include "tdist/device/common.cuh"

// CUtensorMap comes from <cuda.h>, which NVRTC cannot include (stdlib.h); the same opaque type
// (128 bytes, 128-byte aligned, as CUDA 13 declares it) is declared here for NVRTC. The host fills
// it with cuTensorMapEncodeTiled; the kernel only takes its address.
#if defined(__CUDACC_RTC__) && !defined(__cuda_cuda_h__)
typedef struct CUtensorMap_st {
  alignas(128) unsigned long long opaque[16];
} CUtensorMap;
#elif !defined(__CUDACC_RTC__)
#include <cuda.h>
#endif

namespace tdist::kernels::gemm::ptx {

using tdist::device::u32;
using tdist::device::u64;

TDIST_DEVICE u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// ---- mbarriers (shared::cta) ----
TDIST_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialisations visible to the async proxy (TMA) and the cluster.
TDIST_DEVICE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
TDIST_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
TDIST_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives on the mbarrier at shared-memory offset `bar` of the cluster's CTA `cta_rank` (this CTA's
// own included). Default semantics (release at CTA scope), as a consumer's release of a stage needs:
// its reads were wgmma's, complete before the call, and nothing it wrote is read through the barrier.
TDIST_DEVICE void mbar_arrive_cluster(u32 bar, u32 cta_rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta_rank)
      : "memory");
}
TDIST_DEVICE bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
  return done != 0;
}

// Waits for the phase of parity `parity` to complete. A GEMM whose pipeline is broken must not hang
// the GPU silently: after about 30 s of spinning (clock64 at ~1.5-2 GHz) it traps (the launch fails
// with an illegal-instruction error). The diagnostic printf is compiled in only with
// TDIST_GEMM_DEBUG defined (Gemm does so under TDIST_GEMM_DEBUG=1): any call (printf) in the kernel
// makes ptxas serialise the wgmma pipeline (C7510), so release builds must not contain one.
constexpr long long kMbarTimeoutCycles = 1ll << 36;
TDIST_DEVICE void mbar_wait(u32 bar, u32 parity, const char* what) {
  if (mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait(bar, parity)) {
    if (clock64() - start > kMbarTimeoutCycles) {
#if defined(TDIST_GEMM_DEBUG)
      printf("tdist gemm: mbarrier wait (%s) timed out: block %d thread %d, smem 0x%x, parity %u\n", what,
             static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), bar, parity);
#else
      (void)what;
#endif
      __trap();
    }
  }
}

// ---- clusters ----
// This CTA's rank in its cluster.
TDIST_DEVICE u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster: the cluster's barrier, with release / acquire ordering
// (mbarrier initialisations fenced by fence_mbar_init become visible to the peers).
TDIST_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// ---- TMA ----
TDIST_DEVICE void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
// Orders this thread's earlier generic-proxy accesses (an acquire of data written by other agents)
// before its later async-proxy (TMA) accesses of global memory.
TDIST_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// Loads the box at (c0 = innermost coordinate, c1) of `map` into shared memory at `dst`; completes
// its bytes on mbarrier `bar`. Elements outside the tensor are filled with zeros (and still count).
TDIST_DEVICE void tma_load_2d(u32 dst, const void* map, u32 bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// The same box delivered to every CTA of the cluster in `cta_mask` (bit r: cluster rank r), at the
// same shared-memory offset `dst` in each, completing its bytes on the mbarrier at offset `bar` of each.
TDIST_DEVICE void tma_load_2d_multicast(u32 dst, const void* map, u32 bar, int c0, int c1, unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// TMA store of the box at (c0, c1) of `map` from shared memory at `src` (laid out as the map's box,
// swizzled as the map says). Elements outside the tensor are not written. Completes as part of the
// issuing thread's current bulk async-group (bulk_commit_group / bulk_wait_group*).
TDIST_DEVICE void tma_store_2d(const void* map, u32 src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(reinterpret_cast<u64>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}
// One bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared
// memory, completing `bytes` of the mbarrier's transaction count.
TDIST_DEVICE void bulk_load_1d(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
TDIST_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's bulk async-groups are pending in reading their shared-memory
// source (the source may be overwritten after it; the global writes may still be in flight).
template <int N>
TDIST_DEVICE void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk async-groups are pending, writes to global included.
template <int N>
TDIST_DEVICE void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory writes before later async-proxy (TMA
// store) reads of them (each writing thread fences, then a barrier, then one thread issues the store).
TDIST_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- cp.async (the gathered-A loads) ----
// 16 bytes global -> shared; `src_bytes` 0 writes 16 zero bytes and reads nothing (padding rows and
// K past its end). .cg: through L2 only, as TMA's loads.
TDIST_DEVICE void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4 bytes global -> shared (the FP8 GEMM's scales); `src_bytes` 0 writes zeros and reads nothing.
// .ca: the only cache mode of copies smaller than 16 bytes.
TDIST_DEVICE void cp_async_4(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// One arrive on `bar` once every cp.async this thread issued before has landed; .noinc: the arrive
// counts against the barrier's expected arrivals (init counts each such thread).
TDIST_DEVICE void cp_async_mbar_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Waits until every cp.async this thread issued has landed.
TDIST_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- stmatrix ----
// Stores four 8x8 matrices of 16-bit elements: lanes 8i .. 8i+7 give the shared addresses of the 8
// rows (16 bytes each) of matrix i; register ri of lane l holds row l / 4, columns 2 (l % 4) + {0, 1}
// of matrix i (the mma / wgmma accumulator fragment layout).
TDIST_DEVICE unsigned short ld_shared_u16(u32 addr) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
TDIST_DEVICE float ld_shared_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
TDIST_DEVICE void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// ---- wgmma ----
TDIST_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
TDIST_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
TDIST_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator register across wgmma instructions.
TDIST_DEVICE void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor of a K-major tile stored as 128-byte swizzled rows (what TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box): 8-row core groups 1024 bytes
// apart (stride byte offset), leading byte offset unused for this layout, base offset 0 (the tile
// starts 1024-byte aligned). Stepping k by 16 elements adds 32 bytes to the start address.
TDIST_DEVICE u64 smem_desc_k_major_sw128(u32 addr) {
  u64 desc = 0;
  desc |= static_cast<u64>((addr & 0x3FFFF) >> 4);  // start address, bits [0, 14)
  desc |= static_cast<u64>(1) << 16;                // leading byte offset (16 B), ignored here
  desc |= static_cast<u64>(1024 >> 4) << 32;        // stride byte offset, bits [32, 46)
  desc |= static_cast<u64>(1) << 62;                // layout type 1: 128-byte swizzle
  return desc;
}

// ---- registers and barriers ----
template <int kRegs>
TDIST_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
TDIST_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
// Barrier among `count` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is __syncthreads).
TDIST_DEVICE void named_barrier(u32 id, u32 count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

}  // namespace tdist::kernels::gemm::ptx
