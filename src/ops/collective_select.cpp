// Method choice and argument checks of the collectives (pure host code; docs/collectives.md).
#include "tdist/ops/detail/collective_select.hpp"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <initializer_list>

#include "tdist/common/error.hpp"

namespace tdist {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

constexpr size_t KiB = 1024, MiB = 1024 * 1024;

// Thresholds from the side-by-side sweeps on 2 x H200 (bench/results/h200x2/, bf16, symmetric
// buffers, graph-timed up to 4 MB): the LL protocol wins up to 64 KB (AllReduce; LL128 above, to
// 1 MB, all_reduce_ll128.json) and 256 KB per rank (AllGather); at two ranks one-shot AllReduce
// beats two-shot at every size, and the copy-engine AllReduce beats both from 128 MB; the copy-engine
// AllGather overtakes the SM pull from 32 MB; the fused ReduceScatter loses to NCCL below 512 KB.
// NCCL called on symmetric (window) buffers runs its own symmetric kernels, which are slower than its
// regular ones on large AllReduce (0.7x at 512 MB), so the method "nccl" is no stand-in for the NCCL
// baseline there. Larger teams are not measured yet: one-shot and LL read (n - 1) copies, so their
// windows shrink with n, and two-shot takes the rest.
size_t ar_ll_max(int n) { return n <= 2 ? 64 * KiB : n <= 4 ? 32 * KiB : 16 * KiB; }
// LL128 (94 % payload per line against LL's 50 %) from the end of the LL window: at two ranks
// 3.7 / 4.1 / 5.0 / 6.6 us at 128 KB / 256 KB / 512 KB / 1 MB against LL's 3.8 / 4.6 (7.0 with a
// 512 KB buffer) and one-shot's 7.6 / 8.6 / 8.8 / 10.0 (all_reduce_ll128.json,
// all_reduce_ll512.json); within 2 % of LL at 64 KB. Larger teams are not measured: LL128 is not chosen.
size_t ar_ll128_max(int n) { return n <= 2 ? 1 * MiB : 0; }
size_t ar_one_shot_max(int n) { return n <= 2 ? SIZE_MAX : n <= 4 ? 128 * KiB : 64 * KiB; }
size_t ag_ll_max_per_rank(int n) { return n <= 2 ? 256 * KiB : 16 * KiB; }
// LL ReduceScatter (input size): at two ranks, up to 512 KB, where NCCL beat the fused kernel and
// NCCL on window buffers itself fell to 0.63-0.90x of NCCL on regular buffers (128-512 KB). The LL
// kernel sends each peer only its slice, so a rank's traffic stays near (n - 1) / n of the input,
// but each thread waits on n - 1 lines in turn: the window halves per doubling of the team
// (1 MB / n, in the steps of the other tables). Not measured beyond two ranks.
size_t rs_ll_max(int n) { return n <= 2 ? 512 * KiB : n <= 4 ? 256 * KiB : 128 * KiB; }
// From this total size on, a copy-engine AllGather (no SMs, 390 GB/s per direction) beats the SM
// pull when it needs no staging copy (the caller's symmetric buffer is the output or the input).
// Two ranks, bf16 (bench/results/h200x2/all_gather_large.json): ce_push 68 vs sm 71 us at 32 MB,
// 115 vs 131 at 64 MB, 370 vs 499 at 256 MB; sm ahead at 16 MB.
constexpr size_t kAgCeMin = 32 * MiB;
// Into a symmetric output the SM push (every SM storing over NVLink, in-kernel exchanges) beats the
// pull at every size and the copy engine below this size; they are within 2 % here and the copy
// engine, which leaves the SMs free, takes over (all_gather_push_chunked.json: sm_push 58.5 vs
// ce_push 68.2 us at 32 MB, 105.5 vs 114.8 at 64 MB, 196.5 vs 200.3 at 128 MB, 403 vs 371 at 256 MB).
constexpr size_t kAgCePushMin = 128 * MiB;
// With neither buffer symmetric, ce_push stages through the workspace (the pushes land there and the
// gathered blocks are copied out) and still beats the SM pull, which stages its input, from this size
// (all_gather_ordinary_methods.json: 131 vs 146 us at 64 MB, 1655 vs 2304 at 1 GB; sm ahead at 32 MB).
constexpr size_t kAgCeStagedMin = 64 * MiB;
// From this total size on, the pipelined copy-engine ReduceScatter beats the fused SM kernel
// (reduce_scatter_ce_halving.json: 408 vs 439 us at 256 MB, 758 vs 860 at 512 MB, 1452
// vs 1701 at 1 GB; fused ahead at 128 MB, 216 vs 228, and below).
constexpr size_t kRsCeMin = 256 * MiB;
// From this size on, AllReduce as the ce ReduceScatter then the ce_push AllGather (no SMs but the
// reduction's) beats one-shot. Two ranks, bf16 (all_reduce_ce.json, symmetric buffers): 778 against
// 860 us at 256 MB, 2854 against 3383 at 1 GB, a tie at 128 MB (427 / 432); with ordinary buffers,
// where one-shot stages its input (all_reduce_ordinary_methods.json): 461 against 505 us at 128 MB,
// one-shot ahead at 64 MB.
constexpr size_t kArCeMin = 128 * MiB;
bool ce_all_reduce_divides(const CollectiveShape& s) {
  return s.bytes % (dtype_size(s.dtype) * static_cast<size_t>(std::max(1, s.world_size))) == 0;
}
// Below this size NCCL's ReduceScatter beats the fused pull-and-reduce (the choice where LL cannot run).
constexpr size_t kRsFusedMin = 512 * KiB;

// `option`: what sizes the missing buffer (a Collectives constructor argument or option).
std::string infeasible_reason(const char* method, const char* op, const CollectiveShape& s, size_t need, size_t have,
                              const char* what, const char* option = "max_bytes") {
  return detail::concat(method, " cannot run this ", op, " of ", s.bytes, " bytes: it needs ", need, " bytes of ", what,
                        " and the context has ", have, " (create the Collectives context with a larger ", option,
                        ", or use method nccl)");
}
constexpr const char* kLlOption = "CollectivesOptions::ll_bytes";

}  // namespace

