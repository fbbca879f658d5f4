// The expert-parallel all-to-all without a GPU: the configuration checks name the field at fault,
// the symmetric layout's size follows the formula of kernels/ep/ll.cuh (and grows with each
// dimension), and the low-latency kernels compile for sm_90a through NVRTC without spills.
#include <gtest/gtest.h>

#include <string>

#include "cpu/errors.hpp"
#include "cpu/jit_programs.hpp"
#include "tdist/kernels/ep/ll.cuh"
#include "tdist/ops/ep.hpp"

using tdist::EpConfig;
using tdist::test::expect_arg_error;

namespace {

EpConfig deepseek() { return EpConfig{.max_tokens = 128, .hidden = 7168, .num_experts = 256, .topk = 8}; }

// The bytes the layout needs before alignment, region by region (ll.cuh's table).
size_t formula_bytes(const EpConfig& c, size_t w) {
  const size_t L = static_cast<size_t>(c.num_experts) / w, M = static_cast<size_t>(c.max_tokens);
  const size_t H = static_cast<size_t>(c.hidden), K = static_cast<size_t>(c.topk), G = (H + 127) / 128;
  const size_t d_slots = 2 * L * w * M, c_slots = 2 * M * K;
  return d_slots * 2 * H + d_slots * G * 4 + d_slots * 4 + 2 * L * w * 8 + static_cast<size_t>(c.num_experts) * 8 +
         c_slots * 2 * H + c_slots * 8 + w * 8;
}

}  // namespace

TEST(Ep, ConfigErrorsNameTheField) {
  EXPECT_NO_THROW(tdist::check_ep_config(deepseek(), 2));
  EXPECT_NO_THROW(tdist::check_ep_config(deepseek(), 8));
  auto with = [](auto change) {
    EpConfig c = deepseek();
    change(c);
    return c;
  };
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.max_tokens = 0; }), 2); },
                   "config.max_tokens");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.hidden = 7170; }), 2); }, "config.hidden");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.hidden = 0; }), 2); }, "config.hidden");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.num_experts = 255; }), 2); },
                   "config.num_experts");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.num_experts = 6; }), 8); },
                   "config.num_experts");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.topk = 0; }), 2); }, "config.topk");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.topk = 33; }), 2); }, "config.topk");
  expect_arg_error(
      [&] {
        tdist::check_ep_config(with([](EpConfig& c) {
                                 c.num_experts = 4;
                                 c.topk = 5;
                               }),
                               2);
      },
      "config.topk");
  expect_arg_error([&] { tdist::check_ep_config(with([](EpConfig& c) { c.num_sms = -1; }), 2); }, "config.num_sms");
  expect_arg_error([&] { tdist::check_ep_config(deepseek(), 0); }, "world_size");
  expect_arg_error([&] { tdist::check_ep_config(deepseek(), 1000); }, "world_size");
  expect_arg_error([&] { tdist::ep_heap_bytes(with([](EpConfig& c) { c.hidden = 12; }), 2); }, "config.hidden");
}

TEST(Ep, HeapBytesFollowTheLayout) {
  for (int w : {1, 2, 4, 8}) {
    for (EpConfig c : {deepseek(), EpConfig{.max_tokens = 3, .hidden = 200, .num_experts = 24, .topk = 3}}) {
      SCOPED_TRACE(w);
      const size_t bytes = tdist::ep_heap_bytes(c, w), want = formula_bytes(c, static_cast<size_t>(w));
      EXPECT_GE(bytes, want);
      EXPECT_LE(bytes, want + 8 * 256 + 256);  // at most one alignment gap per region, then rounding
      EXPECT_EQ(bytes % 256, 0u);
      EpConfig more = c;
      more.max_tokens += 1;
      EXPECT_GT(tdist::ep_heap_bytes(more, w), bytes - 256);
      more = c;
      more.hidden += 8;
      EXPECT_GT(tdist::ep_heap_bytes(more, w), bytes);
    }
  }
  // DeepSeek-V3 decode on 2 ranks: dispatch rows (2 parities x 128 experts x 2 ranks x 128 slots x
  // 14 KiB) and combine rows (2 parities x 128 tokens x 8 slots x 14 KiB), about 984 MB.
  EXPECT_NEAR(static_cast<double>(tdist::ep_heap_bytes(deepseek(), 2)),
              2.0 * 128 * 2 * 128 * (2 * 7168 + 4 * 56 + 4) + 2.0 * 128 * 8 * 2 * 7168, 1.0e6);
}

TEST(Ep, TokenCountsFollowTheSlotRule) {
  // 2 ranks, 8 experts (4 per rank), top-3.
  const std::vector<int64_t> idx = {
      0, 1, 5,    // rank 0 twice, rank 1 once
      7, -1, 6,   // a masked slot; rank 1 twice
      2, 2, 3,    // a repeat (skipped); rank 0
      -1, -1, -1, // all masked: no rank
      9, -5, 4,   // out of range twice (skipped); rank 1
  };
  const tdist::EpTokenCounts c = tdist::ep_count_tokens(idx.data(), 5, 3, 8, 2);
  EXPECT_EQ(c.tokens_per_rank, (std::vector<int>{2, 3}));
  EXPECT_EQ(c.rows_per_expert, (std::vector<int>{1, 1, 1, 1, 1, 1, 1, 1}));
  const tdist::EpTokenCounts none = tdist::ep_count_tokens(nullptr, 0, 3, 8, 2);
  EXPECT_EQ(none.tokens_per_rank, (std::vector<int>{0, 0}));
  expect_arg_error([&] { tdist::ep_count_tokens(idx.data(), 5, 3, 7, 2); }, "num_experts");
  expect_arg_error([&] { tdist::ep_count_tokens(nullptr, 5, 3, 8, 2); }, "topk_idx");
  // Padding to the alignment.
  EXPECT_EQ(tdist::ep_expert_offsets({3, 0, 5, 1}, 4), (std::vector<int>{0, 4, 4, 12, 16}));
  EXPECT_EQ(tdist::ep_expert_offsets({3, 0, 5}, 1), (std::vector<int>{0, 3, 3, 8}));
  expect_arg_error([&] { tdist::ep_expert_offsets({1}, 0); }, "alignment");
}

TEST(Ep, HighThroughputLayout) {
  EpConfig c = deepseek();
  c.mode = tdist::EpMode::kHighThroughput;
  c.max_tokens = 4096;
  // counts, then for R = W M rows: 2H (compact) + 4 (source) + 12 K (ids, weights, rows) + 2H (combine)
  const size_t W = 2, R = W * 4096;
  const size_t want = 2 * W * (W + 256) * 8 + R * (2 * 7168 + 4 + 12 * 8 + 2 * 7168) + 3 * W * 8;
  const size_t bytes = tdist::ep_heap_bytes(c, 2);
  EXPECT_GE(bytes, want);
  EXPECT_LE(bytes, want + 12 * 256);
  expect_arg_error(
      [&] {
        EpConfig b = c;
        b.expert_alignment = 0;
        tdist::check_ep_config(b, 2);
      },
      "config.expert_alignment");
}

TEST(Ep, ScaleGroups) {
  EXPECT_EQ(tdist::kernels::ep::scale_groups(128), 1);
  EXPECT_EQ(tdist::kernels::ep::scale_groups(7168), 56);
  EXPECT_EQ(tdist::kernels::ep::scale_groups(200), 2);
}

TEST(Ep, KernelsCompileForSm90a) {
  EXPECT_EQ(tdist::test::compile_family_for_sm90a("ep"), 2);  // low latency, high throughput
}
