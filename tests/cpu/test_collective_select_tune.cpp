// The timed choice of the collectives without a GPU: the size buckets, the class key, the
// candidates each shape admits (feasibility), and the rules that leave a call to the table.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu/collective_shapes.hpp"
#include "tdist/ops/detail/collective_select.hpp"

using namespace tdist;

namespace {

using test::KiB;
using test::kLimits;
using test::MiB;
using test::shape;

template <typename M>
unsigned bits(std::initializer_list<M> ms) {
  unsigned b = 0;
  for (M m : ms) b |= 1u << static_cast<int>(m);
  return b;
}

}  // namespace

TEST(CollectiveTune, BucketIsMonotoneAndFourPerOctave) {
  int prev = size_bucket(0);
  EXPECT_EQ(prev, 0);
  for (size_t b = 1; b < 70000; ++b) {
    const int k = size_bucket(b);
    ASSERT_GE(k, prev) << b;
    ASSERT_LE(k, prev + 1 + (b == 4 ? 4 : 0)) << b;  // 4 to 7 are the only empty buckets
    prev = k;
  }
  // Powers of two start a bucket; each octave from 8 bytes on holds exactly four.
  for (int e = 3; e < 63; ++e) {
    const size_t p = size_t{1} << e;
    EXPECT_EQ(size_bucket(p), 4 * e) << e;
    EXPECT_EQ(size_bucket(p - 1), 4 * e - 1) << e;
    EXPECT_EQ(size_bucket(2 * p - 1), 4 * e + 3) << e;
  }
  EXPECT_EQ(size_bucket(SIZE_MAX), 4 * 63 + 3);
  // Random sizes: the bucket's bounds hold the size, and are within a factor 1.25 of each other
  // from 8 bytes on.
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 20000; ++i) {
    const size_t b = (rng() >> (rng() % 60)) + 1;
    const int k = size_bucket(b);
    ASSERT_LE(size_bucket_lower(k), b) << b;
    ASSERT_GT(size_bucket_upper(k), b) << b;
    ASSERT_EQ(size_bucket(size_bucket_lower(k)), k) << b;
    if (b >= 8) ASSERT_LE(static_cast<double>(size_bucket_upper(k)) / size_bucket_lower(k), 1.25 + 1e-12) << b;
  }
  EXPECT_EQ(size_bucket_upper(4 * 63 + 3), SIZE_MAX);
}

TEST(CollectiveTune, NeighboursShareABucketThresholdsSplit) {
  // Sizes between the powers of two near 100 MB get their own classes, apart from 64 and 128 MB.
  const int b100 = size_bucket(100 * MiB);
  EXPECT_EQ(size_bucket(100 * MiB + 4096), b100);
  EXPECT_EQ(size_bucket(100 * MiB - 4096), b100);
  EXPECT_NE(size_bucket(64 * MiB), b100);
  EXPECT_NE(size_bucket(128 * MiB), b100);
  // A per-rank part off 16 bytes next to an aligned one: same bucket, the class tells them apart.
  EXPECT_EQ(size_bucket(2 * (3 * MiB + 2)), size_bucket(2 * 3 * MiB));
  const CollectiveClass a = collective_class(CollectiveOp::kReduceScatter, shape(6 * MiB), false, 0xf);
  const CollectiveClass u =
      collective_class(CollectiveOp::kReduceScatter, shape(6 * MiB + 4, 2, false, false, false), false, 0xf);
  EXPECT_EQ(a.bucket, u.bucket);
  EXPECT_NE(class_key(a), class_key(u));
  // The table's thresholds (powers of two) are bucket bounds: one side's sizes never share a class
  // with the other's.
  for (size_t t : {64 * KiB, 1 * MiB, 32 * MiB, 128 * MiB, 256 * MiB})
    EXPECT_EQ(size_bucket(t - 1) + 1, size_bucket(t)) << t;
}

