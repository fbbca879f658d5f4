// Tutorial 4, host side: AllGather-GEMM with per-chunk flags (gemm_wait_flags.cu). For several
// shapes (M not a multiple of the tile or, mostly, of the world size; N and K odd multiples of 8),
// fp32 and bf16 inputs, and both transports (copy-engine puts issued here, or the SM put_chunk
// kernel), it runs a few calls back to back and compares each C with a float64 reference of
// allgather(A) x B computed on the host.
//
//   tdistrun -n N -- build/examples/example_04_gemm_wait_flags [--calls=C] [--m=M --n=N --k=K] [--seed=S]
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <tdist/kernels/gemm/tile_scheduler.cuh>
#include "common/tutorial.hpp"
#include "tdist/runtime/stream.hpp"
#include "tdist/runtime/symmetric_heap.hpp"

using namespace tdist;
using device::u64;
namespace ex = tdist::examples;
using tdist::kernels::gemm::RowChunks;

namespace {

constexpr int BLOCK_M = 64, BLOCK_N = 64;  // as in gemm_wait_flags.cu
constexpr unsigned kGemmThreads = 256, kPutThreads = 256;
constexpr unsigned char kPoison = 0xFF;  // a NaN in fp32 and in bf16
constexpr uint64_t kASeedPurpose = 4, kBSeedPurpose = 5;

enum class Dtype { kFp32, kBf16 };
enum class Transport { kCopyEngine, kSmPut };

struct Shape {
  u64 m, n, k;
};

size_t element_bytes(Dtype t) { return t == Dtype::kFp32 ? 4 : 2; }

// float -> bf16, round to nearest even (inputs are finite).
uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A random matrix in [-1, 1): the bytes the device gets, and the same values, exactly, as doubles.
struct Matrix {
  std::vector<unsigned char> bytes;
  std::vector<double> values;
};

Matrix random_matrix(Dtype dtype, u64 elements, uint64_t seed) {
  ex::Rng rng(seed);
  Matrix mat;
  mat.bytes.resize(elements * element_bytes(dtype));
  mat.values.resize(elements);
  for (u64 i = 0; i < elements; ++i) {
    const float f = rng.uniform_pm1();
    if (dtype == Dtype::kFp32) {
      std::memcpy(&mat.bytes[i * 4], &f, 4);
      mat.values[i] = f;
    } else {
      const uint16_t h = to_bf16(f);
      std::memcpy(&mat.bytes[i * 2], &h, 2);
      mat.values[i] = from_bf16(h);
    }
  }
  return mat;
}

// Rank r's chunk of A (rows(r) x K) and rank r's B (K x N) in call `call`.
Matrix a_chunk_of(Dtype dtype, const Shape& s, const RowChunks& split, uint64_t job_seed, int r, u64 call) {
  return random_matrix(dtype, split.rows(r) * s.k, ex::derive_seed(job_seed, r, kASeedPurpose, call));
}
Matrix b_of(Dtype dtype, const Shape& s, uint64_t job_seed, int r, u64 call) {
  return random_matrix(dtype, s.k * s.n, ex::derive_seed(job_seed, r, kBSeedPurpose, call));
}

class Event {
 public:
  Event() { TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  operator cudaEvent_t() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

void run(ex::Context& ctx) {
  World& world = ctx.world;
  const int num_ranks = world.world_size(), rank = world.rank();
  const u64 calls = static_cast<u64>(ctx.options["calls"]);

  std::vector<Shape> shapes = {{5, 8, 8}, {389, 264, 328}, {1031, 520, 1048}};
  const long long m_opt = ctx.options["m"], n_opt = ctx.options["n"], k_opt = ctx.options["k"];
  if (m_opt != 0 || n_opt != 0 || k_opt != 0) {
    TDIST_CHECK_ARG(m_opt > 0 && n_opt > 0 && k_opt > 0, "--m/--n/--k", "give all three, got m=", m_opt, " n=", n_opt,
                    " k=", k_opt);
    shapes = {{static_cast<u64>(m_opt), static_cast<u64>(n_opt), static_cast<u64>(k_opt)}};
  }
  u64 max_a_elements = 0;
  for (const Shape& s : shapes) max_a_elements = std::max(max_a_elements, s.m * s.k);

  // Symmetric buffers; their roles are described in gemm_wait_flags.cu.
  SymmetricHeap& heap = ctx.create_heap(max_a_elements * 4 + (1 << 20));
  auto* a_gathered = heap.allocate_array<unsigned char>(max_a_elements * 4);  // fp32 or bf16 rows
  u64* chunk_arrived = heap.allocate_signals64(num_ranks);
  u64* barrier_pad = heap.allocate_signals64(num_ranks + 2);  // device::barrier_pad_words(num_ranks)

  const auto module = ex::load_tutorial_kernels("04_gemm_wait_flags/gemm_wait_flags.cu");
  const jit::Kernel gemm_fp32 = module->kernel("gemm_wait_flags<float>");
  const jit::Kernel gemm_bf16 = module->kernel("gemm_wait_flags<__nv_bfloat16>");
  const jit::Kernel put_chunk = module->kernel("put_chunk");
  const jit::Kernel start_of_call_barrier = module->kernel("start_of_call_barrier");

  ex::Stream compute, comm;
  Event barrier_passed;
  u64 call = 0;  // flags are raised to the call number; it keeps counting across cases

  for (const Shape& shape : shapes) {
    for (const Dtype dtype : {Dtype::kFp32, Dtype::kBf16}) {
      for (const Transport transport : {Transport::kCopyEngine, Transport::kSmPut}) {
        const RowChunks split{shape.m, num_ranks};
        const size_t es = element_bytes(dtype);
        const u64 my_rows = split.rows(rank), my_offset_bytes = split.begin(rank) * shape.k * es;
        const u64 chunk_bytes = my_rows * shape.k * es;
        const u64 tiles = ((shape.m + BLOCK_M - 1) / BLOCK_M) * ((shape.n + BLOCK_N - 1) / BLOCK_N);
        const unsigned gemm_blocks = static_cast<unsigned>(std::min<u64>(tiles, ctx.device_sm_count));

        const std::string name =
            detail::concat("C = allgather(A) x B, M=", shape.m, " N=", shape.n, " K=", shape.k, ", ",
                           dtype == Dtype::kFp32 ? "fp32" : "bf16", " inputs, ",
                           transport == Transport::kCopyEngine ? "copy-engine puts" : "SM puts", ", ", calls, " calls");
        ctx.report.run(name, [&](ex::Case& check) {
          // This rank's inputs for every call, uploaded up front; every call writes its own C.
          ex::DeviceArray<unsigned char> a_chunks(calls * chunk_bytes), bs(calls * shape.k * shape.n * es);
          ex::DeviceArray<float> cs(calls * shape.m * shape.n);
          const u64 first_call = call + 1;
          for (u64 i = 0; i < calls; ++i) {
            a_chunks.upload(a_chunk_of(dtype, shape, split, ctx.job_seed, rank, first_call + i).bytes, i * chunk_bytes);
            bs.upload(b_of(dtype, shape, ctx.job_seed, rank, first_call + i).bytes, i * shape.k * shape.n * es);
          }
          cs.poison(kPoison);
          // NaN in a_gathered: a tile that read A before its flag would produce NaN.
          TDIST_CUDA_CHECK(cudaMemset(a_gathered, kPoison, shape.m * shape.k * es));
          ex::sync_all(world, "a_gathered poisoned");  // before any peer writes into it

          for (u64 i = 0; i < calls; ++i) {
            ++call;
            const unsigned char* my_chunk = a_chunks.data() + i * chunk_bytes;
            jit::launch(start_of_call_barrier, {.grid = {1}, .block = {128}, .stream = compute},
                        jit::make_args(heap.view(), barrier_pad));
            TDIST_CUDA_CHECK(cudaEventRecord(barrier_passed, compute));
            TDIST_CUDA_CHECK(cudaStreamWaitEvent(comm, barrier_passed, 0));
            if (transport == Transport::kCopyEngine) {
              // One copy per peer, this rank first; each followed in stream order by a flag write
              // on that peer, which the driver orders after the copy's data.
              for (int j = 0; j < num_ranks; ++j)
                put_signal_async(heap, a_gathered + my_offset_bytes, my_chunk, chunk_bytes, chunk_arrived + rank, call,
                                 (rank + j) % num_ranks, comm);
            } else {
              jit::launch(
                  put_chunk, {.grid = {static_cast<unsigned>(num_ranks)}, .block = {kPutThreads}, .stream = comm},
                  jit::make_args(heap.view(), a_gathered, my_chunk, my_offset_bytes, chunk_bytes, chunk_arrived, call));
            }
            jit::launch(dtype == Dtype::kFp32 ? gemm_fp32 : gemm_bf16,
                        {.grid = {gemm_blocks}, .block = {kGemmThreads}, .stream = compute},
                        jit::make_args(static_cast<const void*>(a_gathered),
                                       static_cast<const void*>(bs.data() + i * shape.k * shape.n * es),
                                       cs.data() + i * shape.m * shape.n, shape.m, shape.n, shape.k,
                                       static_cast<const u64*>(chunk_arrived), call, rank, num_ranks));
          }
          ex::sync_all(world, "calls done");

          // Reference in float64: gather A from every rank's chunk, multiply by this rank's B. The
          // device accumulates in fp32 (products of bf16 or fp32 inputs rounded at most once each
          // step), so |C - ref| <= gamma_K * sum_k |a||b| with gamma_K ~ K * 2^-24; twice that is
          // the bound. Stale or missing rows of A give errors of order |ref| itself, far above it.
          const std::vector<float> got = cs.download();
          const double tolerance = 2.0 * static_cast<double>(shape.k) * std::ldexp(1.0, -24);
          for (u64 i = 0; i < calls; ++i) {
            std::vector<double> a(shape.m * shape.k);
            for (int r = 0; r < num_ranks; ++r) {
              const Matrix chunk = a_chunk_of(dtype, shape, split, ctx.job_seed, r, first_call + i);
              std::copy(chunk.values.begin(), chunk.values.end(), a.begin() + split.begin(r) * shape.k);
            }
            const std::vector<double> b = b_of(dtype, shape, ctx.job_seed, rank, first_call + i).values;
            std::vector<double> ref(shape.n), magnitude(shape.n);
            u64 bad = 0;
            double worst = 0;
            for (u64 row = 0; row < shape.m; ++row) {
              std::fill(ref.begin(), ref.end(), 0.0);
              std::fill(magnitude.begin(), magnitude.end(), 0.0);
              for (u64 kk = 0; kk < shape.k; ++kk) {
                const double av = a[row * shape.k + kk];
                const double* b_row = &b[kk * shape.n];
                for (u64 col = 0; col < shape.n; ++col) {
                  ref[col] += av * b_row[col];
                  magnitude[col] += std::abs(av * b_row[col]);
                }
              }
              for (u64 col = 0; col < shape.n; ++col) {
                const double value = got[(i * shape.m + row) * shape.n + col];
                const double error = std::abs(value - ref[col]), bound = tolerance * magnitude[col] + 1e-30;
                worst = std::max(worst, error / bound);
                if (!(error <= bound) && bad++ < 3)  // !(<=) also catches NaN (poison left in place)
                  check.expect(false, "call ", first_call + i, ": C[", row, "][", col, "] = ", value, ", reference ",
                               ref[col], " (error bound ", bound, ", rows of rank ", split.chunk_of(row), ")");
              }
            }
            check.expect(bad == 0, "call ", first_call + i, ": ", bad, " of ", shape.m * shape.n,
                         " elements outside the error bound");
            if (rank == 0 && i + 1 == calls && bad == 0)
              std::printf("  largest error / bound on rank 0: %.3g\n", worst);
          }
        });
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const ex::TutorialInfo info{
      "example_04_gemm_wait_flags",
      "Tutorial 4: AllGather-GEMM core. A's row chunks arrive in every rank's gathered A with one flag\n"
      "per chunk; GEMM tiles wait for the flags of the chunks holding their rows, starting at the local chunk.",
      {{"calls", 2, 1, 100, "calls per case, launched back to back"},
       {"m", 0, 0, 1 << 16, "rows of A (with --n and --k: run this shape only)"},
       {"n", 0, 0, 1 << 16, "columns of B and C"},
       {"k", 0, 0, 1 << 16, "columns of A, rows of B"}}};
  return ex::run_tutorial(argc, argv, info, run);
}