const char* to_string(AllReduceMethod m) {
  switch (m) {
    case AllReduceMethod::kAuto: return "auto";
    case AllReduceMethod::kOneShot: return "one_shot";
    case AllReduceMethod::kTwoShot: return "two_shot";
    case AllReduceMethod::kLowLatency: return "ll";
    case AllReduceMethod::kLowLatency128: return "ll128";
    case AllReduceMethod::kNccl: return "nccl";
    case AllReduceMethod::kCe: return "ce";
  }
  return "invalid";
}

const char* to_string(AllGatherMethod m) {
  switch (m) {
    case AllGatherMethod::kAuto: return "auto";
    case AllGatherMethod::kSm: return "sm";
    case AllGatherMethod::kCePush: return "ce_push";
    case AllGatherMethod::kCePull: return "ce_pull";
    case AllGatherMethod::kLowLatency: return "ll";
    case AllGatherMethod::kNccl: return "nccl";
    case AllGatherMethod::kSmPush: return "sm_push";
  }
  return "invalid";
}

const char* to_string(ReduceScatterMethod m) {
  switch (m) {
    case ReduceScatterMethod::kAuto: return "auto";
    case ReduceScatterMethod::kFused: return "fused";
    case ReduceScatterMethod::kCe: return "ce";
    case ReduceScatterMethod::kLowLatency: return "ll";
    case ReduceScatterMethod::kNccl: return "nccl";
  }
  return "invalid";
}

