// The overlapped tensor-parallel linear layers (include/tdist/ops/gemm_overlap.hpp) without a GPU:
// the method choice (choose_overlap_method), method and op names, and the argument checks of
// AllGatherGemm, GemmReduceScatter and GemmAllReduce (every error names the argument). RowChunks and
// tile_chunks, which these ops split M with, are covered by test_gemm_schedule.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "cpu/errors.hpp"
#include "tdist/common/error.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/detail/overlap_model.hpp"
#include "tdist/ops/gemm_overlap.hpp"

using tdist::DType;
using tdist::OverlapComm;
using tdist::OverlapMethod;
using tdist::OverlapShape;

using tdist::test::error_of;
using tdist::test::expect_arg_error;

namespace {

const OverlapComm kOps[] = {OverlapComm::kGatherA, OverlapComm::kScatterD, OverlapComm::kAllReduceD};
const OverlapMethod kMethods[] = {OverlapMethod::kAuto, OverlapMethod::kFused, OverlapMethod::kChunked,
                                  OverlapMethod::kSequential, OverlapMethod::kBaseline};

bool no_overlap(OverlapMethod m) { return m == OverlapMethod::kSequential || m == OverlapMethod::kBaseline; }

// Fake device pointers, 16-byte aligned (nothing is dereferenced on the host), and misaligned ones.
const void* cptr(uintptr_t p) { return reinterpret_cast<const void*>(p); }
void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// The model's problem sizes of the LLaMA-3-70B layers and of small and odd ones: (M, N, K) as
// OverlapShape takes them (N local for AllGather-GEMM, K local for ReduceScatter/AllReduce).
std::vector<OverlapShape> shapes_for(OverlapComm op, int world) {
  std::vector<OverlapShape> v;
  const std::vector<int64_t> ms = {1, 2, 7, 64, 127, 128, 255, 256, 257, 1000, 1024, 4096, 4097, 8192, 16384, 65536};
  for (int64_t m : ms) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      if (op == OverlapComm::kGatherA) {
        v.push_back({op, m, 14336 / world, 8192, world, dtype});
        v.push_back({op, m, 8192 / world, 8192, world, dtype});
        v.push_back({op, m, 520, 264, world, dtype});
      } else {
        v.push_back({op, m, 8192, 14336 / world / 8 * 8, world, dtype});
        v.push_back({op, m, 8192, 8192 / world / 8 * 8, world, dtype});
        v.push_back({op, m, 1000, 520, world, dtype});
      }
    }
  }
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names

TEST(OverlapNames, MethodsRoundTrip) {
  std::set<std::string> names;
  for (OverlapMethod m : kMethods) {
    ASSERT_NE(tdist::to_string(m), nullptr);
    names.insert(tdist::to_string(m));
    EXPECT_EQ(tdist::parse_overlap_method(tdist::to_string(m)), m) << tdist::to_string(m);
  }
  EXPECT_EQ(names.size(), 5u);
  EXPECT_STREQ(tdist::to_string(OverlapMethod::kAuto), "auto");
  EXPECT_STREQ(tdist::to_string(OverlapMethod::kFused), "fused");
  EXPECT_STREQ(tdist::to_string(OverlapMethod::kChunked), "chunked");
  EXPECT_STREQ(tdist::to_string(OverlapMethod::kSequential), "sequential");
  EXPECT_STREQ(tdist::to_string(OverlapMethod::kBaseline), "baseline");
  EXPECT_EQ(tdist::parse_overlap_method("fused", "TDIST_OVERLAP_METHOD"), OverlapMethod::kFused);
}

