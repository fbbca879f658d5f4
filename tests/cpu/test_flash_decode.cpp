// Decode attention without a GPU: the host argument checks (each error names its argument), the
// split model, and the kernels compiling through NVRTC for sm_90a without spills.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "tdist/common/error.hpp"
#include "tdist/jit/jit.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/attention/flash_decode.cuh"
#include "tdist/ops/flash_decode.hpp"

using namespace tdist;

namespace {

// Fake, aligned device addresses: the checks never dereference them.
void* fake(uintptr_t a) { return reinterpret_cast<void*>(a); }

FlashDecodeArgs valid_paged() {
  FlashDecodeArgs a;
  a.dtype = DType::kBFloat16;
  a.batch = 3;
  a.q_heads = 32;
  a.kv_heads = 8;
  a.head_dim = 128;
  a.q = fake(0x10000);
  a.k_cache = fake(0x20000);
  a.v_cache = fake(0x30000);
  a.num_pages = 100;
  a.page_size = 16;
  a.block_table = static_cast<const int32_t*>(fake(0x40000));
  a.max_pages = 10;
  a.seq_lens = static_cast<const int32_t*>(fake(0x50000));
  a.out = fake(0x60000);
  a.softmax_scale = 0.0883883f;
  return a;
}

void expect_names(const char* arg, const FlashDecodeArgs& a) {
  try {
    check_flash_decode_args(a);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::string("'") + arg + "'"), std::string::npos)
        << "the error does not name '" << arg << "': " << e.what();
    return;
  }
  ADD_FAILURE() << "expected an error naming '" << arg << "'";
}

}  // namespace

TEST(FlashDecodeArgs, ValidPagedAndContiguousPass) {
  EXPECT_NO_THROW(check_flash_decode_args(valid_paged()));
  FlashDecodeArgs c = valid_paged();
  c.block_table = nullptr;
  c.max_pages = 0;
  c.num_pages = c.batch;
  c.page_size = 100000;  // contiguous: the capacity, not limited to 256
  EXPECT_NO_THROW(check_flash_decode_args(c));
  EXPECT_EQ(flash_decode_capacity(c), 100000);
  EXPECT_EQ(flash_decode_capacity(valid_paged()), 160);
  FlashDecodeArgs combined = valid_paged();  // FlashInfer's [pages][2][page][heads][dim]: K and V pages interleaved
  combined.page_stride = 2 * 16 * 8 * 128;
  EXPECT_NO_THROW(check_flash_decode_args(combined));
  c.page_stride = 100000 * 8 * 128 + 8;  // a sequence row with padding after it
  EXPECT_NO_THROW(check_flash_decode_args(c));
}

TEST(FlashDecodeArgs, ErrorsNameTheArgument) {
  auto with = [](auto change) {
    FlashDecodeArgs a = valid_paged();
    change(a);
    return a;
  };
  expect_names("dtype", with([](FlashDecodeArgs& a) { a.dtype = DType::kFloat32; }));
  expect_names("q_heads", with([](FlashDecodeArgs& a) { a.q_heads = 30; }));  // not a multiple of 8 KV heads
  expect_names("kv_heads", with([](FlashDecodeArgs& a) { a.kv_heads = 0; }));
  expect_names("head_dim", with([](FlashDecodeArgs& a) { a.head_dim = 96; }));
  expect_names("batch", with([](FlashDecodeArgs& a) { a.batch = 0; }));
  expect_names("q", with([](FlashDecodeArgs& a) { a.q = fake(0x10008); }));  // 8-byte aligned only
  expect_names("k_cache", with([](FlashDecodeArgs& a) { a.k_cache = nullptr; }));
  expect_names("v_cache", with([](FlashDecodeArgs& a) { a.v_cache = fake(0x30002); }));
  expect_names("out", with([](FlashDecodeArgs& a) { a.out = nullptr; }));
  expect_names("seq_lens", with([](FlashDecodeArgs& a) { a.seq_lens = nullptr; }));
  expect_names("page_size", with([](FlashDecodeArgs& a) { a.page_size = 257; }));
  expect_names("page_size", with([](FlashDecodeArgs& a) { a.page_size = 0; }));
  expect_names("max_pages", with([](FlashDecodeArgs& a) { a.max_pages = 0; }));
  expect_names("num_pages", with([](FlashDecodeArgs& a) { a.num_pages = 0; }));
  expect_names("num_pages", with([](FlashDecodeArgs& a) {  // contiguous: one row per sequence
                 a.block_table = nullptr;
                 a.num_pages = 4;
               }));
  expect_names("max_seq_len", with([](FlashDecodeArgs& a) { a.max_seq_len = 161; }));  // beyond 10 x 16
  expect_names("softmax_scale", with([](FlashDecodeArgs& a) { a.softmax_scale = 0.f; }));
  expect_names("softcap", with([](FlashDecodeArgs& a) { a.softcap = -1.f; }));
  expect_names("page_stride", with([](FlashDecodeArgs& a) { a.page_stride = 16 * 8 * 128 - 8; }));  // pages overlap
  expect_names("page_stride", with([](FlashDecodeArgs& a) { a.page_stride = 16 * 8 * 128 + 4; }));  // 8-byte aligned
  expect_names("page_stride", with([](FlashDecodeArgs& a) { a.page_stride = -16 * 8 * 128; }));
  expect_names("page_stride", with([](FlashDecodeArgs& a) { a.page_stride = int64_t{1} << 47; }));  // x 100 pages
}

