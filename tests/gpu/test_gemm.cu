// tdist::Gemm on one GPU against a float64 reference computed on the GPU from the same inputs.
// Fresh random inputs per case, D poisoned before every run (and the padding columns between N
// and ldd checked to stay poisoned), odd M/N/K (K a multiple of 8), padded leading dimensions,
// rotated and grouped tile orders, fewer CTAs than tiles (many tiles per CTA: the ring's phases
// wrap), every shipped tile (and the 2-CTA cluster of each 128-row one) in bf16 and fp16. Then
// tdist::GroupedGemm (m-grouped, MoE): random group sizes with empty groups, one group holding every
// row, a single group, many small groups, int32 and int64 offsets, rows past offsets[G] (must stay
// poisoned), N and K odd multiples of 8 and an N that is no multiple of 8, rotated, table-ordered and
// few-CTA walks; each group checked against the float64 reference of its rows and its own B_g.
// Prints "N passed, M failed" last.
//
//   build-gpu/tests/gpu_test_gemm [--quick | --small]
// Single process; under tdistrun each rank tests its own GPU (LOCAL_RANK).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/detail/gemm_runtime.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/ops/grouped_gemm.hpp"

namespace {

__device__ __host__ inline unsigned long long mix(unsigned long long x) {
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 32);
}

// Uniform in [-1, 1), rounded to T, at every element of a rows x ld buffer (padding included).
template <typename T>
__global__ void fill_random(T* p, size_t count, unsigned long long seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double u = static_cast<double>(mix(seed * 0x9E3779B97F4A7C15ull + i) >> 11) * 0x1.0p-53;
    p[i] = static_cast<T>(static_cast<float>(2.0 * u - 1.0));
  }
}

__global__ void fill_u16(unsigned short* p, size_t count, unsigned short v) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}

// ref[i][j] = sum_k a[i][k] * b[j][k] in float64; 16 x 16 outputs per block through shared tiles.
template <typename T>
__global__ void reference(const T* a, const T* b, double* ref, int m, int n, int k, long lda, long ldb) {
  __shared__ float sa[16][17], sb[16][17];
  const int ti = threadIdx.y, tj = threadIdx.x;
  const int i = blockIdx.y * 16 + ti, j = blockIdx.x * 16 + tj;
  double s = 0;
  for (int k0 = 0; k0 < k; k0 += 16) {
    const int ai = blockIdx.y * 16 + ti, bj = blockIdx.x * 16 + ti;  // row loaded by this thread
    sa[ti][tj] = ai < m && k0 + tj < k ? static_cast<float>(a[ai * lda + k0 + tj]) : 0.0f;
    sb[ti][tj] = bj < n && k0 + tj < k ? static_cast<float>(b[bj * ldb + k0 + tj]) : 0.0f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) s += static_cast<double>(sa[ti][kk]) * static_cast<double>(sb[tj][kk]);
    __syncthreads();
  }
  if (i < m && j < n) ref[static_cast<long>(i) * n + j] = s;
}

// Per element: |d - ref| <= tol * max|ref| (a relative error against the output's scale; bf16 output
// rounding alone is 2^-9 relative). Counts bad elements, finds the largest error and max|ref|, and
// counts padding elements (columns n .. ldd) that lost the poison.
template <typename T>
__global__ void compare(const T* d, const double* ref, int m, int n, long ldd, unsigned short poison, double ref_max,
                        double tol, unsigned long long* bad, unsigned long long* bad_padding, double* max_err,
                        unsigned long long* first_bad) {
  const long j = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x, i = blockIdx.y;
  if (i >= m || j >= ldd) return;
  const T v = d[i * ldd + j];
  if (j >= n) {
    unsigned short bits;
    memcpy(&bits, &v, 2);
    if (bits != poison) atomicAdd(bad_padding, 1ull);
    return;
  }
  const double got = static_cast<double>(static_cast<float>(v));
  const double err = fabs(got - ref[i * n + j]);
  if (!(err <= tol * ref_max)) {  // NaN (poison left behind) fails too
    if (atomicAdd(bad, 1ull) == 0)
      *first_bad = static_cast<unsigned long long>(i) << 32 | static_cast<unsigned long long>(j);
    atomicMax(reinterpret_cast<unsigned long long*>(max_err), __double_as_longlong(isnan(err) ? 1e300 : err));
    return;
  }
  atomicMax(reinterpret_cast<unsigned long long*>(max_err),
            __double_as_longlong(err));  // err >= 0: bits order as values
}

__global__ void abs_max(const double* ref, size_t count, double* out) {
  double mx = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    mx = fmax(mx, fabs(ref[i]));
  atomicMax(reinterpret_cast<unsigned long long*>(out), __double_as_longlong(mx));
}

struct Case {
  int m, n, k;
  int pad_a = 0, pad_b = 0, pad_d = 0;  // extra leading-dimension elements (multiples of 8)
  int group_m = 8;
  long first_row = 0;
  int max_ctas = 0;
};

struct Result {
  bool ok;
  std::string detail;
};