TEST(OverlapNames, BadMethodNamesTheArgument) {
  for (const char* bad : {"", "fuse", "nccl", "chunked,fused", "bogus"}) {
    const std::string e = error_of([&] { tdist::parse_overlap_method(bad); });
    EXPECT_NE(e.find("method"), std::string::npos) << "'" << bad << "': " << e;
    const std::string v = error_of([&] { tdist::parse_overlap_method(bad, "TDIST_OVERLAP_METHOD"); });
    EXPECT_NE(v.find("TDIST_OVERLAP_METHOD"), std::string::npos) << "'" << bad << "': " << v;
    const std::string o = error_of([&] { tdist::parse_overlap_method(bad, "--methods"); });
    EXPECT_NE(o.find("--methods"), std::string::npos) << "'" << bad << "': " << o;
  }
}

TEST(OverlapNames, Comms) {
  std::set<std::string> names;
  for (OverlapComm op : kOps) {
    ASSERT_NE(tdist::to_string(op), nullptr);
    EXPECT_GT(std::string(tdist::to_string(op)).size(), 0u);
    names.insert(tdist::to_string(op));
  }
  EXPECT_EQ(names.size(), 3u);
}

// ---------------------------------------------------------------------------------------------
// overlap_m_bucket: the M classes of the method timing

TEST(OverlapModel, MBucketsStepAtMostOneAndAHalf) {
  const std::vector<int64_t> first = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128};
  int64_t m = 1;
  for (int64_t b : first) {
    for (; m <= b; ++m) EXPECT_EQ(tdist::overlap_m_bucket(m), b) << "m=" << m;
  }
  for (int64_t v : {int64_t{1000}, int64_t{4097}, int64_t{12289}, int64_t{1} << 20, (int64_t{1} << 40) + 7}) {
    const int64_t b = tdist::overlap_m_bucket(v);
    EXPECT_GE(b, v);
    EXPECT_LE(b, v + v / 2) << "v=" << v;
    EXPECT_EQ(tdist::overlap_m_bucket(b), b);  // a bucket is its own
    EXPECT_GT(tdist::overlap_m_bucket(b + 1), b);
  }
  EXPECT_EQ(tdist::overlap_m_bucket(0), 1);
}

// choose_overlap_method

TEST(OverlapChoice, NeverAutoAndDeterministic) {
  for (OverlapComm op : kOps) {
    for (int world = 1; world <= 8; ++world) {
      for (const OverlapShape& s : shapes_for(op, world)) {
        const OverlapMethod m = tdist::choose_overlap_method(s);
        EXPECT_NE(m, OverlapMethod::kAuto)
            << tdist::to_string(op) << " world " << world << " m " << s.m << " n " << s.n << " k " << s.k;
        EXPECT_TRUE(m == OverlapMethod::kFused || m == OverlapMethod::kChunked || no_overlap(m)) << static_cast<int>(m);
        // The sequential method needs equal per-rank counts for AllGather / ReduceScatter.
        if (s.comm != OverlapComm::kAllReduceD && s.m % world != 0)
          EXPECT_NE(m, OverlapMethod::kSequential) << tdist::to_string(op) << " world " << world << " m " << s.m;
        for (int again = 0; again < 3; ++again) EXPECT_EQ(tdist::choose_overlap_method(s), m);
      }
    }
  }
}

TEST(OverlapChoice, AllReduceOverlapsFrom512RowsPerRank) {
  // Measured on 2 x H200, LLaMA-3-70B down projection: chunked GEMM-AllReduce loses to NCCL + cuBLAS
  // at M = 512 and wins from M = 1024.
  for (int world : {2, 4, 8}) {
    OverlapShape s{OverlapComm::kAllReduceD, 256 * world, 8192, 14336 / world / 8 * 8, world, DType::kBFloat16};
    EXPECT_EQ(tdist::choose_overlap_method(s), OverlapMethod::kSequential) << world;
    s.m = 512 * world;
    // (At eight ranks the per-rank GEMM of 512 rows is too short to hide anything behind.)
    if (world < 8) EXPECT_EQ(tdist::choose_overlap_method(s), OverlapMethod::kChunked) << world;
  }
}

