// Faults injected into a running job: the last rank skips an operation the others call. The others'
// device waits must time out (2 s here), abort and return; each of them must then see
// DeviceTimeoutError naming its rank, keep a usable CUDA context (its data copies out), and have
// tdist refuse further launches until the fault is cleared. The skipping rank sees no fault.
// Every case builds its own op objects: after an abort the flags of the old ones are out of step.
// First, with TDIST_CHECK_CALLS unset (call checking's default, first): calls that differ between
// ranks (count, method, op, buffer kind, an overlapped op's N) raise on every rank within a second,
// naming each rank's call; under always, so does a call seen before; a differing TDIST_CHECK_CALLS
// fails World's construction; a rank absent from a comparison (it runs a call it has seen before) makes
// the others raise TimeoutError naming their call at the device wait timeout, not the host timeout.
// The fault cases then run with call checking off: the collectives, the
// fused AllGather-GEMM, the MoE tensor-parallel pair (chunked), the EP buffer's low-latency and
// high-throughput dispatch and combine, and the distributed flash-decode. In the MoE, EP combine and
// high-throughput and flash-decode cases every rank first makes a matching call (kernels compiled,
// flags used once), so that the time measured is the wait's; a combine's case has every rank dispatch.
#include <cuda_bf16.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "harness.cuh"
#include "scoped_env.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/ep.hpp"
#include "tdist/ops/flash_decode.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/ops/moe.hpp"
#include "tdist/runtime/device_fault.hpp"

using namespace tdist;