template <typename T>
Result run_case(tdist::Gemm& gemm, tdist::DType dtype, const tdist::GemmTile& tile, const Case& c,
                unsigned long long seed, cudaStream_t stream) {
  const long lda = c.k + c.pad_a, ldb = c.k + c.pad_b, ldd = ((c.n + 7) / 8) * 8 + c.pad_d;
  T *a = nullptr, *b = nullptr, *d = nullptr;
  double *ref = nullptr, *stats = nullptr;
  unsigned long long* counts = nullptr;
  TDIST_CUDA_CHECK(cudaMalloc(&a, sizeof(T) * c.m * lda));
  TDIST_CUDA_CHECK(cudaMalloc(&b, sizeof(T) * c.n * ldb));
  TDIST_CUDA_CHECK(cudaMalloc(&d, sizeof(T) * c.m * ldd));
  TDIST_CUDA_CHECK(cudaMalloc(&ref, sizeof(double) * c.m * c.n));
  TDIST_CUDA_CHECK(cudaMalloc(&stats, 2 * sizeof(double)));
  TDIST_CUDA_CHECK(cudaMalloc(&counts, 3 * sizeof(unsigned long long)));
  fill_random<<<264, 256, 0, stream>>>(a, static_cast<size_t>(c.m) * lda, seed);
  fill_random<<<264, 256, 0, stream>>>(b, static_cast<size_t>(c.n) * ldb, seed + 1);
  const unsigned short poison = 0x7FC1;  // a NaN in bf16 and fp16 alike
  fill_u16<<<264, 256, 0, stream>>>(reinterpret_cast<unsigned short*>(d), static_cast<size_t>(c.m) * ldd, poison);
  TDIST_CUDA_CHECK(cudaMemsetAsync(stats, 0, 2 * sizeof(double), stream));
  TDIST_CUDA_CHECK(cudaMemsetAsync(counts, 0, 3 * sizeof(unsigned long long), stream));
  reference<T><<<dim3((c.n + 15) / 16, (c.m + 15) / 16), dim3(16, 16), 0, stream>>>(a, b, ref, c.m, c.n, c.k, lda, ldb);
  abs_max<<<264, 256, 0, stream>>>(ref, static_cast<size_t>(c.m) * c.n, stats);
  TDIST_CUDA_CHECK(cudaGetLastError());

  tdist::GemmArgs args;
  args.a = a;
  args.b = b;
  args.d = d;
  args.m = c.m;
  args.n = c.n;
  args.k = c.k;
  args.dtype = dtype;
  args.lda = lda;
  args.ldb = ldb;
  args.ldd = ldd;
  tdist::GemmRunOptions o;
  o.tile = tile;
  o.group_m = c.group_m;
  o.first_row = c.first_row;
  o.max_ctas = c.max_ctas;
  gemm.run(args, stream, o);
  TDIST_CUDA_CHECK(cudaGetLastError());

  double ref_max = 0;
  TDIST_CUDA_CHECK(cudaMemcpyAsync(&ref_max, stats, sizeof(double), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double tol = 1e-2;
  compare<T><<<dim3((ldd + 127) / 128, c.m), 128, 0, stream>>>(d, ref, c.m, c.n, ldd, poison, ref_max, tol, counts,
                                                               counts + 1, stats + 1, counts + 2);
  unsigned long long host_counts[3];
  double max_err = 0;
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host_counts, counts, sizeof(host_counts), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaMemcpyAsync(&max_err, stats + 1, sizeof(double), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(d), static_cast<void*>(ref),
                  static_cast<void*>(stats), static_cast<void*>(counts)})
    TDIST_CUDA_CHECK(cudaFree(p));

  char buf[256];
  std::snprintf(buf, sizeof(buf), "max |err| / max |ref| = %.3g (max |ref| %.3g), %llu bad, %llu padding overwritten",
                ref_max > 0 ? max_err / ref_max : max_err, ref_max, host_counts[0], host_counts[1]);
  std::string detail = buf;
  if (host_counts[0] > 0) {
    std::snprintf(buf, sizeof(buf), ", first bad at (%llu, %llu)", host_counts[2] >> 32,
                  host_counts[2] & 0xFFFFFFFFull);
    detail += buf;
  }
  return {host_counts[0] == 0 && host_counts[1] == 0 && ref_max > 0, detail};
}

// ---------------- grouped GEMM ----------------

struct GroupedCase {
  const char* what;
  int groups, n, k;
  std::vector<int> counts;  // rows per group before padding; empty: random in [0, max_rows], a third empty
  int max_rows = 300;
  int extra_rows = 0;  // M_total - offsets[G]: rows the kernel must not touch
  bool int64_offsets = false;
  long first_row = 0;
  int group_m = 8;
  int max_ctas = 0;
  bool reversed_order = false;  // m_tile_order: the m-tiles last to first
  bool order_scratch = false;   // GroupedGemmRunOptions::order_scratch given (a clustered walk then
                                // runs in pair order, which the case checks against the host's)
  bool gather = false;          // A's rows gathered from token rows (RowGather): random tokens, padding
                                // rows -1, a third of the tokens read from a separate `local` buffer
};

// The case's rows per group (c.counts, or random from the generator state r) and their offsets.
std::vector<int64_t> draw_group_offsets(const GroupedCase& c, unsigned long long& r, std::vector<long long>& counts) {
  counts.assign(c.groups, 0);
  for (int g = 0; g < c.groups; ++g) {
    r = mix(r + 0x9E3779B97F4A7C15ull);
    counts[g] =
        !c.counts.empty() ? c.counts[g] : (r % 3 == 0 ? 0 : static_cast<long long>((r >> 8) % (c.max_rows + 1)));
  }
  std::vector<int64_t> offsets = tdist::grouped_gemm_offsets(std::vector<int64_t>(counts.begin(), counts.end()));
  tdist::check_grouped_gemm_offsets(offsets, offsets.back());
  return offsets;
}

// Offsets to the device as int32 or int64 (a new allocation).
void* upload_offsets(const std::vector<int64_t>& offsets, bool int64) {
  void* offs = nullptr;
  TDIST_CUDA_CHECK(cudaMalloc(&offs, 8 * offsets.size()));
  if (int64) {
    std::vector<long long> o(offsets.begin(), offsets.end());
    TDIST_CUDA_CHECK(cudaMemcpy(offs, o.data(), 8 * o.size(), cudaMemcpyHostToDevice));
  } else {
    std::vector<int> o(offsets.begin(), offsets.end());
    TDIST_CUDA_CHECK(cudaMemcpy(offs, o.data(), 4 * o.size(), cudaMemcpyHostToDevice));
  }
  return offs;
}

// The check of a grouped GEMM's D: rows [0, rows) against `ref` (within 1e-2 x max |ref|; stats[0]
// holds max |ref|), and rows [rows, rows + extra_rows) past offsets[G] still poisoned in every element.
// `stats` (2 doubles) and `counters` (6), zeroed by the caller, are scratch.
struct GroupedCheck {
  double ref_max = 0, max_err = 0;
  unsigned long long bad = 0, padding = 0, first_bad = 0, past_offsets = 0;

  bool ok(long rows) const { return bad == 0 && padding == 0 && past_offsets == 0 && (rows == 0 || ref_max > 0); }
  std::string summary(long rows, int extra_rows) const {
    char buf[320];
    std::snprintf(buf, sizeof(buf),
                  "%ld rows + %d extra; max |err| / max |ref| = %.3g (max |ref| %.3g), %llu bad, %llu padding "
                  "overwritten, %llu rows-past-offsets overwritten",
                  rows, extra_rows, ref_max > 0 ? max_err / ref_max : max_err, ref_max, bad, padding, past_offsets);
    std::string s = buf;
    if (bad > 0) {
      std::snprintf(buf, sizeof(buf), ", first bad at (%llu, %llu)", first_bad >> 32, first_bad & 0xFFFFFFFFull);
      s += buf;
    }
    return s;
  }
};

template <typename T>
GroupedCheck check_grouped_output(const T* d, const double* ref, long rows, int extra_rows, int n, long ldd,
                                  unsigned short poison, double* stats, unsigned long long* counters,
                                  cudaStream_t stream) {
  GroupedCheck r;
  TDIST_CUDA_CHECK(cudaMemcpyAsync(&r.ref_max, stats, sizeof(double), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double tol = 1e-2;
  if (rows > 0)
    compare<T><<<dim3((ldd + 127) / 128, rows), 128, 0, stream>>>(d, ref, static_cast<int>(rows), n, ldd, poison,
                                                                  r.ref_max, tol, counters, counters + 1, stats + 1,
                                                                  counters + 2);
  // Rows past offsets[G]: every element still poisoned (n = 0: the whole row is "padding").
  if (extra_rows > 0)
    compare<T><<<dim3((ldd + 127) / 128, extra_rows), 128, 0, stream>>>(
        d + rows * ldd, ref, extra_rows, 0, ldd, poison, 1.0, tol, counters + 3, counters + 4, stats + 1, counters + 5);
  TDIST_CUDA_CHECK(cudaGetLastError());
  unsigned long long host[6];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host, counters, sizeof(host), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaMemcpyAsync(&r.max_err, stats + 1, sizeof(double), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  r.bad = host[0];
  r.padding = host[1];
  r.first_bad = host[2];
  r.past_offsets = host[4];
  return r;
}

// Gathered A's index: each group's real rows take random tokens of [0, num_tokens), padding rows -1
// (advances the case's random state `r`).
std::vector<int> draw_token_of_row(const GroupedCase& c, const std::vector<int64_t>& offsets,
                                   const std::vector<long long>& counts, long m_total, long num_tokens,
                                   unsigned long long& r) {
  std::vector<int> tor(std::max(m_total, 1L), -1);
  for (int g = 0; g < c.groups; ++g)
    for (long i = 0; i < counts[g]; ++i) {
      r = mix(r + 0x9E3779B97F4A7C15ull);
      tor[offsets[g] + i] = static_cast<int>(r % num_tokens);
    }
  return tor;
}

template <typename T>
Result run_grouped_case(tdist::GroupedGemm& gg, tdist::DType dtype, const tdist::GemmTile& tile, const GroupedCase& c,
                        unsigned long long seed, cudaStream_t stream) {
  std::vector<long long> counts;
  unsigned long long r = seed;
  const std::vector<int64_t> offsets = draw_group_offsets(c, r, counts);
  const long rows = offsets.back(), m_total = rows + c.extra_rows;
  const long lda = c.k + 8, ldb = c.k, ldd = ((c.n + 7) / 8) * 8 + 8;  // padded A and D rows
  T *a = nullptr, *b = nullptr, *d = nullptr;
  double *ref = nullptr, *stats = nullptr;
  unsigned long long* counters = nullptr;
  void* offs = nullptr;
  uint32_t* order = nullptr;
  const long ref_rows = rows > 0 ? rows : 1;
  TDIST_CUDA_CHECK(cudaMalloc(&a, sizeof(T) * std::max(m_total, 1L) * lda));
  TDIST_CUDA_CHECK(cudaMalloc(&b, sizeof(T) * c.groups * static_cast<long>(c.n) * ldb));
  TDIST_CUDA_CHECK(cudaMalloc(&d, sizeof(T) * std::max(m_total, 1L) * ldd));
  TDIST_CUDA_CHECK(cudaMalloc(&ref, sizeof(double) * ref_rows * c.n));
  TDIST_CUDA_CHECK(cudaMalloc(&stats, 2 * sizeof(double)));
  TDIST_CUDA_CHECK(cudaMalloc(&counters, 6 * sizeof(unsigned long long)));
  offs = upload_offsets(offsets, c.int64_offsets);
  const long tiles_m = rows / tile.block_m;
  if (c.reversed_order) {
    std::vector<uint32_t> o(std::max(tiles_m, 1L));
    for (long i = 0; i < tiles_m; ++i) o[i] = static_cast<uint32_t>(tiles_m - 1 - i);
    TDIST_CUDA_CHECK(cudaMalloc(&order, 4 * o.size()));
    TDIST_CUDA_CHECK(cudaMemcpy(order, o.data(), 4 * o.size(), cudaMemcpyHostToDevice));
  }
  uint32_t* scratch = nullptr;
  const size_t scratch_entries = static_cast<size_t>(tdist::grouped_gemm_scratch_entries(m_total));
  if (c.order_scratch) {
    TDIST_CUDA_CHECK(cudaMalloc(&scratch, 4 * scratch_entries));
    TDIST_CUDA_CHECK(cudaMemset(scratch, 0xFF, 4 * scratch_entries));
  }
  // A pageable cudaMemcpy may return before its DMA lands; `stream` is not ordered after it.
  TDIST_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  fill_random<<<264, 256, 0, stream>>>(a, static_cast<size_t>(std::max(m_total, 1L)) * lda, seed);
  fill_random<<<264, 256, 0, stream>>>(b, static_cast<size_t>(c.groups) * c.n * ldb, seed + 1);
  // Gathered A: A's rows come from random tokens; `a` is then written with what the kernel must see
  // (the reference's input), and the gathered copy of the local tokens is poisoned, so reading a
  // local token from the wrong place shows.
  T *tokens = nullptr, *local = nullptr;
  int* token_of_row = nullptr;
  tdist::kernels::gemm::RowGather gather;
  std::vector<int> tor;  // token of each row, -1 for padding (gathered A)
  if (c.gather) {
    const long num_tokens = 50 + rows / 3, ld_tok = c.k + 16;
    const long local_begin = num_tokens / 3, local_rows = num_tokens / 3;
    tor = draw_token_of_row(c, offsets, counts, m_total, num_tokens, r);
    TDIST_CUDA_CHECK(cudaMalloc(&tokens, sizeof(T) * num_tokens * ld_tok));
    TDIST_CUDA_CHECK(cudaMalloc(&local, sizeof(T) * local_rows * ld_tok));
    TDIST_CUDA_CHECK(cudaMalloc(&token_of_row, sizeof(int) * tor.size()));
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(token_of_row, tor.data(), sizeof(int) * tor.size(), cudaMemcpyHostToDevice, stream));
    fill_random<<<264, 256, 0, stream>>>(tokens, static_cast<size_t>(num_tokens) * ld_tok, seed + 2);
    std::vector<T> host_tokens(num_tokens * ld_tok), host_a(std::max(m_total, 1L) * lda);
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(host_tokens.data(), tokens, sizeof(T) * host_tokens.size(), cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    // Copies on the (non-blocking) test stream, then a sync: a pageable cudaMemcpy may return before
    // its DMA lands, and nothing would order it before the kernels on `stream`.
    TDIST_CUDA_CHECK(cudaMemcpyAsync(local, host_tokens.data() + local_begin * ld_tok, sizeof(T) * local_rows * ld_tok,
                                     cudaMemcpyHostToDevice, stream));
    fill_u16<<<264, 256, 0, stream>>>(reinterpret_cast<unsigned short*>(tokens + local_begin * ld_tok),
                                      static_cast<size_t>(local_rows) * ld_tok, 0x7FC1);
    for (long row = 0; row < m_total; ++row)
      for (long j = 0; j < lda; ++j)
        host_a[row * lda + j] = tor[row] >= 0 && j < c.k ? host_tokens[tor[row] * ld_tok + j] : T(0.0f);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(a, host_a.data(), sizeof(T) * m_total * lda, cudaMemcpyHostToDevice, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    gather = {token_of_row,
              local,
              tokens,
              static_cast<unsigned long long>(local_begin),
              static_cast<unsigned long long>(local_rows),
              sizeof(T) * ld_tok};
  }
  const unsigned short poison = 0x7FC1;  // a NaN in bf16 and fp16 alike
  fill_u16<<<264, 256, 0, stream>>>(reinterpret_cast<unsigned short*>(d),
                                    static_cast<size_t>(std::max(m_total, 1L)) * ldd, poison);
  TDIST_CUDA_CHECK(cudaMemsetAsync(stats, 0, 2 * sizeof(double), stream));
  TDIST_CUDA_CHECK(cudaMemsetAsync(counters, 0, 6 * sizeof(unsigned long long), stream));
  // Reference per group: its rows of A times its own B_g.
  for (int g = 0; g < c.groups; ++g) {
    const long r0 = offsets[g], nr = offsets[g + 1] - offsets[g];
    if (nr == 0) continue;
    reference<T><<<dim3((c.n + 15) / 16, (nr + 15) / 16), dim3(16, 16), 0, stream>>>(
        a + r0 * lda, b + static_cast<long>(g) * c.n * ldb, ref + r0 * c.n, static_cast<int>(nr), c.n, c.k, lda, ldb);
  }
  if (rows > 0) abs_max<<<264, 256, 0, stream>>>(ref, static_cast<size_t>(rows) * c.n, stats);
  TDIST_CUDA_CHECK(cudaGetLastError());

  tdist::GroupedGemmArgs args;
  args.a = a;
  args.b = b;
  args.d = d;
  args.offsets = offs;
  args.offsets_type = c.int64_offsets ? tdist::IndexType::kInt64 : tdist::IndexType::kInt32;
  args.m = m_total;
  args.n = c.n;
  args.k = c.k;
  args.num_groups = c.groups;
  args.dtype = dtype;
  args.lda = lda;
  args.ldb = ldb;
  args.ldd = ldd;
  tdist::GroupedGemmRunOptions o;
  o.tile = tile;
  o.group_m = c.group_m;
  o.first_row = c.first_row;
  o.max_ctas = c.max_ctas;
  o.m_tile_order = order;
  o.order_scratch = scratch;
  if (c.gather) args.a_gather = gather;
  gg.run(args, stream, o);
  TDIST_CUDA_CHECK(cudaGetLastError());
  // A clustered walk of several groups wrote the pair order (grouped_pair_order.cuh) there first.
  std::string order_error;
  if (scratch != nullptr && gg.tile_for(args, o).cluster_m == 2 && c.groups > 1 && order == nullptr &&
      c.first_row == 0) {
    std::vector<int64_t> tiles_per_group(c.groups);
    for (int g = 0; g < c.groups; ++g) tiles_per_group[g] = (offsets[g + 1] - offsets[g]) / tile.block_m;
    const std::vector<uint32_t> want = tdist::grouped_pair_order(tiles_per_group);
    std::vector<uint32_t> got(scratch_entries);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(got.data(), scratch, 4 * got.size(), cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < want.size() && order_error.empty(); ++i)
      if (got[i] != want[i])
        order_error = "; pair order entry " + std::to_string(i) + " is " + std::to_string(got[i]) + ", expected " +
                      std::to_string(want[i]);
  }

  const GroupedCheck check =
      check_grouped_output(d, ref, rows, c.extra_rows, c.n, ldd, poison, stats, counters, stream);
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(d), static_cast<void*>(ref),
                  static_cast<void*>(stats), static_cast<void*>(counters), offs, static_cast<void*>(order),
                  static_cast<void*>(tokens), static_cast<void*>(local), static_cast<void*>(token_of_row),
                  static_cast<void*>(scratch)})
    TDIST_CUDA_CHECK(cudaFree(p));

  int non_empty = 0;
  for (long long cnt : counts) non_empty += cnt > 0;
  std::string detail = std::to_string(non_empty) + " of " + std::to_string(c.groups) + " groups non-empty, " +
                       check.summary(rows, c.extra_rows) + order_error;
  if (check.bad > 0 && c.gather && (check.first_bad >> 32) < tor.size()) {
    const int t = tor[check.first_bad >> 32];
    char buf[80];
    std::snprintf(buf, sizeof(buf), " (token %d%s)", t,
                  t < 0 ? ", padding" : (t - gather.local_begin < gather.local_rows ? ", local" : ""));
    detail += buf;
  }
  return {check.ok(rows) && order_error.empty(), detail};
}

// ---------------- FP8 grouped GEMM ----------------

// e4m3 values drawn uniform in [-range, range) and rounded (saturating) to e4m3.
__global__ void fill_random_e4m3(__nv_fp8_e4m3* p, size_t count, unsigned long long seed, float range) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double u = static_cast<double>(mix(seed * 0x9E3779B97F4A7C15ull + i) >> 11) * 0x1.0p-53;
    p[i] = __nv_fp8_e4m3(static_cast<float>((2.0 * u - 1.0) * range));
  }
}

// Positive scales spread over two binades and more: lo * [1, 6).
__global__ void fill_scales(float* p, size_t count, unsigned long long seed, float lo) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double u = static_cast<double>(mix(seed * 0x9E3779B97F4A7C15ull + i) >> 11) * 0x1.0p-53;
    p[i] = lo * static_cast<float>(1.0 + 5.0 * u);
  }
}