TEST(OverlapChoice, NoOverlapAtSmallM) {
  // Per-chunk launches and flag waits cost more than the communication they hide at M <= 256
  // (a few KB to a few MB moved): the model must pick a method without overlap there (sequential
  // or baseline), for every op, team of 2 to 8 ranks and dtype, at every N and K tried. (One rank:
  // SingleRank.)
  for (OverlapComm op : kOps) {
    for (int world = 2; world <= 8; ++world) {
      for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}, int64_t{64}, int64_t{100}, int64_t{128},
                        int64_t{200}, int64_t{255}, int64_t{256}}) {
        for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
          for (int64_t nk : {int64_t{8}, int64_t{520}, int64_t{1792}, int64_t{8192}, int64_t{14336}, int64_t{28672}}) {
            OverlapShape s{op, m, nk, nk, world, dtype};
            EXPECT_TRUE(no_overlap(tdist::choose_overlap_method(s)))
                << tdist::to_string(op) << " world " << world << " m " << m << " n = k = " << nk << ": "
                << tdist::to_string(tdist::choose_overlap_method(s));
          }
          OverlapShape llama{op,
                             m,
                             op == OverlapComm::kGatherA ? 14336 / world : 8192,
                             op == OverlapComm::kGatherA ? 8192 : 14336 / world / 8 * 8,
                             world,
                             dtype};
          EXPECT_TRUE(no_overlap(tdist::choose_overlap_method(llama)))
              << tdist::to_string(op) << " world " << world << " m " << m << ": "
              << tdist::to_string(tdist::choose_overlap_method(llama));
        }
      }
    }
  }
}

TEST(OverlapChoice, SingleRank) {
  // Nothing to exchange: the choice is made without error and is a runnable method.
  for (OverlapComm op : kOps) {
    for (int64_t m : {int64_t{1}, int64_t{1024}, int64_t{8192}, int64_t{65536}}) {
      OverlapShape s{op, m, 8192, 8192, 1, DType::kBFloat16};
      OverlapMethod got = OverlapMethod::kAuto;
      EXPECT_NO_THROW(got = tdist::choose_overlap_method(s)) << tdist::to_string(op) << " m " << m;
      EXPECT_NE(got, OverlapMethod::kAuto);
    }
  }
}

// overlap_row_pieces

namespace {
int pieces(int64_t m, int64_t n, int64_t k, int w) {
  return tdist::overlap_row_pieces({OverlapComm::kScatterD, m, n, k, w, DType::kBFloat16});
}
}  // namespace

TEST(OverlapRowPieces, FewestThatHideEachTransferNoneUnder512Rows) {
  unsetenv("TDIST_OVERLAP_PIECES");
  for (int w : {2, 3, 4, 8}) {
    for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{4097}, int64_t{16384}, int64_t{1} << 20}) {
      for (int64_t k : {int64_t{64}, int64_t{1024}, int64_t{4096}, int64_t{7168}}) {
        const int p = pieces(m, 8192, k, w);
        EXPECT_GE(p, 1);
        EXPECT_LE(p, tdist::kMaxOverlapPieces);
        if (p > 1) EXPECT_GE(m / w / p, 512) << "m " << m << " world " << w << " k " << k;
        if (m / w >= 1024) EXPECT_GE(p, 2) << "m " << m << " world " << w << " k " << k;
        EXPECT_EQ(p & (p - 1), 0) << "a power of two, got " << p;
      }
    }
  }
  // Two ranks, the measured shapes: two pieces where the GEMM of a piece outlasts its transfer.
  EXPECT_EQ(pieces(4096, 8192, 4096, 2), 2);
  EXPECT_EQ(pieces(16384, 8192, 7168, 2), 2);
  EXPECT_EQ(pieces(2046, 8192, 7168, 2), 1);  // 1023 rows per rank
  // A short K: the transfer outlasts a piece's GEMM, so more pieces (a power of two, up to 4).
  EXPECT_EQ(pieces(16384, 8192, 2048, 2), 4);
  EXPECT_EQ(pieces(16384, 8192, 64, 2), tdist::kMaxOverlapPieces);
  EXPECT_EQ(pieces(16384, 8192, 7168, 1), 1);  // one rank: nothing to exchange
  // GEMM-AllReduce: more pieces as the chunk grows (its last piece travels in the open).
  auto ar = [](int64_t m, int w) {
    return tdist::overlap_row_pieces({OverlapComm::kAllReduceD, m, 8192, 7168, w, DType::kBFloat16});
  };
  EXPECT_EQ(ar(4096, 2), 2);
  EXPECT_EQ(ar(8192, 2), 4);
  EXPECT_EQ(ar(16384, 2), 4);
  EXPECT_EQ(ar(2047, 2), 1);
  EXPECT_EQ(ar(1 << 20, 8), tdist::kMaxOverlapPieces);
  for (int64_t m = 1024; m <= (1 << 20); m *= 2) EXPECT_GE(ar(m, 2), pieces(m, 8192, 7168, 2)) << m;
}