AllReduceMethod parse_all_reduce_method(const std::string& text, const std::string& what) {
  const std::string s = lower(text);
  for (auto m :
       {AllReduceMethod::kAuto, AllReduceMethod::kOneShot, AllReduceMethod::kTwoShot, AllReduceMethod::kLowLatency,
        AllReduceMethod::kLowLatency128, AllReduceMethod::kNccl, AllReduceMethod::kCe})
    if (s == to_string(m)) return m;
  TDIST_FAIL("invalid ", what, " '", text,
             "' for all_reduce (expected auto, one_shot, two_shot, ll, ll128, ce or nccl)");
}

AllGatherMethod parse_all_gather_method(const std::string& text, const std::string& what) {
  const std::string s = lower(text);
  for (auto m : {AllGatherMethod::kAuto, AllGatherMethod::kSm, AllGatherMethod::kSmPush, AllGatherMethod::kCePush,
                 AllGatherMethod::kCePull, AllGatherMethod::kLowLatency, AllGatherMethod::kNccl})
    if (s == to_string(m)) return m;
  TDIST_FAIL("invalid ", what, " '", text,
             "' for all_gather (expected auto, sm, sm_push, ce_push, ce_pull, ll or nccl)");
}

ReduceScatterMethod parse_reduce_scatter_method(const std::string& text, const std::string& what) {
  const std::string s = lower(text);
  for (auto m : {ReduceScatterMethod::kAuto, ReduceScatterMethod::kFused, ReduceScatterMethod::kCe,
                 ReduceScatterMethod::kLowLatency, ReduceScatterMethod::kNccl})
    if (s == to_string(m)) return m;
  TDIST_FAIL("invalid ", what, " '", text, "' for reduce_scatter (expected auto, fused, ce, ll or nccl)");
}

bool feasible(AllReduceMethod m, const CollectiveShape& s, const CollectiveLimits& l) {
  switch (m) {
    case AllReduceMethod::kLowLatency: return s.bytes <= l.ll_bytes;
    case AllReduceMethod::kLowLatency128: return s.bytes <= l.ll128_bytes;
    case AllReduceMethod::kOneShot:
    case AllReduceMethod::kTwoShot: return s.bytes <= l.workspace_bytes;
    // The ce ReduceScatter stages the whole buffer; every rank's slice is a whole number of elements.
    case AllReduceMethod::kCe: return s.bytes <= l.workspace_bytes && ce_all_reduce_divides(s);
    default: return true;
  }
}

bool feasible(AllGatherMethod m, const CollectiveShape& s, const CollectiveLimits& l) {
  const size_t per_rank = s.bytes / std::max(1, s.world_size);
  switch (m) {
    case AllGatherMethod::kLowLatency: return per_rank <= l.ll_bytes;
    case AllGatherMethod::kSm:
    case AllGatherMethod::kCePull: return s.in_symmetric || per_rank <= l.workspace_bytes;
    case AllGatherMethod::kCePush: return s.out_symmetric || s.bytes <= l.workspace_bytes;
    case AllGatherMethod::kSmPush: return s.out_symmetric;
    default: return true;
  }
}

bool feasible(ReduceScatterMethod m, const CollectiveShape& s, const CollectiveLimits& l) {
  switch (m) {
    case ReduceScatterMethod::kLowLatency: return s.bytes / std::max(1, s.world_size) <= l.ll_bytes;
    case ReduceScatterMethod::kFused: return s.in_symmetric || s.bytes <= l.workspace_bytes;
    case ReduceScatterMethod::kCe: return s.bytes <= l.workspace_bytes;
    default: return true;
  }
}