namespace {

constexpr double kTimeoutSeconds = 2.0;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// On a rank that took part: the stream's work ends without a CUDA error within a few timeouts, the
// fault names this rank, the data still copies out, and the next launch of `again` throws at once.
void expect_aborted(World& world, cudaStream_t stream, std::chrono::steady_clock::time_point start,
                    const void* data, size_t bytes, const std::function<void()>& again) {
  const cudaError_t result = cudaStreamSynchronize(stream);
  const double seconds = seconds_since(start);
  TDIST_CHECK(result == cudaSuccess, "the aborted op's kernels ended with ", cudaGetErrorName(result),
              " (the context should survive)");
  TDIST_CHECK(seconds >= 0.9 * kTimeoutSeconds && seconds < 15 * kTimeoutSeconds, "the op returned after ", seconds,
              " s, expected about one ", kTimeoutSeconds, " s timeout");
  std::string message;
  try {
    check_device_faults();
  } catch (const DeviceTimeoutError& e) {
    message = e.what();
  }
  TDIST_CHECK(!message.empty(), "no DeviceTimeoutError after the peer skipped the op");
  const std::string rank_text = "on rank " + std::to_string(world.rank());
  TDIST_CHECK(message.find(rank_text) != std::string::npos, "the error does not name '", rank_text, "': ", message);
  std::vector<char> host(bytes);
  TDIST_CUDA_CHECK(cudaMemcpy(host.data(), data, bytes, cudaMemcpyDeviceToHost));  // a checkpoint still saves
  bool refused = false;
  try {
    again();
  } catch (const DeviceTimeoutError&) {
    refused = true;
  }
  TDIST_CHECK(refused, "a launch after the fault was not refused");
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// Runs `call` on every rank but the last, checks the outcome on each, clears the fault, and meets.
void skip_on_last_rank(World& world, cudaStream_t stream, const std::string& tag, const void* data, size_t bytes,
                       const std::function<void()>& call) {
  const bool skips = world.rank() == world.world_size() - 1;
  std::string failure;
  try {
    if (!skips) {
      const auto start = std::chrono::steady_clock::now();
      try {
        call();
      } catch (const DeviceTimeoutError&) {
        // A launch later in the same call (one behind a JIT compile longer than the timeout) found
        // the fault already recorded: the op raised at once, as it should. The checks below still hold
        // (check_device_faults raises until the fault is cleared).
      }
      expect_aborted(world, stream, start, data, bytes, call);
    } else {
      TDIST_CHECK(!device_fault_message(), "the rank that skipped the op has a fault: ", *device_fault_message());
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  clear_device_fault();
  world.barrier(tag);
  if (!failure.empty()) TDIST_FAIL(failure);
}

// Device memory holding `host`.
template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer d(host.size() * sizeof(T));
  test::copy_to_device(d.get(), host.data(), host.size() * sizeof(T));
  return d;
}

// `count` bf16 values in [-0.5, 0.5), a pattern of `seed`: finite inputs (what they compute is not checked).
DeviceBuffer bf16_values(size_t count, unsigned seed) {
  std::vector<__nv_bfloat16> host(count);
  for (size_t i = 0; i < count; ++i)
    host[i] = __float2bfloat16(static_cast<float>((i * 2654435761u + seed * 40503u) % 1024u) / 1024.0f - 0.5f);
  return upload(host);
}

// Top-k ids of `tokens` tokens, `topk` distinct experts each: token t's slot j holds (t + j) % experts.
template <typename Id>
std::vector<Id> distinct_ids(int64_t tokens, int topk, int experts) {
  std::vector<Id> ids(static_cast<size_t>(tokens * topk));
  for (int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < topk; ++j) ids[t * topk + j] = static_cast<Id>((t + j) % experts);
  return ids;
}

// Op objects of the faulted cases, kept to the end whatever happens: destroying them is collective
// (their symmetric memory goes back to the heap), and the ranks part ways in these cases.
template <typename T, typename... Args>
T& keep(std::vector<std::shared_ptr<void>>& kept, Args&&... args) {
  auto p = std::make_shared<T>(std::forward<Args>(args)...);
  kept.push_back(p);
  return *p;
}

}  // namespace

int main() {
  setenv("TDIST_WAIT_TIMEOUT_S", "2", 1);  // read when the op's kernels load
  unsetenv("TDIST_WAIT_TIMEOUT_ACTION");   // the default: abort
  unsetenv("TDIST_CHECK_CALLS");           // the default: first
  World world;
  test::Suite suite(world);
  if (world.world_size() < 2) {
    std::printf("test_device_faults needs at least 2 ranks (tdistrun -n 2)\n");
    return 2;
  }
  SymmetricHeap heap(world, size_t{1} << 30);
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int n = world.world_size();
  const size_t count = 1 << 16;

  // Call checking, in the default mode (TDIST_CHECK_CALLS unset: first): mismatched calls raise
  // tdist::Error on every rank within a second, naming each rank's call, before anything is
  // launched; a mismatch is never remembered as seen. Run first, while every rank has seen the same
  // calls (none).
  const int last = n - 1;
  auto expect_mismatch = [&](const std::function<void()>& call, const std::vector<std::string>& parts) {
    world.barrier("faults: before a mismatched call");  // the ranks start together: the time is the check's
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      call();
    } catch (const DeviceTimeoutError& e) {
      TDIST_FAIL("a device timeout instead of the call check's error: ", e.what());
    } catch (const Error& e) {
      error = e.what();
    }
    const double seconds = seconds_since(start);
    TDIST_CHECK(!error.empty(), "mismatched calls ran without an error");
    for (const std::string& part : parts)
      TDIST_CHECK(error.find(part) != std::string::npos, "the error lacks '", part, "': ", error);
    TDIST_CHECK(seconds < 1.0, "the mismatch was reported after ", seconds, " s, expected within 1 s");
    TDIST_CHECK(!device_fault_message(),
                "a device fault after the call check refused the call: ", *device_fault_message());
  };
  const std::string last_is = "rank " + std::to_string(last) + "=";
  const std::string f32 = to_string(DType::kFloat32);
  {
    auto coll = std::make_unique<Collectives>(world, heap, count * sizeof(float));
    auto* in = heap.allocate_array<float>(count);
    auto* out = heap.allocate_array<float>(count);
    suite.run("call checking is on by default (TDIST_CHECK_CALLS unset: first)", [&] {
      TDIST_CHECK(world.call_check_mode() == CallCheckMode::kFirst, "the default mode is ",
                  to_string(world.call_check_mode()), ", expected first");
    });
    suite.run("call checking (first): all_reduce with a different count on rank " + std::to_string(last) +
                  " raises on every rank, naming both counts",
              [&] {
                const size_t remembered = world.call_checker().remembered();
                const size_t mine = world.rank() == last ? 1008 : 1000;
                expect_mismatch(
                    [&] { coll->all_reduce(in, out, mine, DType::kFloat32, stream); },
                    {"rank 0=all_reduce(count=1000,", last_is + "all_reduce(count=1008,", "TDIST_CHECK_CALLS"});
                TDIST_CHECK(world.call_checker().remembered() == remembered, "a mismatched call was remembered");
              });
    suite.run(
        "call checking (first): one_shot on some ranks, two_shot on rank " + std::to_string(last) +
            " raises on every rank, naming both methods",
        [&] {
          const AllReduceMethod mine = world.rank() == last ? AllReduceMethod::kTwoShot : AllReduceMethod::kOneShot;
          expect_mismatch([&] { coll->all_reduce(in, out, count, DType::kFloat32, stream, mine); },
                          {"rank 0=all_reduce(count=" + std::to_string(count) + ", " + f32 + ", method one_shot",
                           last_is + "all_reduce(count=" + std::to_string(count) + ", " + f32 + ", method two_shot"});
        });
    suite.run("call checking (first): all_reduce on some ranks, all_gather on rank " + std::to_string(last) +
                  " raises on every rank",
              [&] {
                expect_mismatch(
                    [&] {
                      if (world.rank() == last)
                        coll->all_gather(in, out, count / n, DType::kFloat32, stream);
                      else
                        coll->all_reduce(in, out, count, DType::kFloat32, stream);
                    },
                    {"rank 0=all_reduce(", last_is + "all_gather("});
              });
    suite.run(
        "call checking (first): an ordinary input on rank " + std::to_string(last) +
            ", a symmetric one elsewhere, raises naming both kinds",
        [&] {
          float* plain = nullptr;
          TDIST_CUDA_CHECK(cudaMalloc(&plain, count * sizeof(float)));
          std::string failure;
          try {
            expect_mismatch(
                [&] {
                  coll->all_reduce(world.rank() == last ? plain : in, out, count, DType::kFloat32, stream,
                                   AllReduceMethod::kOneShot);
                },
                {"rank 0=all_reduce(count=" + std::to_string(count) + ", " + f32 + ", method one_shot, in symmetric",
                 last_is + "all_reduce(count=" + std::to_string(count) + ", " + f32 +
                     ", method one_shot, in ordinary"});
          } catch (const std::exception& e) {
            failure = e.what();
          }
          TDIST_CUDA_CHECK(cudaFree(plain));
          if (!failure.empty()) TDIST_FAIL(failure);
        });
    // Input: (i % 97) + rank on each rank; the sum over n ranks is n * (i % 97) + n(n-1)/2, exact in
    // float32. The output is poisoned first.
    auto run_matching = [&](AllReduceMethod method) {
      std::vector<float> host(count);
      for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>((i % 97) + world.rank());
      test::copy_to_device(in, host.data(), count * sizeof(float));
      tdist::test::fill_device(out, 0xff, count * sizeof(float));
      coll->all_reduce(in, out, count, DType::kFloat32, stream, method);
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
      TDIST_CUDA_CHECK(cudaMemcpy(host.data(), out, count * sizeof(float), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < count; ++i) {
        const float want = static_cast<float>(n * (i % 97) + n * (n - 1) / 2);
        TDIST_CHECK(host[i] == want, "all_reduce under call checking: element ", i, " is ", host[i], ", expected ",
                    want);
      }
    };
    suite.run("call checking (first): matching calls run and are correct; a signature is compared once", [&] {
      const size_t remembered = world.call_checker().remembered();
      run_matching(AllReduceMethod::kOneShot);
      TDIST_CHECK(world.call_checker().remembered() == remembered + 1, "after the first matching call ",
                  world.call_checker().remembered(), " signatures are remembered, expected ", remembered + 1);
      run_matching(AllReduceMethod::kOneShot);
      TDIST_CHECK(world.call_checker().remembered() == remembered + 1, "the second call of a signature added one");
    });
    suite.run("call checking (always): a count differing on rank " + std::to_string(last) +
                  " in a call seen before on the others raises on every rank",
              [&] {
                const ScopedCallCheckMode always(world, CallCheckMode::kAlways);
                run_matching(AllReduceMethod::kOneShot);  // seen: compared again under always, and correct
                const size_t mine = world.rank() == last ? count - 16 : count;
                expect_mismatch(
                    [&] { coll->all_reduce(in, out, mine, DType::kFloat32, stream, AllReduceMethod::kOneShot); },
                    {"rank 0=all_reduce(count=" + std::to_string(count) + ",",
                     last_is + "all_reduce(count=" + std::to_string(count - 16) + ","});
              });
    suite.run("call checking (first): AllGather-GEMM with a different N on rank " + std::to_string(last) +
                  " raises on every rank, naming both",
              [&] {
                const int64_t m = 64 * n, k = 256, nn = world.rank() == last ? 136 : 128;
                AllGatherGemm op(world, heap, AllGatherGemmConfig{m, k, DType::kBFloat16});
                __nv_bfloat16 *a = nullptr, *b = nullptr, *d = nullptr;
                TDIST_CUDA_CHECK(cudaMalloc(&a, m / n * k * sizeof(*a)));
                TDIST_CUDA_CHECK(cudaMalloc(&b, nn * k * sizeof(*b)));
                TDIST_CUDA_CHECK(cudaMalloc(&d, m * nn * sizeof(*d)));
                const std::string call =
                    std::string("overlap ") + to_string(OverlapComm::kGatherA) + "(m=" + std::to_string(m) + ", n=";
                const std::string tail = ", k=" + std::to_string(k) + ", " + to_string(DType::kBFloat16) + ", method " +
                                         to_string(OverlapMethod::kFused) + ")";
                std::string failure;
                try {
                  expect_mismatch(
                      [&] {
                        op.run(AllGatherGemmArgs{a, b, d, nullptr, m, nn}, stream, OverlapMethod::kFused);
                      },
                      {"rank 0=" + call + "128" + tail, last_is + call + "136" + tail});
                } catch (const std::exception& e) {
                  failure = e.what();
                }
                TDIST_CUDA_CHECK(cudaFree(a));
                TDIST_CUDA_CHECK(cudaFree(b));
                TDIST_CUDA_CHECK(cudaFree(d));
                if (!failure.empty()) TDIST_FAIL(failure);
              });
    test::sync_all(world, "faults: call checks done");
  }
  suite.run(
      "a call check setting that differs on rank " + std::to_string(last) + " fails every rank at World construction",
      [&] {
        std::string error;
        {
          test::ScopedEnv env(kCheckCallsEnv, world.rank() == last ? "off" : "first");
          try {
            World wrapped(world.comm());  // compares TDIST_CHECK_CALLS through NCCL
          } catch (const Error& e) {
            error = e.what();
          }
        }
        TDIST_CHECK(error.find("TDIST_CHECK_CALLS") != std::string::npos &&
                        error.find("rank 0=first") != std::string::npos &&
                        error.find(last_is + "off") != std::string::npos,
                    "expected an error naming each rank's TDIST_CHECK_CALLS, got: '", error, "'");
        world.barrier("faults: call check settings compared");
      });

  // The faults below have the last rank skip an op: with call checking on, the others would wait for
  // it in the comparison (host timeout) instead of in the op's device waits, which these cases test.
  world.set_call_check_mode(CallCheckMode::kOff);

  // Collectives: every kernel method, each with objects of its own.
  std::vector<std::unique_ptr<Collectives>> retired;  // kept: peers may still write into their buffers
  for (AllReduceMethod method : {AllReduceMethod::kOneShot, AllReduceMethod::kTwoShot, AllReduceMethod::kLowLatency,
                                 AllReduceMethod::kLowLatency128}) {
    const std::string name = std::string("all_reduce ") + to_string(method) + " with rank " + std::to_string(n - 1) +
                             " absent: the others abort, raise and keep their context";
    suite.run(name, [&] {
      // Kept to the end whatever happens: destroying it is collective, and the ranks part ways here.
      retired.push_back(std::make_unique<Collectives>(world, heap, count * sizeof(float)));
      Collectives* coll = retired.back().get();
      auto* in = heap.allocate_array<float>(count);
      auto* out = heap.allocate_array<float>(count);
      test::fill_pattern(in, count * sizeof(float), test::fresh_seed(world.rank()), stream);
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
      world.barrier("faults: collectives ready");
      skip_on_last_rank(world, stream, name, in, count * sizeof(float),
                        [&] { coll->all_reduce(in, out, count, DType::kFloat32, stream, method); });
    });
  }

  // The fused AllGather-GEMM (its waits sit inside the GEMM kernel).
  std::vector<std::unique_ptr<AllGatherGemm>> retired_gemms;
  suite.run("fused AllGather-GEMM with rank " + std::to_string(n - 1) + " absent: the others abort and raise", [&] {
    const int64_t m = 256 * n, k = 512, nn = 384;
    retired_gemms.push_back(std::make_unique<AllGatherGemm>(world, heap, AllGatherGemmConfig{m, k, DType::kBFloat16}));
    AllGatherGemm* op = retired_gemms.back().get();
    __nv_bfloat16 *a = nullptr, *b = nullptr, *d = nullptr;
    TDIST_CUDA_CHECK(cudaMalloc(&a, m / n * k * sizeof(*a)));
    TDIST_CUDA_CHECK(cudaMalloc(&b, nn * k * sizeof(*b)));
    TDIST_CUDA_CHECK(cudaMalloc(&d, m * nn * sizeof(*d)));
    test::fill_pattern(a, m / n * k * sizeof(*a), 1, stream);
    test::fill_pattern(b, nn * k * sizeof(*b), 2, stream);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: ag_gemm ready");
    const AllGatherGemmArgs args{a, b, d, nullptr, m, nn};
    skip_on_last_rank(world, stream, "faults: ag_gemm", a, m / n * k * sizeof(*a),
                      [&] { op->run(args, stream, OverlapMethod::kFused); });
  });

  // Expert-parallel dispatch (low latency): its receivers wait for every rank's count flags.
  std::vector<std::unique_ptr<EpBuffer>> retired_ep;
  suite.run("EP low-latency dispatch with rank " + std::to_string(n - 1) + " absent: the others abort and raise", [&] {
    const EpConfig cfg{.max_tokens = 16, .hidden = 256, .num_experts = 2 * n, .topk = 2};
    retired_ep.push_back(std::make_unique<EpBuffer>(world, heap, cfg));
    EpBuffer* ep = retired_ep.back().get();
    __nv_bfloat16* x = nullptr;
    int64_t* idx = nullptr;
    TDIST_CUDA_CHECK(cudaMalloc(&x, cfg.max_tokens * cfg.hidden * sizeof(*x)));
    TDIST_CUDA_CHECK(cudaMalloc(&idx, cfg.max_tokens * cfg.topk * sizeof(*idx)));
    test::fill_pattern(x, cfg.max_tokens * cfg.hidden * sizeof(*x), 3, stream);
    std::vector<int64_t> ids(cfg.max_tokens * cfg.topk);
    for (int64_t t = 0; t < cfg.max_tokens; ++t)
      for (int j = 0; j < cfg.topk; ++j) ids[t * cfg.topk + j] = (t + j) % cfg.num_experts;
    test::copy_to_device(idx, ids.data(), ids.size() * sizeof(int64_t));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: ep ready");
    skip_on_last_rank(world, stream, "faults: ep", x, cfg.max_tokens * cfg.hidden * sizeof(*x), [&] {
      ep->ll_dispatch({.x = x, .topk_idx = idx, .num_tokens = cfg.max_tokens}, stream);
    });
  });

  std::vector<std::shared_ptr<void>> kept;
  const std::string absent = " with rank " + std::to_string(n - 1) + " absent: the others abort and raise";

  // MoE AllGather + grouped GEMM, chunked (baseline runs an NCCL AllGather, which has no device wait
  // timeout): its waits are begin_call's barrier and the wait for each peer's chunk flag.
  suite.run("MoE AllGather + grouped GEMM (chunked)" + absent, [&] {
    const int64_t m = 301, k = 136, nn = 200;
    const int experts = 6, topk = 2;
    auto& op = keep<MoeAgGroupGemm>(kept, world, heap, MoeConfig{.max_m = m, .k = k, .experts = experts, .topk = topk});
    const int64_t rows = m / n + (world.rank() < m % n ? 1 : 0);
    const DeviceBuffer x = bf16_values(static_cast<size_t>(rows * k), 1);
    const DeviceBuffer ids = upload(distinct_ids<int>(m, topk, experts));  // the same on every rank
    const DeviceBuffer w = bf16_values(static_cast<size_t>(experts * nn * k), 2 + world.rank());
    const DeviceBuffer d(static_cast<size_t>(moe_capacity(m, topk, experts) * nn) * sizeof(__nv_bfloat16));
    const MoeAgGroupGemmArgs args{.a_local = x.get(), .topk_ids = ids.get<int>(), .b = w.get(), .d = d.get(), .m = m,
                                  .n = nn};
    op.run(args, stream, OverlapMethod::kChunked);  // every rank
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: moe ag ready");
    skip_on_last_rank(world, stream, "faults: moe ag", x.get(), rows * k * sizeof(__nv_bfloat16),
                      [&] { op.run(args, stream, OverlapMethod::kChunked); });
  });

  // MoE grouped GEMM + ReduceScatter, chunked: begin_call's barrier, then the wait for every peer's
  // partial of this rank's tokens.
  suite.run("MoE grouped GEMM + ReduceScatter (chunked)" + absent, [&] {
    const int64_t m = 301, k = 200, nn = 136;
    const int experts = 10, topk = 2;
    auto& op = keep<MoeGroupGemmRs>(kept, world, heap,
                                    MoeConfig{.max_m = m, .max_n = nn, .experts = experts, .topk = topk});
    MoeRouter router(m, topk, experts, n, world.rank());
    const DeviceBuffer ids = upload(distinct_ids<int>(m, topk, experts));
    const MoeRouting& routing = router.route(ids.get<int>(), m, stream);
    const DeviceBuffer h = bf16_values(static_cast<size_t>(routing.capacity * k), 3 + world.rank());
    const DeviceBuffer w = bf16_values(static_cast<size_t>(experts * nn * k), 4 + world.rank());
    const DeviceBuffer weights = upload(std::vector<float>(static_cast<size_t>(m * topk), 0.5f));
    const int64_t rows = m / n + (world.rank() < m % n ? 1 : 0);
    const DeviceBuffer d(static_cast<size_t>(rows * nn) * sizeof(__nv_bfloat16));
    const MoeGroupGemmRsArgs args{.h = h.get(), .b = w.get(), .topk_weights = weights.get<float>(),
                                  .routing = &routing, .d = d.get(), .m = m, .n = nn, .k = k};
    op.run(args, stream, OverlapMethod::kChunked);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: moe rs ready");
    skip_on_last_rank(world, stream, "faults: moe rs", h.get(), routing.capacity * k * sizeof(__nv_bfloat16),
                      [&] { op.run(args, stream, OverlapMethod::kChunked); });
  });

  // The EP buffer's other calls: the low-latency combine, the high-throughput dispatch and combine.
  const int64_t ep_tokens = 13;
  auto ep_config = [&](EpMode mode) {
    return EpConfig{.max_tokens = 16, .hidden = 256, .num_experts = 2 * n, .topk = 2, .mode = mode};
  };
  suite.run("EP low-latency combine" + absent, [&] {
    const EpConfig cfg = ep_config(EpMode::kLowLatency);
    auto& ep = keep<EpBuffer>(kept, world, heap, cfg);
    const DeviceBuffer x = bf16_values(static_cast<size_t>(ep_tokens * cfg.hidden), 5 + world.rank());
    const DeviceBuffer idx = upload(distinct_ids<int64_t>(ep_tokens, cfg.topk, cfg.num_experts));
    const DeviceBuffer weights = upload(std::vector<float>(static_cast<size_t>(ep_tokens * cfg.topk), 0.5f));
    const DeviceBuffer y = bf16_values(
        static_cast<size_t>(cfg.num_experts / n * n * cfg.max_tokens * cfg.hidden), 6 + world.rank());
    const DeviceBuffer out(static_cast<size_t>(ep_tokens * cfg.hidden) * sizeof(__nv_bfloat16));
    const EpLlDispatchArgs dispatch{.x = x.get(), .topk_idx = idx.get<int64_t>(), .num_tokens = ep_tokens};
    const EpLlCombineArgs combine{.y = y.get(), .topk_idx = idx.get<int64_t>(), .topk_weights = weights.get<float>(),
                                  .out = out.get()};
    ep.ll_combine(combine, ep.ll_dispatch(dispatch, stream), stream);  // every rank: a whole round
    const EpLlHandle handle = ep.ll_dispatch(dispatch, stream);        // every rank: the combine's dispatch
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: ep ll combine ready");
    skip_on_last_rank(world, stream, "faults: ep ll combine", x.get(), ep_tokens * cfg.hidden * sizeof(__nv_bfloat16),
                      [&] { ep.ll_combine(combine, handle, stream); });
  });

  auto ht_case = [&](bool skip_combine) {
    const EpConfig cfg = ep_config(EpMode::kHighThroughput);
    auto& ep = keep<EpBuffer>(kept, world, heap, cfg);
    const DeviceBuffer x = bf16_values(static_cast<size_t>(ep_tokens * cfg.hidden), 7 + world.rank());
    const DeviceBuffer idx = upload(distinct_ids<int64_t>(ep_tokens, cfg.topk, cfg.num_experts));
    const DeviceBuffer weights = upload(std::vector<float>(static_cast<size_t>(ep_tokens * cfg.topk), 0.5f));
    const DeviceBuffer out(static_cast<size_t>(ep_tokens * cfg.hidden) * sizeof(__nv_bfloat16));
    const EpHtDispatchArgs dispatch{.x = x.get(), .topk_idx = idx.get<int64_t>(), .topk_weights = weights.get<float>(),
                                    .num_tokens = ep_tokens};
    EpHtHandle handle = ep.ht_dispatch(dispatch, stream);  // every rank: a whole round
    const DeviceBuffer y = bf16_values(static_cast<size_t>(handle.max_expert_rows * cfg.hidden), 8 + world.rank());
    const EpHtCombineArgs combine{.y = y.get(), .topk_idx = idx.get<int64_t>(), .out = out.get()};
    ep.ht_combine(combine, handle, stream);
    if (skip_combine) handle = ep.ht_dispatch(dispatch, stream);  // every rank: the combine's dispatch
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: ep ht ready");
    skip_on_last_rank(world, stream, "faults: ep ht", x.get(), ep_tokens * cfg.hidden * sizeof(__nv_bfloat16), [&] {
      if (skip_combine)
        ep.ht_combine(combine, handle, stream);
      else
        ep.ht_dispatch(dispatch, stream);
    });
  };
  suite.run("EP high-throughput dispatch" + absent, [&] { ht_case(false); });
  suite.run("EP high-throughput combine" + absent, [&] { ht_case(true); });

  // Sequence-parallel flash-decode: the merge waits for every rank's low-latency lines.
  suite.run("distributed flash_decode" + absent, [&] {
    const int64_t batch = 3, q_heads = 8, kv_heads = 2, head_dim = 128, capacity = 40;
    auto& fd = keep<DistributedFlashDecode>(
        kept, world, heap, DistributedFlashDecodeConfig{.max_batch = batch, .q_heads = q_heads, .head_dim = head_dim});
    const DeviceBuffer q = bf16_values(static_cast<size_t>(batch * q_heads * head_dim), 9);  // the same on every rank
    const size_t cache = static_cast<size_t>(batch * capacity * kv_heads * head_dim);
    const DeviceBuffer k = bf16_values(cache, 10 + world.rank()), v = bf16_values(cache, 11 + world.rank());
    // This rank's part of each sequence: all of the cache, none, and a few tokens.
    const DeviceBuffer lens = upload(std::vector<int32_t>{int32_t(capacity), 0, 17 + world.rank() % 8});
    const DeviceBuffer out(static_cast<size_t>(batch * q_heads * head_dim) * sizeof(__nv_bfloat16));
    const DeviceBuffer lse(static_cast<size_t>(batch * q_heads) * sizeof(float));
    FlashDecodeArgs a;
    a.dtype = DType::kBFloat16;
    a.batch = batch;
    a.q_heads = q_heads;
    a.kv_heads = kv_heads;
    a.head_dim = head_dim;
    a.q = q.get();
    a.k_cache = k.get();
    a.v_cache = v.get();
    a.num_pages = batch;  // contiguous: one "page" of `capacity` tokens per sequence
    a.page_size = capacity;
    a.seq_lens = lens.get<int32_t>();
    a.out = out.get();
    a.lse = lse.get<float>();
    a.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    fd.run(a, stream);  // every rank
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    world.barrier("faults: flash_decode ready");
    skip_on_last_rank(world, stream, "faults: flash_decode", q.get(), batch * q_heads * head_dim * sizeof(__nv_bfloat16),
                      [&] { fd.run(a, stream); });
  });

  suite.run("a method setting that differs on rank " + std::to_string(last) + " fails every rank at construction", [&] {
    test::ScopedEnv env(kAllReduceMethodEnv, world.rank() == last ? "ll" : "one_shot");
    std::string error;
    try {
      Collectives coll(world, heap, 4096);
    } catch (const Error& e) {
      error = e.what();
    }
    TDIST_CHECK(error.find("TDIST_ALLREDUCE_METHOD") != std::string::npos && error.find("one_shot") != std::string::npos &&
                    error.find("ll|") != std::string::npos,
                "expected an error naming the differing settings, got: '", error, "'");
    world.barrier("faults: settings checked");
  });

  // Call checking (first) with a rank absent from the comparison: the last rank runs an all_reduce it
  // has seen (no comparison; its kernels wait for the others), the others one that is new to them
  // (they wait in the comparison). They must give up at the device wait timeout, not the host
  // timeout, with a TimeoutError naming their call, and launch nothing; the last rank's kernels abort.
  // Last of all: the comparison that timed out leaves the World's store collectives one call out of
  // step, which the last rank then makes up with a comparison of its own, made once the others have
  // given up (two timeouts after the start): it finds their call there and raises naming it.
  suite.run("call checking (first): a call seen before on rank " + std::to_string(last) +
                " and new on the others: they raise within the wait timeout, naming their call",
            [&] {
              const ScopedCallCheckMode first(world, CallCheckMode::kFirst);
              auto& coll = keep<Collectives>(kept, world, heap, count * sizeof(float));
              auto* in = heap.allocate_array<float>(count);
              auto* out = heap.allocate_array<float>(count);
              const size_t seen = 4096, fresh = 4096 + 8;  // element counts
              coll.all_reduce(in, out, seen, DType::kFloat32, stream, AllReduceMethod::kOneShot);  // every rank
              TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
              world.barrier("faults: call comparison ready");
              const auto start = std::chrono::steady_clock::now();
              std::string failure;
              try {
                if (world.rank() != last) {
                  std::string error;
                  bool device = false;
                  try {
                    coll.all_reduce(in, out, fresh, DType::kFloat32, stream, AllReduceMethod::kOneShot);
                  } catch (const DeviceTimeoutError& e) {
                    device = true;
                    error = e.what();
                  } catch (const TimeoutError& e) {
                    error = e.what();
                  }
                  const double seconds = seconds_since(start);
                  TDIST_CHECK(!device, "a device timeout instead of the comparison's: ", error);
                  TDIST_CHECK(!error.empty(), "the comparison returned without rank ", last);
                  TDIST_CHECK(seconds >= 0.9 * kTimeoutSeconds && seconds < kTimeoutSeconds + 5.0,
                              "the comparison gave up after ", seconds, " s, expected the wait timeout (",
                              kTimeoutSeconds, " s): ", error);
                  for (const std::string& part :
                       {"this rank compared its call all_reduce(count=" + std::to_string(fresh) + ",",
                        std::string("within 2000 ms (the device wait timeout, TDIST_WAIT_TIMEOUT_S)"),
                        "ranks that never arrived: " + std::to_string(last), std::string("Under TDIST_CHECK_CALLS=first")})
                    TDIST_CHECK(error.find(part) != std::string::npos, "the error lacks '", part, "': ", error);
                  TDIST_CHECK(!device_fault_message(), "a device fault on a rank that launched nothing: ",
                              *device_fault_message());
                } else {
                  std::string aborted;  // the catch-up below runs whatever happened here
                  try {
                    try {
                      coll.all_reduce(in, out, seen, DType::kFloat32, stream, AllReduceMethod::kOneShot);  // not compared
                    } catch (const DeviceTimeoutError&) {
                      // a launch behind the first one found the fault recorded: checked below
                    }
                    const cudaError_t result = cudaStreamSynchronize(stream);
                    TDIST_CHECK(result == cudaSuccess, "the aborted all_reduce ended with ", cudaGetErrorName(result));
                    TDIST_CHECK(device_fault_message().has_value(), "no device fault on the rank the others never met");
                  } catch (const std::exception& e) {
                    aborted = e.what();
                  }
                  std::this_thread::sleep_until(start + std::chrono::duration<double>(2 * kTimeoutSeconds));
                  std::string error;
                  try {
                    world.check_same_call("the comparison the other ranks gave up on");
                  } catch (const Error& e) {
                    error = e.what();
                  }
                  TDIST_CHECK(aborted.empty(), aborted);
                  TDIST_CHECK(error.find("rank 0=all_reduce(count=" + std::to_string(fresh) + ",") != std::string::npos,
                              "the catch-up comparison did not find the others' call: '", error, "'");
                }
              } catch (const std::exception& e) {
                failure = e.what();
              }
              clear_device_fault();
              world.barrier("faults: call comparison done");
              if (!failure.empty()) TDIST_FAIL(failure);
            });

  world.barrier("faults: done");
  return suite.finish();
}