TEST(OverlapRowPieces, EnvironmentOverridesAndIsChecked) {
  setenv("TDIST_OVERLAP_PIECES", "3", 1);
  EXPECT_EQ(pieces(16384, 8192, 7168, 2), 3);
  EXPECT_EQ(pieces(1000, 520, 264, 2), 3);
  EXPECT_EQ(pieces(5, 520, 264, 2), 2);  // every piece keeps a row on every rank
  EXPECT_EQ(pieces(1, 520, 264, 2), 1);
  for (const char* bad : {"0", "5", "two", "2x", "-1"}) {
    setenv("TDIST_OVERLAP_PIECES", bad, 1);
    const std::string e = error_of([] { pieces(4096, 8192, 4096, 2); });
    EXPECT_NE(e.find("TDIST_OVERLAP_PIECES"), std::string::npos) << bad << ": " << e;
  }
  unsetenv("TDIST_OVERLAP_PIECES");
  EXPECT_NE(error_of([] { pieces(4096, 8192, 4096, 0); }).find("'world_size'"), std::string::npos);
  EXPECT_NE(error_of([] { pieces(-1, 8192, 4096, 2); }).find("'shape'"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// AllGatherGemm argument checks

namespace {

tdist::AllGatherGemmConfig ag_config() {
  tdist::AllGatherGemmConfig c;
  c.max_m = 4096;
  c.k = 264;
  c.dtype = DType::kBFloat16;
  return c;
}

tdist::AllGatherGemmArgs ag_args() {
  tdist::AllGatherGemmArgs a;
  a.a_local = cptr(0x10000);
  a.b = cptr(0x20000);
  a.d = ptr(0x30000);
  a.a_gathered = nullptr;
  a.m = 1000;
  a.n = 520;
  return a;
}

}  // namespace

TEST(AllGatherGemmArgs, Accepts) {
  for (int world = 1; world <= 8; ++world) {
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(ag_args(), ag_config(), world, rank)) << world << " " << rank;
      auto a = ag_args();
      a.a_gathered = ptr(0x40000);  // optional output
      EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(a, ag_config(), world, rank));
      a.m = 4096;  // exactly max_m
      EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(a, ag_config(), world, rank));
      a.m = 4097 - world;  // not a multiple of the team or of a tile
      EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(a, ag_config(), world, rank));
      a.n = 8;
      EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(a, ag_config(), world, rank));
    }
  }
  auto c = ag_config();
  c.dtype = DType::kFloat16;
  EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(ag_args(), c, 2, 1));
  c.k = 8;
  EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(ag_args(), c, 2, 1));
  // m == 0 or n == 0: nothing to do, no pointer needed.
  tdist::AllGatherGemmArgs empty;
  EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(empty, ag_config(), 2, 0));
  empty.m = 1000;
  EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(empty, ag_config(), 2, 0));
}

