// The autotuner across ranks: every rank times the candidates itself, the times are reduced with
// World::max_across_ranks, and all ranks keep the same winner; a second tuner finds it on disk
// without timing. Each rank's timer adds a penalty to a different candidate, so ranks that did not
// agree through the reduction would choose differently.
#include <filesystem>
#include <string>

#include "gpu/harness.cuh"
#include "tdist/jit/autotune.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"

using namespace tdist;

namespace {

const char* kScaleSource = R"(
template <int kThreads>
__global__ void __launch_bounds__(kThreads) scale(float* out, const float* in, unsigned long long n, float factor) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(kThreads) + threadIdx.x; i < n;
       i += static_cast<unsigned long long>(gridDim.x) * kThreads)
    out[i] = in[i] * factor;
}
)";

}  // namespace

int run_all() {
  World world;
  tdist::test::Suite suite(world);
  const int rank = world.rank();

  suite.run("ranks agree on the autotuned winner, and reuse it from disk without timing", [&] {
    // One fresh cache folder for the job, named by rank 0.
    const auto stamp = tdist::test::all_gather_u64(world, "cache stamp", tdist::test::fresh_seed(rank) >> 8);
    const std::string dir = "/tmp/tdist-autotune-ranks-" + std::to_string(stamp[0]);
    jit::CompileRequest request;
    request.source = kScaleSource;
    request.file_name = "scale.cu";
    const std::vector<int> block_sizes = {128, 256, 512, 1024};
    for (int threads : block_sizes) request.name_expressions.push_back("scale<" + std::to_string(threads) + ">");
    auto module = jit::Module::load(jit::compile(request));

    const size_t n = 64ull << 20;
    float *in, *out;
    TDIST_CUDA_CHECK(cudaMalloc(&in, n * sizeof(float)));
    TDIST_CUDA_CHECK(cudaMalloc(&out, n * sizeof(float)));
    tdist::test::fill_pattern(in, n * sizeof(float), 5);

    jit::TuneRequest tune;
    tune.kernel = "test.scale.v1";
    tune.shape_class = "n=64M,fp32";
    for (int threads : block_sizes) tune.configs.push_back({std::to_string(threads), {{"threads", threads}}});
    tune.launch = [&](const jit::TuneConfig& config, int, cudaStream_t stream) {
      const int threads = static_cast<int>(config.params.at("threads"));
      jit::LaunchConfig launch_config;
      launch_config.grid.x = 264;
      launch_config.block.x = static_cast<unsigned>(threads);
      launch_config.stream = stream;
      jit::launch(module->kernel("scale<" + std::to_string(threads) + ">"), launch_config,
                  jit::make_args(out, static_cast<const float*>(in), static_cast<unsigned long long>(n), 2.0f));
    };
    // Rank r penalises candidate r: without the reduction, ranks would pick different winners.
    auto timer = [&](const jit::TuneRequest& req, const jit::TuneConfig& config) {
      const double ms = jit::Autotuner::time_with_events(req, config);
      return config.name == std::to_string(block_sizes[rank % block_sizes.size()]) ? ms + 100.0 : ms;
    };
    auto reduce = [&](const std::vector<double>& v) { return world.max_across_ranks("autotune", v); };

    jit::Autotuner first(dir, timer, reduce);
    const std::string winner = first.tune(tune).name;
    TDIST_CHECK(first.timings() == block_sizes.size(), "timed ", first.timings(), " candidates");
    const auto winners = tdist::test::all_gather_u64(world, "winner", std::stoull(winner));
    for (size_t r = 0; r < winners.size(); ++r)
      TDIST_CHECK(winners[r] == winners[0], "rank ", r, " chose ", winners[r], ", rank 0 chose ", winners[0]);
    for (int r = 0; r < world.world_size(); ++r)
      TDIST_CHECK(winner != std::to_string(block_sizes[r % block_sizes.size()]) || world.world_size() >= 4,
                  "the winner ", winner, " is the candidate rank ", r, " penalised");

    jit::Autotuner second(dir, timer, reduce);
    TDIST_CHECK(second.tune(tune).name == winner, "the stored winner was not reused");
    TDIST_CHECK(second.timings() == 0, "the second tuner timed ", second.timings(), " candidates");

    TDIST_CUDA_CHECK(cudaFree(in));
    TDIST_CUDA_CHECK(cudaFree(out));
    world.barrier("autotune done");
    if (rank == 0) std::filesystem::remove_all(dir);
  });
  return suite.finish();
}

int main() {
  try {
    return run_all();
  } catch (const std::exception& e) {
    std::printf("FAIL test_autotune_ranks stopped: %s\n", e.what());
    return 1;
  }
}