// ref[i][j] = sum_c (a[i][c] sa(i, c / 128)) (b[j][c] sb[j / 128][c / 128]) in float64, for the rows of
// one group: a, sa at the group's first row, b and sb at its B_g.
__global__ void reference_fp8(const __nv_fp8_e4m3* a, const float* sa, long sa_row, long sa_kb, const __nv_fp8_e4m3* b,
                              const float* sb, int nb, int kb, double* ref, int m, int n, int k, long lda, long ldb) {
  const long i = blockIdx.y, j = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i >= m || j >= n) return;
  double s = 0;
  for (int c = 0; c < k; ++c) {
    const double x = static_cast<double>(static_cast<float>(a[i * lda + c])) * sa[i * sa_row + (c / 128) * sa_kb];
    const double w = static_cast<double>(static_cast<float>(b[j * ldb + c])) * sb[(j / 128) * kb + c / 128];
    s += x * w;
  }
  ref[i * n + j] = s;
}

struct Fp8Case {
  GroupedCase groups;
  bool column_major_scales = false;  // A's scales as [KB][M_total] instead of [M_total][KB]
  bool gather = false;               // A's rows and scales gathered from token rows (row-major scales)
};

Result run_fp8_case(tdist::GroupedGemm& gg, const tdist::GemmTile& tile, const Fp8Case& fc, unsigned long long seed,
                    cudaStream_t stream) {
  const GroupedCase& c = fc.groups;
  std::vector<long long> counts;
  unsigned long long r = seed;
  const std::vector<int64_t> offsets = draw_group_offsets(c, r, counts);
  const long rows = offsets.back(), m_total = std::max(rows + c.extra_rows, 1L);
  const long lda = c.k + 16, ldb = c.k, ldd = ((c.n + 7) / 8) * 8 + 8;  // padded A and D rows
  const int kb = (c.k + 127) / 128, nb = (c.n + 127) / 128;
  const long sa_row = fc.column_major_scales ? 1 : kb, sa_kb = fc.column_major_scales ? m_total : 1;
  __nv_fp8_e4m3 *a = nullptr, *b = nullptr;
  __nv_bfloat16* d = nullptr;
  float *sa = nullptr, *sb = nullptr;
  double *ref = nullptr, *stats = nullptr;
  unsigned long long* counters = nullptr;
  TDIST_CUDA_CHECK(cudaMalloc(&a, m_total * lda));
  TDIST_CUDA_CHECK(cudaMalloc(&b, static_cast<long>(c.groups) * c.n * ldb));
  TDIST_CUDA_CHECK(cudaMalloc(&d, sizeof(__nv_bfloat16) * m_total * ldd));
  TDIST_CUDA_CHECK(cudaMalloc(&sa, sizeof(float) * m_total * kb));
  TDIST_CUDA_CHECK(cudaMalloc(&sb, sizeof(float) * c.groups * nb * kb));
  TDIST_CUDA_CHECK(cudaMalloc(&ref, sizeof(double) * std::max(rows, 1L) * c.n));
  TDIST_CUDA_CHECK(cudaMalloc(&stats, 2 * sizeof(double)));
  TDIST_CUDA_CHECK(cudaMalloc(&counters, 6 * sizeof(unsigned long long)));
  void* offs = upload_offsets(offsets, c.int64_offsets);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // the pageable copies have landed
  // Values up to e4m3's range (448), scales as a quantiser would make them (amax / 448, here random).
  fill_random_e4m3<<<264, 256, 0, stream>>>(a, static_cast<size_t>(m_total) * lda, seed, 448.f);
  fill_random_e4m3<<<264, 256, 0, stream>>>(b, static_cast<size_t>(c.groups) * c.n * ldb, seed + 1, 448.f);
  fill_scales<<<264, 256, 0, stream>>>(sa, static_cast<size_t>(m_total) * kb, seed + 2, 1.f / 448);
  fill_scales<<<264, 256, 0, stream>>>(sb, static_cast<size_t>(c.groups) * nb * kb, seed + 3, 1.f / 4096);
  // Gathered A (the MoE ops' path): rows and scales of random tokens. `a` and `sa` are then written
  // with what the kernel must see (the reference's input), and the gathered copies of the local
  // tokens' rows and scales are poisoned (NaN), so reading a local token from the wrong place shows.
  __nv_fp8_e4m3 *tokens = nullptr, *local = nullptr;
  float *tok_sa = nullptr, *local_sa = nullptr;
  int* token_of_row = nullptr;
  tdist::kernels::gemm::RowGather gather;
  if (fc.gather) {
    const long num_tokens = 50 + rows / 3, ld_tok = c.k + 32;
    const long local_begin = num_tokens / 3, local_rows = num_tokens / 3;
    const std::vector<int> tor = draw_token_of_row(c, offsets, counts, m_total, num_tokens, r);
    TDIST_CUDA_CHECK(cudaMalloc(&tokens, num_tokens * ld_tok));
    TDIST_CUDA_CHECK(cudaMalloc(&local, local_rows * ld_tok));
    TDIST_CUDA_CHECK(cudaMalloc(&tok_sa, sizeof(float) * num_tokens * kb));
    TDIST_CUDA_CHECK(cudaMalloc(&local_sa, sizeof(float) * local_rows * kb));
    TDIST_CUDA_CHECK(cudaMalloc(&token_of_row, sizeof(int) * tor.size()));
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(token_of_row, tor.data(), sizeof(int) * tor.size(), cudaMemcpyHostToDevice, stream));
    fill_random_e4m3<<<264, 256, 0, stream>>>(tokens, static_cast<size_t>(num_tokens) * ld_tok, seed + 4, 448.f);
    fill_scales<<<264, 256, 0, stream>>>(tok_sa, static_cast<size_t>(num_tokens) * kb, seed + 5, 1.f / 448);
    std::vector<unsigned char> host_tokens(num_tokens * ld_tok), host_a(m_total * lda, 0);
    std::vector<float> host_tok_sa(num_tokens * kb), host_sa(m_total * kb, 0.f);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(host_tokens.data(), tokens, host_tokens.size(), cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaMemcpyAsync(host_tok_sa.data(), tok_sa, sizeof(float) * host_tok_sa.size(),
                                     cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    TDIST_CUDA_CHECK(cudaMemcpyAsync(local, host_tokens.data() + local_begin * ld_tok, local_rows * ld_tok,
                                     cudaMemcpyHostToDevice, stream));
    TDIST_CUDA_CHECK(cudaMemcpyAsync(local_sa, host_tok_sa.data() + local_begin * kb, sizeof(float) * local_rows * kb,
                                     cudaMemcpyHostToDevice, stream));
    TDIST_CUDA_CHECK(cudaMemsetAsync(tokens + local_begin * ld_tok, 0x7F, local_rows * ld_tok, stream));  // e4m3 NaN
    TDIST_CUDA_CHECK(cudaMemsetAsync(tok_sa + local_begin * kb, 0xFF, sizeof(float) * local_rows * kb, stream));
    for (long row = 0; row < m_total; ++row) {
      if (tor[row] < 0) continue;  // padding: zero rows and scales
      std::memcpy(&host_a[row * lda], &host_tokens[tor[row] * ld_tok], c.k);
      std::memcpy(&host_sa[row * kb], &host_tok_sa[tor[row] * kb], sizeof(float) * kb);
    }
    TDIST_CUDA_CHECK(cudaMemcpyAsync(a, host_a.data(), host_a.size(), cudaMemcpyHostToDevice, stream));
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(sa, host_sa.data(), sizeof(float) * host_sa.size(), cudaMemcpyHostToDevice, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    gather = {token_of_row,
              local,
              tokens,
              static_cast<unsigned long long>(local_begin),
              static_cast<unsigned long long>(local_rows),
              static_cast<unsigned long long>(ld_tok)};
  }
  const unsigned short poison = 0x7FC1;  // a NaN in bf16
  fill_u16<<<264, 256, 0, stream>>>(reinterpret_cast<unsigned short*>(d), static_cast<size_t>(m_total) * ldd, poison);
  TDIST_CUDA_CHECK(cudaMemsetAsync(stats, 0, 2 * sizeof(double), stream));
  TDIST_CUDA_CHECK(cudaMemsetAsync(counters, 0, 6 * sizeof(unsigned long long), stream));
  for (int g = 0; g < c.groups; ++g) {
    const long r0 = offsets[g], nr = offsets[g + 1] - offsets[g];
    if (nr == 0) continue;
    reference_fp8<<<dim3((c.n + 127) / 128, nr), 128, 0, stream>>>(
        a + r0 * lda, sa + r0 * sa_row, sa_row, sa_kb, b + static_cast<long>(g) * c.n * ldb,
        sb + static_cast<long>(g) * nb * kb, nb, kb, ref + r0 * c.n, static_cast<int>(nr), c.n, c.k, lda, ldb);
  }
  if (rows > 0) abs_max<<<264, 256, 0, stream>>>(ref, static_cast<size_t>(rows) * c.n, stats);
  TDIST_CUDA_CHECK(cudaGetLastError());

  tdist::GroupedGemmFp8Args args;
  args.a = a;
  args.a_scales = sa;
  if (fc.column_major_scales) {
    args.a_scales_row_stride = sa_row;
    args.a_scales_kb_stride = sa_kb;
  }
  args.b = b;
  args.b_scales = sb;
  args.d = d;
  args.offsets = offs;
  args.offsets_type = c.int64_offsets ? tdist::IndexType::kInt64 : tdist::IndexType::kInt32;
  args.m = rows + c.extra_rows;
  args.n = c.n;
  args.k = c.k;
  args.num_groups = c.groups;
  args.lda = lda;
  args.ldb = ldb;
  args.ldd = ldd;
  tdist::GroupedGemmRunOptions o;
  o.tile = tile;
  o.group_m = c.group_m;
  o.first_row = c.first_row;
  o.max_ctas = c.max_ctas;
  if (fc.gather) {
    args.a_gather = gather;
    args.a_scales = tok_sa;
    args.a_scales_local = local_sa;
  }
  gg.run(args, stream, o);
  TDIST_CUDA_CHECK(cudaGetLastError());

  const GroupedCheck check =
      check_grouped_output(d, ref, rows, c.extra_rows, c.n, ldd, poison, stats, counters, stream);
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(d), static_cast<void*>(sa),
                  static_cast<void*>(sb), static_cast<void*>(ref), static_cast<void*>(stats),
                  static_cast<void*>(counters), offs, static_cast<void*>(tokens), static_cast<void*>(local),
                  static_cast<void*>(tok_sa), static_cast<void*>(local_sa), static_cast<void*>(token_of_row)})
    TDIST_CUDA_CHECK(cudaFree(p));
  return {check.ok(rows), check.summary(rows, c.extra_rows)};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  // --small: the four smallest cases, bf16 only (what compute-sanitizer runs).
  const bool small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  int passed = 0, failed = 0;
  try {
    const char* local_rank = std::getenv("LOCAL_RANK");
    TDIST_CUDA_CHECK(cudaSetDevice(local_rank ? std::atoi(local_rank) : 0));
    cudaStream_t stream;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    tdist::Gemm gemm;
    std::printf("GEMM test on %d SMs\n", gemm.num_sms());
    // Runs one case (body returns its Result), prints PASS/FAIL with its time; false when a failure
    // left the CUDA context broken (the run must stop).
    auto check = [&](const char* name, auto&& body) {
      const auto start = std::chrono::steady_clock::now();
      Result r{false, ""};
      try {
        r = body();
      } catch (const std::exception& e) {
        r = {false, e.what()};
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      std::printf("%s %s: %s (%.0f ms)\n", r.ok ? "PASS" : "FAIL", name, r.detail.c_str(), ms);
      std::fflush(stdout);
      (r.ok ? passed : failed)++;
      if (!r.ok && cudaDeviceSynchronize() != cudaSuccess) {
        std::printf("FAIL: the CUDA context is broken (sticky error); stopping\n");
        return false;
      }
      return true;
    };
    std::vector<Case> cases = {
        {128, 256, 64},                          // one tile, one K block
        {1, 8, 8},                               // smallest: one row, K inside one block
        {200, 136, 72},                          // partial tiles everywhere, K = 64 + 8
        {1000, 1000, 1000},                      // K not a multiple of 64
        {257, 513, 8, 8, 8, 8},                  // N odd: one-element tail column; padded lds
        {3000, 1784, 2056, 16, 8, 24, 4, 1500},  // rotated start, groups of 4
        {2048, 2048, 4096, 0, 0, 0, 1, 0, 3},    // 3 CTAs: many tiles each, ring phases wrap
        {4096, 4096, 4096},                      // a full-size check
        {777, 4000, 520, 0, 0, 0, 3, 700, 7},    // rotation + few CTAs + partial tiles
    };
    if (quick) cases.resize(5);
    if (small) cases = {cases[0], cases[1], cases[2], cases[4]};
    unsigned long long seed =
        static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count());
    // Every shipped tile, and the 2-CTA cluster (multicast B) of the 128-row ones: the cases hold pairs
    // that share B, pairs across two n-tiles or groups, and a CTA left without a tile.
    const std::vector<tdist::GemmTile> instances = tdist::detail::PlainGemm::instance_tiles();
    for (tdist::DType dtype : {tdist::DType::kBFloat16, tdist::DType::kFloat16}) {
      if (small && dtype != tdist::DType::kBFloat16) continue;
      for (const tdist::GemmTile& tile : instances) {
        for (const Case& c : cases) {
          char name[200];
          std::snprintf(name, sizeof(name), "%s %s m=%d n=%d k=%d pads=%d/%d/%d group=%d first_row=%ld ctas=%d",
                        tdist::to_string(dtype), tile.name().c_str(), c.m, c.n, c.k, c.pad_a, c.pad_b, c.pad_d,
                        c.group_m, c.first_row, c.max_ctas);
          seed = seed * 6364136223846793005ull + 1442695040888963407ull;
          if (!check(name, [&] {
                return dtype == tdist::DType::kBFloat16 ? run_case<__nv_bfloat16>(gemm, dtype, tile, c, seed, stream)
                                                        : run_case<__half>(gemm, dtype, tile, c, seed, stream);
              })) {
            std::printf("%d passed, %d failed\n", passed, failed);
            return 1;
          }
        }
      }
    }
    // The grouped GEMM.
    tdist::GroupedGemm grouped;
    std::vector<GroupedCase> gcases = {
        {"random groups, a third empty", 8, 256, 128},
        {"one group holds every row", 16, 520, 264, std::vector<int>(16, 0)},
        {"a single group", 1, 136, 72, {1000}},
        {"many small groups, N and K odd multiples of 8", 64, 4104, 2056, {}, 200},
        {"N no multiple of 8, rows past offsets[G], int64 offsets", 12, 100, 520, {}, 400, 77, true},
        {"every group empty", 6, 128, 64, std::vector<int>(6, 0), 0, 130},
        {"rotated start, groups of 3, 5 CTAs", 20, 1032, 1024, {}, 500, 0, false, 1500, 3, 5},
        {"m-tiles in reverse order, 7 CTAs", 10, 776, 256, {}, 500, 64, true, 0, 8, 7, true},
        {"pair order: 0 to 5 m-tiles per group, K 8 mod 16", 40, 1032, 1048, {}, 520, 0, false, 0, 8, 0, false, true},
        {"pair order, rows past offsets[G], 9 CTAs", 11, 264, 520, {}, 300, 200, true, 0, 8, 9, false, true},
    };
    gcases[1].counts[11] = 3000;
    if (quick) gcases.resize(4);
    if (small) gcases = {gcases[0], gcases[2], gcases[5], gcases[8]};
    // The same cases with A gathered through a token index (the MoE ops' path).
    for (size_t i = 0, count = gcases.size(); i < count; ++i) {
      GroupedCase g = gcases[i];
      g.gather = true;
      gcases.push_back(g);
    }
    for (tdist::DType dtype : {tdist::DType::kBFloat16, tdist::DType::kFloat16}) {
      if (small && dtype != tdist::DType::kBFloat16) continue;
      for (const tdist::GemmTile& tile : instances) {
        for (const GroupedCase& c : gcases) {
          char name[240];
          std::snprintf(name, sizeof(name), "grouped%s %s %s G=%d n=%d k=%d (%s)", c.gather ? " gathered-A" : "",
                        tdist::to_string(dtype), tile.name().c_str(), c.groups, c.n, c.k, c.what);
          seed = seed * 6364136223846793005ull + 1442695040888963407ull;
          if (!check(name, [&] {
                return dtype == tdist::DType::kBFloat16
                           ? run_grouped_case<__nv_bfloat16>(grouped, dtype, tile, c, seed, stream)
                           : run_grouped_case<__half>(grouped, dtype, tile, c, seed, stream);
              })) {
            std::printf("%d passed, %d failed\n", passed, failed);
            return 1;
          }
        }
      }
    }
    // The FP8 grouped GEMM (e4m3, block scales, bf16 out), every FP8 tile.
    std::vector<Fp8Case> fcases = {
        {{"random groups, a third empty", 8, 512, 1024}},
        {{"a single group, N no multiple of 8, K no multiple of 128", 1, 200, 400, {1000}}, true},
        {{"many small groups, int64 offsets, rows past offsets[G]", 40, 384, 256, {}, 150, 77, true}},
        {{"rotated start, groups of 3, 3 CTAs (the ring wraps)", 12, 1032, 2048, {}, 500, 0, false, 900, 3, 3}, true},
        {{"every group empty", 5, 128, 128, std::vector<int>(5, 0), 0, 130}},
    };
    if (small) fcases = {fcases[0], fcases[1]};
    // The same cases with A's rows and scales gathered through a token index (row-major scales).
    for (size_t i = 0, count = fcases.size(); i < count; ++i) {
      Fp8Case g = fcases[i];
      g.gather = true;
      g.column_major_scales = false;
      fcases.push_back(g);
    }
    for (const tdist::GemmTile& tile : tdist::fp8_gemm_tiles()) {
      for (const Fp8Case& c : fcases) {
        char name[240];
        std::snprintf(name, sizeof(name), "grouped e4m3%s %s G=%d n=%d k=%d%s (%s)", c.gather ? " gathered-A" : "",
                      tile.name().c_str(), c.groups.groups, c.groups.n, c.groups.k,
                      c.column_major_scales ? " column-major scales" : "", c.groups.what);
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        if (!check(name, [&] { return run_fp8_case(grouped, tile, c, seed, stream); })) {
          std::printf("%d passed, %d failed\n", passed, failed);
          return 1;
        }
      }
    }
    // Grouped argument errors name the argument.
    try {
      tdist::GroupedGemmArgs bad;
      bad.m = 128;
      bad.n = 8;
      bad.k = 8;
      bad.num_groups = 0;
      grouped.run(bad, stream);
      std::printf("FAIL argument error: num_groups = 0 accepted\n");
      ++failed;
    } catch (const tdist::Error& e) {
      const bool ok = std::string(e.what()).find("'num_groups'") != std::string::npos;
      std::printf("%s argument error names num_groups: %s\n", ok ? "PASS" : "FAIL", e.what());
      (ok ? passed : failed)++;
    }

    // Argument errors reach the caller before anything is launched.
    try {
      tdist::GemmArgs bad;
      bad.m = bad.n = 8;
      bad.k = 12;
      gemm.run(bad, stream);
      std::printf("FAIL argument error: k = 12 accepted\n");
      ++failed;
    } catch (const tdist::Error& e) {
      const bool ok = std::string(e.what()).find("'k'") != std::string::npos;
      std::printf("%s argument error names k: %s\n", ok ? "PASS" : "FAIL", e.what());
      (ok ? passed : failed)++;
    }
  } catch (const std::exception& e) {
    std::printf("FAIL setup: %s\n", e.what());
    ++failed;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