TEST(AllGatherGemmArgs, ErrorsNameTheArgument) {
  using Args = tdist::AllGatherGemmArgs;
  using Config = tdist::AllGatherGemmConfig;
  auto with = [](auto change_args, auto change_config, int world = 2, int rank = 0) {
    return [=] {
      Args a = ag_args();
      Config c = ag_config();
      change_args(a);
      change_config(c);
      tdist::check_all_gather_gemm_args(a, c, world, rank);
    };
  };
  auto none_a = [](Args&) {};
  auto none_c = [](Config&) {};
  for (int world : {1, 2, 3, 8}) {
    for (int rank : {0, world - 1}) {
      expect_arg_error(with([](Args& a) { a.m = 4097; }, none_c, world, rank), "m");  // beyond max_m
      expect_arg_error(with([](Args& a) { a.m = -1; }, none_c, world, rank), "m");
      expect_arg_error(with([](Args& a) { a.n = -8; }, none_c, world, rank), "n");
      // config.k (a multiple of 8) is the constructor's check (GPU test), not the per-call one.
      expect_arg_error(with([](Args& a) { a.n = 521; }, none_c, world, rank), "n");  // D's rows 16-byte multiples
      expect_arg_error(with(
                           none_a, [](Config& c) { c.dtype = DType::kFloat32; }, world, rank),
                       "dtype");
      expect_arg_error(with(
                           none_a, [](Config& c) { c.dtype = static_cast<DType>(9); }, world, rank),
                       "dtype");
      // Null pointers (m, n > 0; every rank owns at least one of the 1000 rows).
      expect_arg_error(with([](Args& a) { a.a_local = nullptr; }, none_c, world, rank), "a_local");
      expect_arg_error(with([](Args& a) { a.b = nullptr; }, none_c, world, rank), "b");
      expect_arg_error(with([](Args& a) { a.d = nullptr; }, none_c, world, rank), "d");
      // Misaligned pointers (TMA and the copy engine's 16-byte rule).
      expect_arg_error(with([](Args& a) { a.a_local = cptr(0x10008); }, none_c, world, rank), "a_local");
      expect_arg_error(with([](Args& a) { a.a_local = cptr(0x10002); }, none_c, world, rank), "a_local");
      expect_arg_error(with([](Args& a) { a.b = cptr(0x20002); }, none_c, world, rank), "b");
      expect_arg_error(with([](Args& a) { a.d = ptr(0x30004); }, none_c, world, rank), "d");
      expect_arg_error(with([](Args& a) { a.a_gathered = ptr(0x40008); }, none_c, world, rank), "a_gathered");
    }
  }
  // A rank that does not exist in the team.
  EXPECT_NE(error_of(with(none_a, none_c, 2, 2)), "");
  EXPECT_NE(error_of(with(none_a, none_c, 2, -1)), "");
}