TEST(FlashDecodeSplitPlan, FillsTheGpuFromTheLengthAndSmCount) {
  using M = FlashDecodeSplitModel;
  // Llama-3-8B (32 / 8 heads), batch 1, 128K tokens, 132 SMs, 2 CTAs per SM: GQA 4 in one CTA, 8 KV
  // heads x 32 splits in one wave of 264 (33 would cut pieces of 4032: the same bytes, one more
  // merge round).
  FlashDecodeSplitPlan p = plan_flash_decode(1, 32, 8, 128, 131072, 132);
  EXPECT_EQ(p.heads_per_cta, 4);
  EXPECT_EQ(p.head_chunks, 1);
  EXPECT_EQ(p.num_splits, 32);
  // Another SM count scales the splits: no table, a model.
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 131072, 78).num_splits, 19);  // 152 CTAs of 156
  // Short sequences: pieces down to one step (64 tokens), in one merge round (16 splits at head dim
  // 128) until a second round buys more than it costs.
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 1000, 132).num_splits, 16);
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 200, 132).num_splits, 4);
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 4096, 132).num_splits, 16);
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 6144, 132).num_splits, 32);  // 33 pieces of 187 round up to 192
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 32768, 132).num_splits, 32);
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 64, 131072, 132, 3).num_splits, 49);  // 392 of 396
  for (int64_t len : {1, 63, 64, 65, 255, 256, 257, 1000, 4096, 32768, 131071, 131072, 1 << 20}) {
    const int64_t splits = plan_flash_decode(1, 32, 8, 128, len, 132).num_splits;
    const int64_t per = ((len + splits - 1) / splits + M::kTokensPerStep - 1) / M::kTokensPerStep * M::kTokensPerStep;
    EXPECT_GT(len, (splits - 1) * per) << "len " << len << ": split " << splits - 1 << " would be empty";
  }
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 1, 132).num_splits, 1);
  EXPECT_EQ(plan_flash_decode(1, 32, 8, 128, 0, 132).num_splits, 1);
  // A big batch fills the GPU by itself: 256 CTAs of 264, or two whole waves.
  EXPECT_EQ(plan_flash_decode(32, 64, 8, 128, 131072, 132).num_splits, 1);
  EXPECT_EQ(plan_flash_decode(64, 32, 8, 128, 4096, 132).num_splits, 1);
  // GQA ratios: the largest divisor up to 16 (the MMA's rows), the rest as chunks.
  p = plan_flash_decode(2, 64, 8, 128, 4096, 132);
  EXPECT_EQ(p.heads_per_cta, 8);
  EXPECT_EQ(p.head_chunks, 1);
  p = plan_flash_decode(2, 48, 8, 128, 4096, 132);  // group 6
  EXPECT_EQ(p.heads_per_cta, 6);
  EXPECT_EQ(p.head_chunks, 1);
  p = plan_flash_decode(2, 128, 8, 128, 4096, 132);  // group 16
  EXPECT_EQ(p.heads_per_cta, 16);
  EXPECT_EQ(p.head_chunks, 1);
  p = plan_flash_decode(1, 256, 8, 128, 4096, 132);  // group 32
  EXPECT_EQ(p.heads_per_cta, 16);
  EXPECT_EQ(p.head_chunks, 2);
  p = plan_flash_decode(1, 34, 1, 128, 4096, 132);  // group 34 = 2 x 17
  EXPECT_EQ(p.heads_per_cta, 2);
  EXPECT_EQ(p.head_chunks, 17);
  p = plan_flash_decode(2, 7, 7, 128, 4096, 132);  // MHA
  EXPECT_EQ(p.heads_per_cta, 1);
  // Never more than kMaxSplits.
  EXPECT_EQ(plan_flash_decode(1, 1, 1, 128, int64_t{1} << 30, 100000).num_splits, M::kMaxSplits);
  EXPECT_THROW(plan_flash_decode(1, 30, 8, 128, 100, 132), Error);
  EXPECT_THROW(plan_flash_decode(1, 32, 8, 128, 100, 0), Error);
  EXPECT_THROW(plan_flash_decode(1, 32, 8, 96, 100, 132), Error);
}