AllReduceMethod select_all_reduce(const CollectiveShape& s, const CollectiveLimits& l) {
  const int n = s.world_size;
  if (n <= 1) return AllReduceMethod::kNccl;
  if (s.bytes <= ar_ll_max(n) && feasible(AllReduceMethod::kLowLatency, s, l)) return AllReduceMethod::kLowLatency;
  if (s.bytes <= ar_ll128_max(n) && feasible(AllReduceMethod::kLowLatency128, s, l))
    return AllReduceMethod::kLowLatency128;
  if (s.bytes >= kArCeMin && feasible(AllReduceMethod::kCe, s, l)) return AllReduceMethod::kCe;
  if (s.bytes <= ar_one_shot_max(n) && feasible(AllReduceMethod::kOneShot, s, l)) return AllReduceMethod::kOneShot;
  if (feasible(AllReduceMethod::kTwoShot, s, l)) return AllReduceMethod::kTwoShot;
  return AllReduceMethod::kNccl;
}

AllGatherMethod select_all_gather(const CollectiveShape& s, const CollectiveLimits& l) {
  const int n = s.world_size;
  if (n <= 1) return AllGatherMethod::kNccl;
  const size_t per_rank = s.bytes / n;
  if (per_rank <= ag_ll_max_per_rank(n) && feasible(AllGatherMethod::kLowLatency, s, l))
    return AllGatherMethod::kLowLatency;
  if (s.out_symmetric) return s.bytes >= kAgCePushMin ? AllGatherMethod::kCePush : AllGatherMethod::kSmPush;
  if (s.bytes >= kAgCeMin) {
    if (s.in_symmetric) return AllGatherMethod::kCePull;
    if (s.bytes >= kAgCeStagedMin && feasible(AllGatherMethod::kCePush, s, l)) return AllGatherMethod::kCePush;
  }
  if (feasible(AllGatherMethod::kSm, s, l)) return AllGatherMethod::kSm;
  return AllGatherMethod::kNccl;
}

ReduceScatterMethod select_reduce_scatter(const CollectiveShape& s, const CollectiveLimits& l) {
  if (s.world_size <= 1) return ReduceScatterMethod::kNccl;
  if (s.bytes <= rs_ll_max(s.world_size) && feasible(ReduceScatterMethod::kLowLatency, s, l))
    return ReduceScatterMethod::kLowLatency;
  // LL buffer too small (or a larger size): the choice without LL.
  if (s.bytes < kRsFusedMin) return ReduceScatterMethod::kNccl;
  if (s.bytes >= kRsCeMin && feasible(ReduceScatterMethod::kCe, s, l)) return ReduceScatterMethod::kCe;
  if (feasible(ReduceScatterMethod::kFused, s, l)) return ReduceScatterMethod::kFused;
  return ReduceScatterMethod::kNccl;
}

bool nccl_avoid_symmetric_kernels(const CollectiveShape& s) {
  return s.in_symmetric && s.out_symmetric && !s.aligned16;
}

namespace {

template <typename M, typename Parse, typename Select, typename Explain>
M resolve(M requested, const char* env_name, const char* env_value, const CollectiveShape& s, const CollectiveLimits& l,
          Parse parse, Select select, Explain explain) {
  std::string what = "argument 'method'";
  M m = requested;
  if (m == M::kAuto && env_value != nullptr && *env_value != '\0') {
    what = detail::concat("environment variable ", env_name);
    m = parse(env_value, what);
  }
  if (m == M::kAuto) return select(s, l);
  if (!feasible(m, s, l)) TDIST_FAIL("invalid ", what, ": ", explain(m));
  return m;
}

}  // namespace

AllReduceMethod resolve_all_reduce(AllReduceMethod requested, const char* env_value, const CollectiveShape& s,
                                   const CollectiveLimits& l) {
  return resolve(requested, kAllReduceMethodEnv, env_value, s, l, parse_all_reduce_method, select_all_reduce,
                 [&](AllReduceMethod m) {
                   if (m == AllReduceMethod::kLowLatency)
                     return infeasible_reason("ll", "all_reduce", s, s.bytes, l.ll_bytes, "low-latency buffer",
                                              kLlOption);
                   if (m == AllReduceMethod::kLowLatency128)
                     return infeasible_reason("ll128", "all_reduce", s, s.bytes, l.ll128_bytes,
                                              "low-latency (LL128) buffer", "CollectivesOptions::ll128_bytes");
                   if (m == AllReduceMethod::kCe && !ce_all_reduce_divides(s))
                     return detail::concat("ce cannot run this all_reduce of ", s.bytes, " bytes: its ",
                                           s.bytes / dtype_size(s.dtype), " elements do not split evenly over ",
                                           s.world_size, " ranks (use another method)");
                   return infeasible_reason(to_string(m), "all_reduce", s, s.bytes, l.workspace_bytes, "workspace");
                 });
}