TEST(CollectiveTune, ClassKeyTellsEveryFieldApart) {
  CollectiveClass base;
  base.op = CollectiveOp::kAllGather;
  base.dtype = DType::kFloat16;
  base.world_size = 8;
  base.bucket = size_bucket(3 * MiB);
  base.candidates = 0x2a;
  std::vector<CollectiveClass> variants(10, base);
  variants[1].op = CollectiveOp::kReduceScatter;
  variants[2].dtype = DType::kFloat32;
  variants[3].world_size = 4;
  variants[4].in_symmetric = true;
  variants[5].out_symmetric = true;
  variants[6].in_place = true;
  variants[7].aligned16 = false;
  variants[8].bucket += 1;
  variants[9].candidates = 0x28;
  std::set<uint64_t> keys;
  for (const auto& v : variants) {
    const uint64_t k = class_key(v);
    EXPECT_LT(k, uint64_t{1} << 53);  // exact as a double
    EXPECT_EQ(static_cast<uint64_t>(static_cast<double>(k)), k);
    keys.insert(k);
  }
  EXPECT_EQ(keys.size(), variants.size());
  // The largest fields still fit.
  CollectiveClass big = base;
  big.world_size = 65535;
  big.bucket = size_bucket(SIZE_MAX);
  big.candidates = 0xff;
  EXPECT_LT(class_key(big), uint64_t{1} << 53);
  const std::string d = describe(variants[6]);
  EXPECT_NE(d.find("all_gather f16 ranks=8"), std::string::npos) << d;
  EXPECT_NE(d.find("in-place"), std::string::npos) << d;
  EXPECT_NE(d.find("bytes=[3145728,3670016)"), std::string::npos) << d;
  EXPECT_NE(d.find("candidates=sm,ce_pull,nccl"), std::string::npos) << d;  // bits 1, 3, 5
}

TEST(CollectiveTune, CandidatesAreTheFeasibleMethodsAndNccl) {
  using AR = AllReduceMethod;
  using AG = AllGatherMethod;
  using RS = ReduceScatterMethod;
  // Small AllReduce: every method (ce: 4 KB of bf16 splits over 2 ranks).
  EXPECT_EQ(all_reduce_candidates(shape(4 * KiB), kLimits),
            bits({AR::kOneShot, AR::kTwoShot, AR::kLowLatency, AR::kLowLatency128, AR::kNccl, AR::kCe}));
  // An odd element count over 2 ranks: no ce.
  EXPECT_EQ(all_reduce_candidates(shape(4 * KiB + 2), kLimits),
            bits({AR::kOneShot, AR::kTwoShot, AR::kLowLatency, AR::kLowLatency128, AR::kNccl}));
  // Past the LL buffer, then past LL128's.
  EXPECT_EQ(all_reduce_candidates(shape(512 * KiB), kLimits),
            bits({AR::kOneShot, AR::kTwoShot, AR::kLowLatency128, AR::kNccl, AR::kCe}));
  EXPECT_EQ(all_reduce_candidates(shape(100 * MiB), kLimits), bits({AR::kOneShot, AR::kTwoShot, AR::kNccl, AR::kCe}));
  // Beyond the workspace: NCCL alone.
  EXPECT_EQ(all_reduce_candidates(shape(512 * MiB), kLimits), bits({AR::kNccl}));
  // AllGather: sm_push only into a symmetric output; ordinary buffers stage through the workspace.
  EXPECT_EQ(all_gather_candidates(shape(4 * MiB), kLimits), bits({AG::kSm, AG::kCePush, AG::kCePull, AG::kNccl}));
  EXPECT_EQ(all_gather_candidates(shape(4 * MiB, 2, false, true), kLimits),
            bits({AG::kSm, AG::kCePush, AG::kCePull, AG::kNccl, AG::kSmPush}));
  EXPECT_EQ(all_gather_candidates(shape(64 * KiB), kLimits),
            bits({AG::kSm, AG::kCePush, AG::kCePull, AG::kLowLatency, AG::kNccl}));
  EXPECT_EQ(all_gather_candidates(shape(512 * MiB), kLimits), bits({AG::kSm, AG::kCePull, AG::kNccl}));
  EXPECT_EQ(all_gather_candidates(shape(512 * MiB, 2, true, true), kLimits),
            bits({AG::kSm, AG::kCePush, AG::kCePull, AG::kNccl, AG::kSmPush}));
  // ReduceScatter: LL while the per-rank part fits its buffer (8 ranks: 2 MB in, 256 KB each).
  EXPECT_EQ(reduce_scatter_candidates(shape(3 * MiB + 6), kLimits), bits({RS::kFused, RS::kCe, RS::kNccl}));
  EXPECT_EQ(reduce_scatter_candidates(shape(2 * MiB, 8), kLimits),
            bits({RS::kFused, RS::kCe, RS::kLowLatency, RS::kNccl}));
  EXPECT_EQ(reduce_scatter_candidates(shape(512 * MiB, 2, true, false), kLimits), bits({RS::kFused, RS::kNccl}));
  // Every candidate is feasible, and every feasible method is a candidate.
  for (size_t bytes : {size_t{2}, 6 * KiB + 2, 300 * KiB, 3 * MiB, 300 * MiB})
    for (int n : {2, 3, 8})
      for (bool in_sym : {false, true})
        for (bool out_sym : {false, true}) {
          const CollectiveShape s = shape(bytes, n, in_sym, out_sym);
          const unsigned ar = all_reduce_candidates(s, kLimits), ag = all_gather_candidates(s, kLimits),
                         rs = reduce_scatter_candidates(s, kLimits);
          for (int m = 1; m <= 6; ++m) EXPECT_EQ((ar >> m) & 1u, feasible(static_cast<AR>(m), s, kLimits) ? 1u : 0u);
          for (int m = 1; m <= 6; ++m) EXPECT_EQ((ag >> m) & 1u, feasible(static_cast<AG>(m), s, kLimits) ? 1u : 0u);
          for (int m = 1; m <= 4; ++m) EXPECT_EQ((rs >> m) & 1u, feasible(static_cast<RS>(m), s, kLimits) ? 1u : 0u);
          EXPECT_EQ(ar & 1u, 0u);  // never auto
          EXPECT_TRUE(ar >> static_cast<int>(AR::kNccl) & 1u);
          EXPECT_TRUE(ag >> static_cast<int>(AG::kNccl) & 1u);
          EXPECT_TRUE(rs >> static_cast<int>(RS::kNccl) & 1u);
          // The table's pick is always among them.
          EXPECT_TRUE(ar >> static_cast<int>(select_all_reduce(s, kLimits)) & 1u);
          EXPECT_TRUE(ag >> static_cast<int>(select_all_gather(s, kLimits)) & 1u);
          EXPECT_TRUE(rs >> static_cast<int>(select_reduce_scatter(s, kLimits)) & 1u);
        }
  EXPECT_EQ(candidate_list(bits({AR::kTwoShot, AR::kNccl})), (std::vector<int>{2, 5}));
  EXPECT_STREQ(method_name(CollectiveOp::kAllGather, static_cast<int>(AG::kCePull)), "ce_pull");
  EXPECT_STREQ(method_name(CollectiveOp::kReduceScatter, static_cast<int>(RS::kFused)), "fused");
}