// A grid a little past one wave: the CTAs past it would run in a second wave at a lone CTA's rate
// (Llama-3-8B, batch 36 at 3968 tokens, 288 CTAs: 1 split took 194-200 us on an H200, 4 to 8 splits
// 147-151 us); cut in more pieces, the waves fill.
TEST(FlashDecodeSplitPlan, SplitsWhereTheGridSpillsPastAWave) {
  const FlashDecodeSplitPlan p = plan_flash_decode(36, 32, 8, 128, 3968, 132);
  EXPECT_GE(p.num_splits, 4);
  EXPECT_LE(p.num_splits, 8);
  EXPECT_LT(flash_decode_estimate_us(288, 128, 3968, p.num_splits, 132, 2),
            0.8 * flash_decode_estimate_us(288, 128, 3968, 1, 132, 2));
  // Fewer CTAs than SMs: each alone on its SM, below the bandwidth; a third split fills them
  // (batch 17 at 16K tokens, 136 CTAs: 379 us in 1 split, 382 in 2 (8 CTAs past the wave), 294 in 3).
  EXPECT_GE(plan_flash_decode(17, 32, 8, 128, 16384, 132).num_splits, 3);
  // Llama-3-70B heads (8 per CTA), batch 41 at 3K tokens: 328 CTAs.
  EXPECT_GT(plan_flash_decode(41, 64, 8, 128, 3072, 132).num_splits, 1);
}

// The plan is the model's lowest estimate over every split count, the fewest splits among equals.
TEST(FlashDecodeSplitPlan, IsTheLowestEstimate) {
  using M = FlashDecodeSplitModel;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto next = [&](uint64_t n) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<int64_t>(x % n);
  };
  for (int i = 0; i < 300; ++i) {
    const int64_t batch = 1 + next(96), kv_heads = int64_t{1} << next(4), group = 1 + next(8);
    const int64_t d = int64_t{64} << next(3), len = next(2) ? 1 + next(300000) : next(5000);
    const int sms = static_cast<int>(16 + next(140)), per_sm = static_cast<int>(1 + next(3));
    const FlashDecodeSplitPlan p = plan_flash_decode(batch, kv_heads * group, kv_heads, d, len, sms, per_sm);
    const int64_t groups = batch * kv_heads * p.head_chunks;
    const double chosen = flash_decode_estimate_us(groups, d, len, p.num_splits, sms, per_sm);
    ASSERT_GE(p.num_splits, 1);
    ASSERT_LE(p.num_splits, M::kMaxSplits);
    ASSERT_EQ(flash_decode_nonempty_splits(len, p.num_splits), p.num_splits);
    for (int64_t s = 1; s <= M::kMaxSplits; ++s) {
      const double other = flash_decode_estimate_us(groups, d, len, s, sms, per_sm);
      ASSERT_GE(other, chosen) << "batch " << batch << " len " << len << " d " << d << ": " << s << " splits beat "
                               << p.num_splits;
      if (flash_decode_nonempty_splits(len, s) < p.num_splits) ASSERT_GT(other, chosen);
    }
  }
}

TEST(FlashDecodeSplitPlan, EstimateGrowsWithTheBytes) {
  for (int64_t groups : {8, 64, 288}) {
    double last = 0.0;
    for (int64_t len = 64; len <= (1 << 20); len *= 4) {
      const double us = flash_decode_estimate_us(groups, 128, len, 1, 132, 2);
      EXPECT_GT(us, last);
      last = us;
    }
  }
  // A second wave of a few CTAs costs about as much as a whole one of its length (lone CTAs).
  const double one_wave = flash_decode_estimate_us(264, 128, 8192, 1, 132, 2);
  const double spilled = flash_decode_estimate_us(288, 128, 8192, 1, 132, 2);
  EXPECT_GT(spilled, 1.4 * one_wave);
}