AllGatherMethod resolve_all_gather(AllGatherMethod requested, const char* env_value, const CollectiveShape& s,
                                   const CollectiveLimits& l) {
  const size_t per_rank = s.bytes / std::max(1, s.world_size);
  return resolve(requested, kAllGatherMethodEnv, env_value, s, l, parse_all_gather_method, select_all_gather,
                 [&](AllGatherMethod m) {
                   if (m == AllGatherMethod::kLowLatency)
                     return infeasible_reason("ll", "all_gather", s, per_rank, l.ll_bytes,
                                              "low-latency buffer per rank", kLlOption);
                   if (m == AllGatherMethod::kCePush)
                     return infeasible_reason("ce_push", "all_gather", s, s.bytes, l.workspace_bytes, "workspace");
                   if (m == AllGatherMethod::kSmPush)
                     return std::string(
                         "sm_push stores into the peers' outputs, so 'out' must be a symmetric "
                         "buffer of the context's heap (or use another method)");
                   return infeasible_reason(to_string(m), "all_gather", s, per_rank, l.workspace_bytes, "workspace");
                 });
}

ReduceScatterMethod resolve_reduce_scatter(ReduceScatterMethod requested, const char* env_value,
                                           const CollectiveShape& s, const CollectiveLimits& l) {
  return resolve(requested, kReduceScatterMethodEnv, env_value, s, l, parse_reduce_scatter_method,
                 select_reduce_scatter, [&](ReduceScatterMethod m) {
                   if (m == ReduceScatterMethod::kLowLatency)
                     return infeasible_reason("ll", "reduce_scatter", s, s.bytes / std::max(1, s.world_size),
                                              l.ll_bytes, "low-latency buffer per rank", kLlOption);
                   return infeasible_reason(to_string(m), "reduce_scatter", s, s.bytes, l.workspace_bytes, "workspace");
                 });
}

// ---------------------------------------------------------------------------------------------
// Timed choice: size classes, candidates and when the table decides instead.

const char* to_string(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
  }
  return "invalid";
}

int size_bucket(size_t bytes) {
  if (bytes < 4) return static_cast<int>(bytes);
  int e = 63;
  while ((bytes >> e) == 0) --e;  // floor(log2 bytes), at least 2 here
  return kSizeBucketsPerOctave * e + static_cast<int>((bytes >> (e - 2)) & 3);
}

size_t size_bucket_lower(int bucket) {
  if (bucket <= 0) return 0;
  if (bucket < 4) return static_cast<size_t>(bucket);
  if (bucket < 8) return 4;
  const int e = bucket / kSizeBucketsPerOctave, f = bucket % kSizeBucketsPerOctave;
  if (e >= 64) return SIZE_MAX;
  return static_cast<size_t>(4 + f) << (e - 2);
}

size_t size_bucket_upper(int bucket) { return size_bucket_lower(bucket + 1); }

CollectiveClass collective_class(CollectiveOp op, const CollectiveShape& s, bool in_place, unsigned candidates) {
  CollectiveClass c;
  c.op = op;
  c.dtype = s.dtype;
  c.world_size = s.world_size;
  c.in_symmetric = s.in_symmetric;
  c.out_symmetric = s.out_symmetric;
  c.in_place = in_place;
  c.aligned16 = s.aligned16;
  c.bucket = size_bucket(s.bytes);
  c.candidates = candidates;
  return c;
}

