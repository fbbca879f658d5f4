// The overlap ops' method names and their performance model (choose_overlap_method): pure functions,
// CPU-tested. The model sees an op only through what crosses the links (OverlapComm), so an op added
// to the catalogue gets a method choice without a line here.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/detail/overlap_model.hpp"

namespace tdist {

const char* to_string(OverlapMethod method) {
  switch (method) {
    case OverlapMethod::kAuto: return "auto";
    case OverlapMethod::kFused: return "fused";
    case OverlapMethod::kChunked: return "chunked";
    case OverlapMethod::kSequential: return "sequential";
    case OverlapMethod::kBaseline: return "baseline";
  }
  return "?";
}

OverlapMethod parse_overlap_method(const std::string& text, const char* what) {
  for (OverlapMethod m : {OverlapMethod::kAuto, OverlapMethod::kFused, OverlapMethod::kChunked,
                          OverlapMethod::kSequential, OverlapMethod::kBaseline})
    if (text == to_string(m)) return m;
  TDIST_FAIL("invalid argument '", what, "': expected auto, fused, chunked, sequential or baseline, got '", text, "'");
}

const char* to_string(OverlapComm comm) {
  switch (comm) {
    case OverlapComm::kGatherA: return "gather_a";
    case OverlapComm::kScatterD: return "scatter_d";
    case OverlapComm::kAllReduceD: return "all_reduce_d";
  }
  return "?";
}

namespace {

// Rough H200 rates for the model: dense bf16 GEMM throughput once every SM is busy, copy-engine
// bandwidth per direction over NVLink, and the fixed cost of one launch plus flag wait.
constexpr double kGemmFlops = 700e12;
constexpr double kCopyBytesPerSecond = 350e9;
constexpr double kStepSeconds = 6e-6;

void check_overlap_shape(const OverlapShape& s) {
  TDIST_CHECK_ARG(s.world_size >= 1, "world_size", "expected >= 1, got ", s.world_size);
  TDIST_CHECK_ARG(s.m >= 0 && s.n >= 0 && s.k >= 0, "shape", "m, n and k must be >= 0, got ", s.m, ", ", s.n, ", ",
                  s.k);
}

}  // namespace

OverlapMethod choose_overlap_method(const OverlapShape& s) {
  check_overlap_shape(s);
  const int w = s.world_size;
  // One rank: no communication; the chunked path is one plain cuBLAS GEMM.
  if (w == 1) return OverlapMethod::kChunked;
  const bool even = s.m % w == 0;
  // Sequential (tdist's collectives) needs equal per-rank counts except for AllReduce.
  const OverlapMethod no_overlap =
      even || s.comm == OverlapComm::kAllReduceD ? OverlapMethod::kSequential : OverlapMethod::kBaseline;
  const double gemm_s = 2.0 * static_cast<double>(s.m) * s.n * s.k / kGemmFlops;
  const double elem = static_cast<double>(dtype_size(s.dtype));
  double comm_bytes = 0;  // what one rank receives
  switch (s.comm) {
    case OverlapComm::kGatherA: comm_bytes = static_cast<double>(s.m) * s.k * elem * (w - 1) / w; break;
    case OverlapComm::kScatterD: comm_bytes = static_cast<double>(s.m) * s.n * elem * (w - 1) / w; break;
    case OverlapComm::kAllReduceD: comm_bytes = 2.0 * static_cast<double>(s.m) * s.n * elem * (w - 1) / w; break;
  }
  const double comm_s = comm_bytes / kCopyBytesPerSecond;
  // Chunking pays a launch and a flag wait per chunk and runs each GEMM on M / world rows; it hides
  // the communication only when each chunk's GEMM is long against those costs. Measured on 2 x H200
  // (bench/results/h200x2/gemm_overlap.json): chunked beats sequential from M = 1024 (chunks of 512
  // rows, ~40-80 us of GEMM each) for the LLaMA-3-70B shapes; the fused kernel matches it at large M
  // but not below, so the model does not pick it yet.
  // GEMM-AllReduce gathers the reduced rows after the GEMMs unless they come in pieces (at least
  // 1024 rows per rank); with 256 rows per rank (M = 512 at two ranks) the chunked method ran 6 %
  // behind NCCL + cuBLAS, at 512 rows 4-7 % ahead of it.
  const int64_t min_rows = s.comm == OverlapComm::kAllReduceD ? 512 : 256;
  const double chunk_gemm_s = gemm_s / w;
  if (s.m / w < min_rows || chunk_gemm_s < 6 * kStepSeconds || comm_s < w * kStepSeconds) return no_overlap;
  return OverlapMethod::kChunked;
}

int overlap_row_pieces(const OverlapShape& s) {
  check_overlap_shape(s);
  const int w = s.world_size;
  if (w == 1) return 1;          // nothing to exchange
  const int64_t rows = s.m / w;  // the shortest chunk
  if (const int64_t v = env::integer("TDIST_OVERLAP_PIECES", 0, 1, kMaxOverlapPieces); v > 0) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(v, rows)));  // a row per piece and rank
  }
  // The last peer to compute this rank's rows finishes them just as this rank starts its own, so
  // the first piece of them must cross the link while this rank computes one piece:
  // c / P + x / P <= c, c the chunk's GEMM time and x its transfer time: P >= 1 + x / c (with a
  // quarter piece of margin). More pieces only add launches (measured on 2 x H200 at M = 4096: two
  // pieces 3 % faster than four); fewer than 512 rows a piece lose GEMM efficiency.
  const double elem = static_cast<double>(dtype_size(s.dtype));
  const double chunk_gemm_s = 2.0 * static_cast<double>(rows) * s.n * s.k / kGemmFlops;
  const double chunk_send_s = static_cast<double>(rows) * s.n * elem / kCopyBytesPerSecond;
  if (chunk_gemm_s <= 0) return 1;
  // Powers of two: pieces of a tile-aligned chunk stay tile-aligned (GEMM-AllReduce with three
  // pieces of 4096 rows ran 7 % slower than with four, in two runs on 2 x H200).
  constexpr int64_t kMinPieceRows = 512;
  int most = 1;
  while (most * 2 <= kMaxOverlapPieces && rows / (most * 2) >= kMinPieceRows) most *= 2;
  if (most < 2) return 1;
  const double need = 1.25 + chunk_send_s / chunk_gemm_s;
  int p = 2;
  while (p < most && p < need) p *= 2;
  // GEMM-AllReduce: the peers pull the owner's last piece after its GEMMs, in the open, so more
  // pieces shorten that, at the cost of a piece (a launch, a wait, copies beside the GEMMs): about
  // 18 us, fitted to two pieces beating four by 15-29 us at M = 4096 on 2 x H200
  // (bench/results/h200x2/README.md, row pieces).
  if (s.comm == OverlapComm::kAllReduceD) {
    constexpr double kPieceSeconds = 18e-6;
    auto cost = [&](int q) { return chunk_send_s / q + q * kPieceSeconds; };
    for (int q = p * 2; q <= most; q *= 2)
      if (cost(q) < cost(p)) p = q;
  }
  return p;
}

int64_t overlap_m_bucket(int64_t m) {
  int64_t b = 1;
  while (b < m) {
    if (b == 1)
      b = 2;
    else if ((b & (b - 1)) == 0)
      b = b / 2 * 3;  // 2^i -> 3 * 2^(i-1)
    else
      b = b / 3 * 4;  // 3 * 2^(i-1) -> 2^(i+1)
  }
  return b;
}

}  // namespace tdist