TEST(CollectiveTune, FallbackRules) {
  const CollectiveShape s = shape(3 * MiB);
  const unsigned many = all_reduce_candidates(s, kLimits);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, s, many, false), TuneSkip::kNone);
  EXPECT_EQ(tune_skip_reason(true, "", true, s, many, false), TuneSkip::kNone);
  EXPECT_EQ(tune_skip_reason(true, "AUTO", true, s, many, false), TuneSkip::kNone);  // auto leaves it to auto
  // An explicit method: neither timed nor looked up, even under capture.
  EXPECT_EQ(tune_skip_reason(false, nullptr, true, s, many, false), TuneSkip::kExplicitMethod);
  EXPECT_EQ(tune_skip_reason(false, "nccl", true, s, many, true), TuneSkip::kExplicitMethod);
  EXPECT_EQ(tune_skip_reason(true, "one_shot", true, s, many, false), TuneSkip::kEnvMethod);
  EXPECT_EQ(tune_skip_reason(true, "bogus", true, s, many, false), TuneSkip::kEnvMethod);  // resolve names the error
  EXPECT_EQ(tune_skip_reason(true, nullptr, false, s, many, false), TuneSkip::kTuningOff);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, shape(3 * MiB, 1), many, false), TuneSkip::kSingleRank);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, shape(kCollectiveTuneMaxBytes), many, false), TuneSkip::kNone);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, shape(kCollectiveTuneMaxBytes + 2), many, false),
            TuneSkip::kTooLarge);
  const unsigned nccl_only = 1u << static_cast<int>(AllReduceMethod::kNccl);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, s, nccl_only, false), TuneSkip::kOneCandidate);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, s, 0, false), TuneSkip::kOneCandidate);
  EXPECT_EQ(tune_skip_reason(true, nullptr, true, s, many, true), TuneSkip::kCapturing);
  EXPECT_STREQ(to_string(TuneSkip::kCapturing), "a stream under graph capture");
}

TEST(CollectiveTune, CallsPerTimedLaunch) {
  EXPECT_EQ(tune_calls_per_launch(1), 16);
  EXPECT_EQ(tune_calls_per_launch(1 * MiB), 16);
  EXPECT_EQ(tune_calls_per_launch(2 * MiB), 8);
  EXPECT_EQ(tune_calls_per_launch(16 * MiB), 1);
  EXPECT_EQ(tune_calls_per_launch(kCollectiveTuneMaxBytes), 1);
  for (size_t b = 1; b < 64 * MiB; b = b * 3 + 1) EXPECT_GE(tune_calls_per_launch(b), tune_calls_per_launch(b * 3 + 1));
}