uint64_t class_key(const CollectiveClass& c) {
  // bits: op 0-1, dtype 2-4, kinds 5-8, bucket 9-17, candidates 18-25, world size 26-41 (42 in all)
  const uint64_t kinds =
      (c.in_symmetric ? 1u : 0u) | (c.out_symmetric ? 2u : 0u) | (c.in_place ? 4u : 0u) | (c.aligned16 ? 8u : 0u);
  return static_cast<uint64_t>(c.op) | static_cast<uint64_t>(c.dtype) << 2 | kinds << 5 |
         static_cast<uint64_t>(c.bucket & 0x1ff) << 9 | static_cast<uint64_t>(c.candidates & 0xff) << 18 |
         static_cast<uint64_t>(c.world_size & 0xffff) << 26;
}

const char* method_name(CollectiveOp op, int m) {
  switch (op) {
    case CollectiveOp::kAllReduce: return to_string(static_cast<AllReduceMethod>(m));
    case CollectiveOp::kAllGather: return to_string(static_cast<AllGatherMethod>(m));
    case CollectiveOp::kReduceScatter: return to_string(static_cast<ReduceScatterMethod>(m));
  }
  return "invalid";
}

std::vector<int> candidate_list(unsigned candidates) {
  std::vector<int> v;
  for (int m = 0; m < 32; ++m)
    if (candidates >> m & 1u) v.push_back(m);
  return v;
}

std::string describe(const CollectiveClass& c) {
  std::string names;
  for (int m : candidate_list(c.candidates)) names += detail::concat(names.empty() ? "" : ",", method_name(c.op, m));
  return detail::concat(to_string(c.op), " ", to_string(c.dtype), " ranks=", c.world_size,
                        " in=", c.in_symmetric ? "symmetric" : "ordinary",
                        " out=", c.out_symmetric ? "symmetric" : "ordinary", c.in_place ? " in-place" : "",
                        c.aligned16 ? " aligned16" : " unaligned16", " bytes=[", size_bucket_lower(c.bucket), ",",
                        size_bucket_upper(c.bucket), ") candidates=", names);
}

namespace {

template <typename M>
unsigned candidates_of(std::initializer_list<M> methods, const CollectiveShape& s, const CollectiveLimits& l) {
  unsigned mask = 0;
  for (M m : methods)
    if (feasible(m, s, l)) mask |= 1u << static_cast<int>(m);
  return mask;
}

}  // namespace

unsigned all_reduce_candidates(const CollectiveShape& s, const CollectiveLimits& l) {
  using M = AllReduceMethod;
  return candidates_of({M::kOneShot, M::kTwoShot, M::kLowLatency, M::kLowLatency128, M::kNccl, M::kCe}, s, l);
}

unsigned all_gather_candidates(const CollectiveShape& s, const CollectiveLimits& l) {
  using M = AllGatherMethod;
  return candidates_of({M::kSm, M::kCePush, M::kCePull, M::kLowLatency, M::kNccl, M::kSmPush}, s, l);
}

unsigned reduce_scatter_candidates(const CollectiveShape& s, const CollectiveLimits& l) {
  using M = ReduceScatterMethod;
  return candidates_of({M::kFused, M::kCe, M::kLowLatency, M::kNccl}, s, l);
}

const char* to_string(TuneSkip reason) {
  switch (reason) {
    case TuneSkip::kNone: return "timed";
    case TuneSkip::kExplicitMethod: return "a method given per call";
    case TuneSkip::kEnvMethod: return "a method set in the environment";
    case TuneSkip::kTuningOff: return "TDIST_COLLECTIVE_TUNE=0";
    case TuneSkip::kSingleRank: return "one rank";
    case TuneSkip::kTooLarge: return "a size above the tuning limit";
    case TuneSkip::kOneCandidate: return "a single feasible method";
    case TuneSkip::kCapturing: return "a stream under graph capture";
  }
  return "invalid";
}

