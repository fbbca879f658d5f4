// Pure host-side pieces of the collectives (no GPU needed, unit-tested on the CPU): the automatic
// method choice, per-call / environment overrides, and argument checks. Internal: the user API is
// ops/collectives.hpp and ops/collective_methods.hpp.
//
// Sizes are those of nccl-tests: `bytes` is the whole buffer of an AllReduce, the gathered output of
// an AllGather (world_size x the per-rank input) and the input of a ReduceScatter (world_size x the
// per-rank output).
#pragma once

#include <cstddef>
#include <string>

#include "tdist/common/dtype.hpp"
#include "tdist/ops/collective_methods.hpp"

namespace tdist {

// What the choice depends on.
struct CollectiveShape {
  size_t bytes = 0;  // nccl-tests size (see above)
  DType dtype = DType::kBFloat16;
  int world_size = 2;
  bool aligned16 = true;       // every pointer (and per-rank stride) 16-byte aligned
  bool in_symmetric = false;   // input is the caller's symmetric buffer (zero copy)
  bool out_symmetric = false;  // output is the caller's symmetric buffer
};

// What a context can hold.
struct CollectiveLimits {
  size_t workspace_bytes = 0;  // one workspace slot (the context's max_bytes)
  size_t ll_bytes = 0;         // low-latency payload per rank (per source: AllReduce buffer, AllGather and
                               // ReduceScatter per-rank size)
  size_t ll128_bytes = 0;      // LL128 payload per rank (the largest ll128 AllReduce buffer)
};

// Whether `m` can run this shape in this context (auto and nccl always can).
bool feasible(AllReduceMethod m, const CollectiveShape& s, const CollectiveLimits& l);
bool feasible(AllGatherMethod m, const CollectiveShape& s, const CollectiveLimits& l);
bool feasible(ReduceScatterMethod m, const CollectiveShape& s, const CollectiveLimits& l);

// The automatic choice (never kAuto; falls back to kNccl when no tdist method fits).
// Thresholds: docs/collectives.md ("Method selection").
AllReduceMethod select_all_reduce(const CollectiveShape& s, const CollectiveLimits& l);
AllGatherMethod select_all_gather(const CollectiveShape& s, const CollectiveLimits& l);
ReduceScatterMethod select_reduce_scatter(const CollectiveShape& s, const CollectiveLimits& l);

// requested (when not auto) > env_value (when non-null and non-empty) > select_*. An explicit method
// that cannot run the shape throws tdist::Error naming `method` (or the variable) and the reason.
AllReduceMethod resolve_all_reduce(AllReduceMethod requested, const char* env_value, const CollectiveShape& s,
                                   const CollectiveLimits& l);
AllGatherMethod resolve_all_gather(AllGatherMethod requested, const char* env_value, const CollectiveShape& s,
                                   const CollectiveLimits& l);
ReduceScatterMethod resolve_reduce_scatter(ReduceScatterMethod requested, const char* env_value,
                                           const CollectiveShape& s, const CollectiveLimits& l);

// Whether an NCCL AllGather / ReduceScatter of this shape must keep one buffer out of the heap's
// window. NCCL (2.28) runs its symmetric kernels when both buffers lie in a window registered with
// NCCL_WIN_COLL_SYMMETRIC, as the whole symmetric heap is, and those returned wrong data on 2 x H200
// for per-rank sizes that are not a multiple of 16 bytes (1001 bf16 / f16 / f32 elements); the same
// calls on ordinary buffers are right. tdist therefore stages one side through ordinary memory when
// both buffers are symmetric and any pointer or the per-rank stride is not 16-byte aligned
// (s.aligned16 covers both). AllReduce is not affected (it passed at the same sizes).
bool nccl_avoid_symmetric_kernels(const CollectiveShape& s);

// Argument checks (throw tdist::Error naming the argument). `count` is the AllReduce element count,
// the per-rank AllGather input count, or the per-rank ReduceScatter output count.
void check_dtype(DType dtype);
void check_count(const char* op, size_t count);
// `in` / `out` non-null; out-of-place buffers must not overlap except in the op's in-place layout:
// all_reduce in == out; all_gather in == out + rank * count; reduce_scatter out == in + rank * count.
void check_buffers(const char* op, const void* in, size_t in_bytes, const void* out, size_t out_bytes,
                   const void* in_place_in);
// ReduceScatter given its whole input: the per-rank output count, or an error naming `count` when it
// does not divide by the world size.
size_t reduce_scatter_recv_count(size_t total_count, int world_size);
// A zero-copy buffer either lies wholly inside the heap [base, base + size) or wholly outside it;
// returns true when inside, throws naming `what` when it straddles the end.
bool check_symmetric_range(const char* what, const void* p, size_t bytes, const void* heap_base, size_t heap_size);

}  // namespace tdist
