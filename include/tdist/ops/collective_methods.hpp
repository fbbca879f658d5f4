// The collectives' method names (user API): what Collectives' calls take, their names as
// strings, and the environment variables that override the automatic choice. The choice itself
// and the argument checks are in ops/detail/collective_select.hpp.
#pragma once

#include <string>

#include "tdist/common/dtype.hpp"

namespace tdist {

enum class AllReduceMethod { kAuto, kOneShot, kTwoShot, kLowLatency, kLowLatency128, kNccl, kCe };
enum class AllGatherMethod { kAuto, kSm, kCePush, kCePull, kLowLatency, kNccl, kSmPush };
enum class ReduceScatterMethod { kAuto, kFused, kCe, kLowLatency, kNccl };

// Names: auto, one_shot, two_shot, ll, ll128, nccl, ce | auto, sm, sm_push, ce_push, ce_pull, ll, nccl |
// auto, fused, ce, ll, nccl.
const char* to_string(AllReduceMethod m);
const char* to_string(AllGatherMethod m);
const char* to_string(ReduceScatterMethod m);
// Throw tdist::Error naming `what` (an argument or an environment variable) and the accepted names.
AllReduceMethod parse_all_reduce_method(const std::string& s, const std::string& what = "method");
AllGatherMethod parse_all_gather_method(const std::string& s, const std::string& what = "method");
ReduceScatterMethod parse_reduce_scatter_method(const std::string& s, const std::string& what = "method");

// Environment variables that override the automatic choice (a per-call method other than auto wins).
constexpr const char* kAllReduceMethodEnv = "TDIST_ALLREDUCE_METHOD";
constexpr const char* kAllGatherMethodEnv = "TDIST_ALLGATHER_METHOD";
constexpr const char* kReduceScatterMethodEnv = "TDIST_REDUCESCATTER_METHOD";
// 0: `auto` takes the method table for every call instead of timing each size class at its first
// call (docs/collectives.md, "Tuning"). Default 1; every rank must set it alike.
constexpr const char* kCollectiveTuneEnv = "TDIST_COLLECTIVE_TUNE";

}  // namespace tdist