TuneSkip tune_skip_reason(bool method_is_auto, const char* env_value, bool tuning_on, const CollectiveShape& s,
                          unsigned candidates, bool capturing) {
  if (!method_is_auto) return TuneSkip::kExplicitMethod;
  // An environment value of "auto" leaves the choice to auto, as resolve_* reads it.
  if (env_value != nullptr && *env_value != '\0' && lower(env_value) != "auto") return TuneSkip::kEnvMethod;
  if (!tuning_on) return TuneSkip::kTuningOff;
  if (s.world_size <= 1) return TuneSkip::kSingleRank;
  if (s.bytes > kCollectiveTuneMaxBytes) return TuneSkip::kTooLarge;
  if ((candidates & (candidates - 1)) == 0) return TuneSkip::kOneCandidate;
  if (capturing) return TuneSkip::kCapturing;
  return TuneSkip::kNone;
}

int tune_calls_per_launch(size_t bytes) {
  constexpr size_t kBytesPerLaunch = 16 * MiB, kMaxCalls = 16;
  return static_cast<int>(std::clamp<size_t>(kBytesPerLaunch / std::max<size_t>(bytes, 1), 1, kMaxCalls));
}

void check_dtype(DType dtype) {
  const int v = static_cast<int>(dtype);
  TDIST_CHECK_ARG(v >= 0 && v <= static_cast<int>(DType::kBFloat16), "dtype", v,
                  " is not a supported type (bf16, f16, f32)");
}

void check_count(const char* op, size_t count) {
  TDIST_CHECK_ARG(count > 0, "count", op, " needs at least one element");
  TDIST_CHECK_ARG(count <= (SIZE_MAX >> 8), "count", op, ": ", count, " elements is not a plausible size");
}

void check_buffers(const char* op, const void* in, size_t in_bytes, const void* out, size_t out_bytes,
                   const void* in_place_in) {
  TDIST_CHECK_ARG(in != nullptr, "in", op, ": null input");
  TDIST_CHECK_ARG(out != nullptr, "out", op, ": null output");
  if (in == in_place_in) return;
  const auto a = reinterpret_cast<uintptr_t>(in), b = reinterpret_cast<uintptr_t>(out);
  const bool overlap = a < b + out_bytes && b < a + in_bytes;
  TDIST_CHECK_ARG(!overlap, "out", op, ": the output [", out, ", +", out_bytes, ") overlaps the input [", in, ", +",
                  in_bytes, ") other than in the in-place layout (input at ", in_place_in, ")");
}

size_t reduce_scatter_recv_count(size_t total_count, int world_size) {
  TDIST_CHECK_ARG(world_size > 0, "world_size", "must be positive, got ", world_size);
  TDIST_CHECK_ARG(total_count % static_cast<size_t>(world_size) == 0, "count", "reduce_scatter input of ", total_count,
                  " elements does not divide into ", world_size, " equal slices");
  return total_count / static_cast<size_t>(world_size);
}

bool check_symmetric_range(const char* what, const void* p, size_t bytes, const void* heap_base, size_t heap_size) {
  const auto a = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(heap_base);
  const bool starts_inside = a >= base && a < base + heap_size;
  if (!starts_inside) {
    if (a < base && a + bytes > base)
      detail::throw_at(__FILE__, __LINE__, "invalid argument '", what, "': the buffer [", p, ", +", bytes,
                       ") runs into the symmetric heap; pass a buffer wholly inside or wholly outside it");
    return false;
  }
  if (a + bytes > base + heap_size) {
    detail::throw_at(__FILE__, __LINE__, "invalid argument '", what, "': the buffer [", p, ", +", bytes,
                     ") starts inside the symmetric heap but runs ", a + bytes - (base + heap_size),
                     " bytes past its end");
  }
  return true;
}

}  // namespace tdist