TEST(AllGatherGemmArgs, LocalRowsOfEveryRank) {
  // a_local holds RowChunks{m, world}.rows(rank) rows: every rank that owns rows needs a pointer,
  // whatever the split (the first m % world ranks own one row more; with m < world the last ranks
  // own none, and what they pass for a_local is not checked here: the header leaves it open).
  for (int world = 1; world <= 8; ++world) {
    for (int64_t m : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{257}, int64_t{1000}, int64_t{4095}}) {
      const tdist::kernels::gemm::RowChunks split{static_cast<uint64_t>(m), world};
      for (int rank = 0; rank < world; ++rank) {
        auto a = ag_args();
        a.m = m;
        EXPECT_NO_THROW(tdist::check_all_gather_gemm_args(a, ag_config(), world, rank))
            << "m " << m << " world " << world << " rank " << rank;
        if (split.rows(rank) > 0) {
          a.a_local = nullptr;
          expect_arg_error([&] { tdist::check_all_gather_gemm_args(a, ag_config(), world, rank); }, "a_local");
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GemmReduceScatter and GemmAllReduce argument checks (same rules; D is this rank's rows for
// ReduceScatter, which the pure check cannot size: it takes no rank, so ReduceScatter's d is checked
// by run() (GPU test), AllReduce's here).

namespace {

tdist::GemmReduceScatterConfig rs_config() {
  tdist::GemmReduceScatterConfig c;
  c.max_m = 4096;
  c.max_n = 1024;
  c.dtype = DType::kBFloat16;
  return c;
}

template <typename Args>
Args rs_args() {
  Args a;
  a.a = cptr(0x10000);
  a.b = cptr(0x20000);
  a.d = ptr(0x30000);
  a.m = 1000;
  a.n = 520;
  a.k = 264;
  return a;
}

void check(const tdist::GemmReduceScatterArgs& a, const tdist::GemmReduceScatterConfig& c) {
  tdist::check_gemm_reduce_scatter_args(a, c);
}
void check(const tdist::GemmAllReduceArgs& a, const tdist::GemmAllReduceConfig& c) {
  tdist::check_gemm_all_reduce_args(a, c);
}

template <typename Args>
void reduce_checks(bool checks_d) {
  using Config = tdist::GemmReduceScatterConfig;
  EXPECT_NO_THROW(check(rs_args<Args>(), rs_config()));
  {
    Args a = rs_args<Args>();
    a.m = 4096;  // exactly max_m and max_n
    a.n = 1024;
    EXPECT_NO_THROW(check(a, rs_config()));
    a.m = 1;  // fewer rows than any team has ranks
    EXPECT_NO_THROW(check(a, rs_config()));
    a.k = 8;
    EXPECT_NO_THROW(check(a, rs_config()));
    a.k = 14336;  // K has no configured bound
    EXPECT_NO_THROW(check(a, rs_config()));
    Config c = rs_config();
    c.dtype = DType::kFloat16;
    EXPECT_NO_THROW(check(a, c));
  }
  auto with = [](auto change_args, auto change_config) {
    return [=] {
      Args a = rs_args<Args>();
      Config c = rs_config();
      change_args(a);
      change_config(c);
      check(a, c);
    };
  };
  auto none_a = [](Args&) {};
  auto none_c = [](Config&) {};
  expect_arg_error(with([](Args& a) { a.m = 4097; }, none_c), "m");  // beyond max_m
  expect_arg_error(with([](Args& a) { a.m = -1; }, none_c), "m");
  expect_arg_error(with([](Args& a) { a.n = 1025; }, none_c), "n");  // beyond max_n
  expect_arg_error(with([](Args& a) { a.n = -1; }, none_c), "n");
  expect_arg_error(with([](Args& a) { a.n = 521; }, none_c), "n");  // D's rows 16-byte multiples
  expect_arg_error(with([](Args& a) { a.k = 12; }, none_c), "k");
  expect_arg_error(with([](Args& a) { a.k = 260; }, none_c), "k");
  expect_arg_error(with([](Args& a) { a.k = 0; }, none_c), "k");
  expect_arg_error(with([](Args& a) { a.k = -8; }, none_c), "k");
  expect_arg_error(with(none_a, [](Config& c) { c.dtype = DType::kFloat32; }), "dtype");
  expect_arg_error(with(none_a, [](Config& c) { c.dtype = static_cast<DType>(9); }), "dtype");
  expect_arg_error(with([](Args& a) { a.a = nullptr; }, none_c), "a");
  expect_arg_error(with([](Args& a) { a.b = nullptr; }, none_c), "b");
  expect_arg_error(with([](Args& a) { a.a = cptr(0x10008); }, none_c), "a");
  expect_arg_error(with([](Args& a) { a.a = cptr(0x10002); }, none_c), "a");
  expect_arg_error(with([](Args& a) { a.b = cptr(0x20004); }, none_c), "b");
  if (checks_d) {
    expect_arg_error(with([](Args& a) { a.d = nullptr; }, none_c), "d");
    expect_arg_error(with([](Args& a) { a.d = ptr(0x30008); }, none_c), "d");
  }
  // m == 0 or n == 0: nothing to do, no pointer needed.
  Args empty;
  empty.k = 264;
  EXPECT_NO_THROW(check(empty, rs_config()));
  // A configured bound below the call: the message names the argument, not the configuration.
  expect_arg_error(with([](Args& a) { a.m = 2000; }, [](Config& c) { c.max_m = 1999; }), "m");
  expect_arg_error(with([](Args& a) { a.n = 520; }, [](Config& c) { c.max_n = 512; }), "n");
}

}  // namespace

TEST(GemmReduceScatterArgs, AcceptsAndErrorsNameTheArgument) { reduce_checks<tdist::GemmReduceScatterArgs>(false); }

TEST(GemmAllReduceArgs, AcceptsAndErrorsNameTheArgument) { reduce_checks<tdist::GemmAllReduceArgs>(true); }

// Heap footprints, spelled out for two ranks of 132 SMs: what the constructors allocate, each
// allocation rounded to the heap's 256-byte alignment.
TEST(OverlapHeapBytes, SumOfTheAllocations) {
  const size_t mib = size_t{1} << 20;
  // Collectives of a 32 MiB workspace slot: workspace 2 x 32 MiB, flags 2 phases x 132 blocks x 2
  // ranks x 8 B (4224 -> 4352), barrier pads 2 x (2 + 2) x 8 B (-> 256), copy-engine piece flags
  // 16 x 2 x 8 B (256), LL buffer 2 x 2 ranks x 64 Ki lines x 8 B (2 MiB), LL128 buffer 2 x 2 ranks
  // x 8739 lines of 120 payload bytes (1 MiB) x 128 B (4474368 -> 4474368).
  const size_t ll128 = 2 * 2 * 8739 * 128;
  const size_t coll = 64 * mib + 4352 + 256 + 256 + 2 * mib + ll128;
  EXPECT_EQ(tdist::Collectives::heap_bytes(2, 32 * mib, 132), coll);
  EXPECT_GT(tdist::Collectives::heap_bytes(2, 32 * mib, 264), coll);  // more blocks, more flags
  // AllGather-GEMM, M = 16384, K = 8192, bf16: gathered A (256 MiB), flags (-> 256), the
  // Collectives above (the sequential method's collective capped at 32 MiB).
  const tdist::AllGatherGemmConfig ag{.max_m = 16384, .k = 8192, .dtype = DType::kBFloat16};
  EXPECT_EQ(tdist::all_gather_gemm_heap_bytes(ag, 2, 132), 256 * mib + 256 + coll);
  // GEMM-ReduceScatter, M = 16383 (an odd split), N = 8192: 2 slots of 8192 rows x 8192 x 2 B.
  const tdist::GemmReduceScatterConfig rs{.max_m = 16383, .max_n = 8192, .dtype = DType::kBFloat16};
  EXPECT_EQ(tdist::gemm_reduce_scatter_heap_bytes(rs, 2, 132), 256 * mib + 256 + coll);
  // GEMM-AllReduce: the ReduceScatter's, plus the reduced rows (16383 x 8192 x 2 B) and their flags.
  EXPECT_EQ(tdist::gemm_all_reduce_heap_bytes(rs, 2, 132), 256 * mib + 256 + coll + 16383 * 8192 * 2 + 256);
  // A small problem keeps a small workspace (twice its 1 KiB collective).
  const tdist::AllGatherGemmConfig tiny{.max_m = 8, .k = 64, .dtype = DType::kFloat16};
  EXPECT_EQ(tdist::all_gather_gemm_heap_bytes(tiny, 2, 132), 1024 + 256 + 2048 + 4352 + 256 + 256 + 2 * mib + ll128);
}