TEST(FlashDecodeSplitPlan, OneWaveOfWhatFitsOnTheGpu) {
  // 3 CTAs per SM resident: 8 KV heads x 48 splits <= 396.
  FlashDecodeSplitPlan p = plan_flash_decode(1, 32, 8, 128, 131072, 132, 3);
  EXPECT_EQ(p.num_splits, 48);
  EXPECT_EQ(plan_flash_decode(4, 64, 8, 128, 131072, 132, 2).num_splits, 8);  // 32 CTAs x 8 <= 264
  EXPECT_THROW(plan_flash_decode(1, 32, 8, 128, 100, 132, 0), Error);
  EXPECT_EQ(flash_decode_heads_per_cta(4), 4);
  EXPECT_EQ(flash_decode_heads_per_cta(6), 6);
  EXPECT_EQ(flash_decode_heads_per_cta(24), 12);
  EXPECT_EQ(flash_decode_heads_per_cta(7), 7);
  EXPECT_EQ(flash_decode_heads_per_cta(17), 1);
}

TEST(FlashDecodeSplitPlan, ResidentCtasFromRegistersAndSharedMemory) {
  const SmLimits h100;  // Hopper: 64K registers, 2048 threads, 32 CTAs, 228 KB shared, 1 KB reserved per CTA
  EXPECT_EQ(resident_ctas_per_sm(158, 128, 8320, h100), 3);   // 160 x 32 x 4 = 20480 registers per CTA
  EXPECT_EQ(resident_ctas_per_sm(211, 128, 16640, h100), 2);  // 216 x 32 x 4 = 27648
  EXPECT_EQ(resident_ctas_per_sm(101, 128, 4160, h100), 4);   // 104 x 32 x 4 = 13312
  EXPECT_EQ(resident_ctas_per_sm(72, 128, 2080, h100), 7);    // 72 x 32 x 4 = 9216
  EXPECT_EQ(resident_ctas_per_sm(32, 128, 100000, h100), 2);  // shared memory bound
  EXPECT_EQ(resident_ctas_per_sm(16, 1024, 0, h100), 2);      // thread bound
  EXPECT_EQ(resident_ctas_per_sm(8, 32, 0, h100), 32);        // CTA bound
  EXPECT_EQ(resident_ctas_per_sm(255, 1024, 0, h100), 1);     // never below one
  EXPECT_THROW(resident_ctas_per_sm(0, 128, 0, h100), Error);
}

TEST(FlashDecodeKernels, CompileForSm90aWithoutSpills) {
  bool found = false;
  for (const auto& family : jit::registered_kernels()) {
    if (family.name != "flash_decode") continue;
    found = true;
    const auto requests = family.requests();
    EXPECT_EQ(requests.size(), 6u);  // bf16 / fp16 x head dim 64, 128, 256
    for (auto r : requests) {
      r.arch = "sm_90a";
      auto compiled = jit::compile(r);
      // The split kernel (the bandwidth-bound loop) spills nothing; the combine kernel's few bytes are
      // the registers saved around the merge wait's timeout diagnostic (a call).
      const std::string& log = compiled->log;
      const std::regex entry(
          R"(Compiling entry function '([^']+)'[^\n]*\n[^\n]*\n[^\n]*?(\d+) bytes spill stores, (\d+) bytes spill loads\n[^\n]*?Used (\d+) registers)");
      // The occupancy the split model counts on: the pipelines' shared memory and the registers let
      // an SM hold 3 CTAs at head dim 64, 2 at 128 and 1 at 256.
      const std::string& split_name = r.name_expressions[0];
      const int d = split_name.find(", 64>") != std::string::npos    ? 64
                    : split_name.find(", 128>") != std::string::npos ? 128
                                                                     : 256;
      const int want_resident = d == 64 ? 3 : d == 128 ? 2 : 1;
      int splits = 0;
      for (auto it = std::sregex_iterator(log.begin(), log.end(), entry); it != std::sregex_iterator(); ++it) {
        if ((*it)[1].str().find("flash_decode_split") == std::string::npos) continue;
        ++splits;
        EXPECT_EQ((*it)[2].str() + (*it)[3].str(), "00") << (*it)[1].str() << "\n" << log;
        const int regs = std::stoi((*it)[4].str());
        EXPECT_GE(resident_ctas_per_sm(regs, kernels::attention::kDecodeThreads,
                                       kernels::attention::decode_smem_bytes(d, 2), SmLimits{}),
                  want_resident)
            << split_name << ": " << regs << " registers";
      }
      EXPECT_EQ(splits, 1) << log;
      for (const auto& name : r.name_expressions) EXPECT_NO_THROW(compiled->lowered_name(name)) << name;
    }
  }
  EXPECT_TRUE(found) << "flash_decode kernels are not registered";
}
