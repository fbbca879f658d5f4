// Pure host-side pieces of the collectives (no GPU needed, unit-tested on the CPU): the automatic
// method choice, per-call / environment overrides, and argument checks. Internal: the user API is
// ops/collectives.hpp and ops/collective_methods.hpp.
//
// Sizes are those of nccl-tests: `bytes` is the whole buffer of an AllReduce, the gathered output of
// an AllGather (world_size x the per-rank input) and the input of a ReduceScatter (world_size x the
// per-rank output).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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

// ---------------------------------------------------------------------------------------------
// Timed choice (docs/collectives.md, "Tuning"). On the first call of a size class outside graph
// capture, `auto` times every feasible method of the class (NCCL included) on scratch buffers and
// keeps the fastest for the class; the table above is the fallback.

enum class CollectiveOp { kAllReduce, kAllGather, kReduceScatter };
const char* to_string(CollectiveOp op);

// Classes whose nccl-tests size is larger than this are not timed (the timing would cost seconds
// and the scratch buffers as much memory as the call): the table decides.
constexpr size_t kCollectiveTuneMaxBytes = size_t{1} << 30;

// Byte counts on a log scale, kSizeBucketsPerOctave buckets per power of two: from 8 bytes on,
// bucket(b) = 4 * floor(log2 b) + the two bits below the leading one, so the sizes of a bucket lie
// within a factor 1.25 of each other, and the table's thresholds (powers of two) fall on bucket
// bounds; 0 to 7 bytes are buckets 0 to 3 and 8 to 11 (4 to 7 hold no size). Monotone.
constexpr int kSizeBucketsPerOctave = 4;
int size_bucket(size_t bytes);
// The smallest byte count whose bucket is `bucket` or later, and the smallest of the buckets after
// it (SIZE_MAX past 2^64): bucket k holds [size_bucket_lower(k), size_bucket_upper(k)).
size_t size_bucket_lower(int bucket);
size_t size_bucket_upper(int bucket);

// What a timed winner holds for. Every field is the same on every rank of a correct program (the
// ranks check this before timing a class): sizes and dtype by the call's contract, the kinds because
// a symmetric buffer must be the same buffer on every rank.
struct CollectiveClass {
  CollectiveOp op = CollectiveOp::kAllReduce;
  DType dtype = DType::kBFloat16;
  int world_size = 2;
  bool in_symmetric = false;
  bool out_symmetric = false;
  bool in_place = false;    // all_reduce in == out; all_gather in == out + rank * count; reduce_scatter the reverse
  bool aligned16 = true;    // CollectiveShape::aligned16: pointers and the per-rank part 16-byte multiples
  int bucket = 0;           // size_bucket(nccl-tests bytes)
  unsigned candidates = 0;  // bit m set: method m (the enum's value) is feasible for the call
};
// The class of a call: the shape's fields, its in-place flag and its feasible methods.
CollectiveClass collective_class(CollectiveOp op, const CollectiveShape& s, bool in_place, unsigned candidates);
// One integer per class, below 2^53 (exact as a double, for the ranks' max-reduction); two classes
// have the same key only when every field is equal.
uint64_t class_key(const CollectiveClass& c);
// Readable: "all_reduce bf16 ranks=2 in=symmetric out=ordinary in-place aligned16 bytes=[1048576,1310720)
// candidates=one_shot,two_shot,nccl".
std::string describe(const CollectiveClass& c);

// The methods `auto` may time for a call, in the enum's order (kAuto never; nccl always): those
// feasible() admits. As a bit set (bit m: method m) and as a list.
unsigned all_reduce_candidates(const CollectiveShape& s, const CollectiveLimits& l);
unsigned all_gather_candidates(const CollectiveShape& s, const CollectiveLimits& l);
unsigned reduce_scatter_candidates(const CollectiveShape& s, const CollectiveLimits& l);
std::vector<int> candidate_list(unsigned candidates);
// The name of method `m` (the enum's value) of `op`.
const char* method_name(CollectiveOp op, int m);

// Why `auto` takes the table's pick for a call of a class not yet timed (kNone: time the class).
// The reasons in the order they are tested: a method given per call or by the op's environment
// variable (the table is not consulted at all then), TDIST_COLLECTIVE_TUNE=0, one rank, a class
// above kCollectiveTuneMaxBytes, a single candidate, a stream under graph capture (timing
// synchronises with the host, which capture forbids; the class is timed at its first call outside
// capture).
enum class TuneSkip {
  kNone,
  kExplicitMethod,
  kEnvMethod,
  kTuningOff,
  kSingleRank,
  kTooLarge,
  kOneCandidate,
  kCapturing
};
const char* to_string(TuneSkip reason);
TuneSkip tune_skip_reason(bool method_is_auto, const char* env_value, bool tuning_on, const CollectiveShape& s,
                          unsigned candidates, bool capturing);

// Calls of one size class back to back in one timed launch (their mean is what is compared): enough
// that a small call's launch latency is not the whole measurement, few for large calls. 16 at 1 MB
// and below, falling as 16 MB / bytes, at least 1.
int tune_calls_per_launch(size_t bytes);

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
