#include "common/tutorial.hpp"

#include <sys/stat.h>

#include <charconv>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>

#include "tdist/jit/compiler.hpp"
#include "tdist/jit/manifest.hpp"
#include "tdist/runtime/launch_env.hpp"
#include "tdist/runtime/wait_config.hpp"

#ifndef TDIST_EXAMPLES_SOURCE_DIR
#error "TDIST_EXAMPLES_SOURCE_DIR must name the examples/ source folder (examples/CMakeLists.txt sets it)"
#endif

namespace tdist::examples {

// ------------------------------------------------------------------------------------------------
// Options

Options::Options(int argc, char** argv, const std::vector<OptionSpec>& specs) : specs_(specs) {
  for (const auto& s : specs_) values_.push_back(s.default_value);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      help_ = true;
      continue;
    }
    TDIST_CHECK_ARG(arg.size() > 2 && arg.compare(0, 2, "--") == 0, "argv", "unexpected argument '", arg,
                    "': options are --name=VALUE");
    std::string name = arg.substr(2), text;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      text = name.substr(eq + 1);
      name.resize(eq);
    } else {
      TDIST_CHECK_ARG(i + 1 < argc, "argv", "option --", name, " needs a value");
      text = argv[++i];
    }
    size_t index = 0;
    while (index < specs_.size() && specs_[index].name != name) ++index;
    TDIST_CHECK_ARG(index < specs_.size(), "argv", "unknown option --", name);
    const OptionSpec& spec = specs_[index];
    long long value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    TDIST_CHECK_ARG(error == std::errc() && end == text.data() + text.size(), "argv", "--", name,
                    " expects an integer, got '", text, "'");
    TDIST_CHECK_ARG(value >= spec.min && value <= spec.max, "argv", "--", name, " must lie in [", spec.min, ", ",
                    spec.max, "], got ", value);
    values_[index] = value;
  }
}

long long Options::operator[](const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return values_[i];
  TDIST_FAIL("the program asked for option --", name, ", which it never declared");
}

// ------------------------------------------------------------------------------------------------
// Random data

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t derive_seed(uint64_t job_seed, int rank, uint64_t purpose, uint64_t index) {
  Rng mix(job_seed);
  uint64_t seed = mix.next();
  for (uint64_t part : {static_cast<uint64_t>(rank), purpose, index}) {
    Rng step(seed ^ (part * 0xD6E8FEB86659FD93ull));
    seed = step.next();
  }
  return seed;
}

// ------------------------------------------------------------------------------------------------
// Kernels

std::string examples_dir() {
  const char* override_dir = std::getenv("TDIST_EXAMPLES_DIR");
  const std::string dir = override_dir != nullptr && *override_dir != '\0' ? override_dir : TDIST_EXAMPLES_SOURCE_DIR;
  struct stat st {};
  TDIST_CHECK(::stat((dir + "/kernels.manifest").c_str(), &st) == 0, "cannot find ", dir,
              "/kernels.manifest: set TDIST_EXAMPLES_DIR to the examples/ folder of tdist's sources");
  return dir;
}

std::shared_ptr<jit::Module> load_tutorial_kernels(const std::string& source) {
  std::string dir = examples_dir();
  if (dir.back() != '/') dir += '/';
  const std::string wanted = dir + source;  // spelled as the manifest parser spells its sources
  for (jit::CompileRequest& request : jit::load_manifest(dir + "kernels.manifest")) {
    if (request.file_name != wanted) continue;
    request.arch.clear();  // this GPU's architecture
    return jit::Module::load(jit::compile(request));
  }
  TDIST_FAIL(dir, "kernels.manifest has no [kernel] section with source = ", source);
}

// ------------------------------------------------------------------------------------------------
// Checks and the report

void Case::record(const std::string& what) {
  constexpr size_t kShown = 5;
  if (failures_ < kShown) std::printf("mismatch in '%s': %s\n", name_.c_str(), what.c_str());
  if (failures_ == kShown) std::printf("mismatch in '%s': further mismatches not shown\n", name_.c_str());
  ++failures_;
}

void Report::run(const std::string& name, const std::function<void(Case&)>& body) {
  const auto start = std::chrono::steady_clock::now();
  Case checks(name);
  try {
    body(checks);
  } catch (const std::exception& e) {
    std::printf("FAIL %s\n", name.c_str());
    throw Error(detail::concat("case '", name, "': ", e.what()));
  }
  const auto verdicts = world_.all_gather("verdict: " + name, Bytes{static_cast<uint8_t>(checks.failures() == 0)});
  std::string failing_ranks;
  for (size_t r = 0; r < verdicts.size(); ++r)
    if (verdicts[r].empty() || verdicts[r][0] == 0)
      failing_ranks += (failing_ranks.empty() ? "" : ", ") + std::to_string(r);
  failing_ranks.empty() ? ++passed_ : ++failed_;
  if (world_.rank() == 0) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (failing_ranks.empty())
      std::printf("PASS %s (%.0f ms)\n", name.c_str(), ms);
    else
      std::printf("FAIL %s (mismatches on rank %s)\n", name.c_str(), failing_ranks.c_str());
  }
  std::fflush(stdout);
}

void sync_all(World& world, const char* tag) {
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  world.barrier(tag);
}

// ------------------------------------------------------------------------------------------------
// The program

namespace {

std::string usage(const TutorialInfo& info, const std::vector<OptionSpec>& specs) {
  std::string text = detail::concat(info.summary, "\n\nusage: tdistrun -n N -- ", info.program,
                                    " [--name=VALUE ...]   (N >= 2 ranks, one GPU each)\n\noptions:\n");
  for (const auto& s : specs)
    text += detail::concat("  --", s.name, std::string(s.name.size() < 18 ? 18 - s.name.size() : 1, ' '), s.help,
                           " (default ", s.default_value, ", range ", s.min, "..", s.max, ")\n");
  text +=
      "\nenvironment: TDIST_WAIT_TIMEOUT_S (device wait timeout, default 30 here), TDIST_EXAMPLES_DIR\n"
      "(folder holding kernels.manifest and the kernel sources), TDIST_CACHE_DIR (JIT cache)\n";
  return text;
}

uint64_t fresh_seed() {
  std::random_device device;
  const uint64_t now = static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  return ((static_cast<uint64_t>(device()) << 32) ^ device() ^ now) | 1;  // never 0: 0 asks for a fresh seed
}

}  // namespace

int run_tutorial(int argc, char** argv, const TutorialInfo& info, const std::function<void(Context&)>& body) {
  std::vector<OptionSpec> specs = info.options;
  specs.push_back({"seed", 0, 0, LLONG_MAX, "job seed for every random input; 0: a fresh one"});
  std::unique_ptr<Options> options;
  try {
    options = std::make_unique<Options>(argc, argv, specs);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n\n%s", info.program.c_str(), e.what(), usage(info, specs).c_str());
    return 2;
  }
  if (options->help_requested()) {
    std::printf("%s", usage(info, specs).c_str());
    return 0;
  }

  // Declared outside the try block: unwinding must not run their collective destructors.
  std::unique_ptr<World> world;
  std::unique_ptr<Report> report;
  std::unique_ptr<Context> context;
  try {
    // Checked before any GPU or network work, so that a plain `./example_...` explains itself.
    const LaunchEnv env = launch_env_from_process();
    TDIST_CHECK(env.world_size >= 2,
                "this tutorial needs at least 2 ranks, one GPU each; run it as\n  tdistrun -n N -- ", argv[0],
                "   (N = 2 .. number of GPUs)");
    // A lost signal must end in the device wait's diagnostic, not in a long hang. Module::load
    // reads this when it writes the module's wait timeout.
    setenv("TDIST_WAIT_TIMEOUT_S", "30", /*overwrite=*/0);
    const double wait_timeout_s = wait_timeout_seconds_from_env();

    world = std::make_unique<World>();
    TDIST_CHECK(world->lsa_size() == world->world_size(),
                "the tutorials address every peer with loads and stores, "
                "so all ranks must share one NVLink domain; here ",
                world->lsa_size(), " of ", world->world_size(), " ranks are reachable");
    report = std::make_unique<Report>(*world);

    // Rank 0's seed is the job's: every rank can then rebuild any peer's inputs on the host.
    const uint64_t my_seed = (*options)["seed"] != 0 ? static_cast<uint64_t>((*options)["seed"]) : fresh_seed();
    const auto seeds =
        world->all_gather("job seed", Bytes(reinterpret_cast<const uint8_t*>(&my_seed),
                                            reinterpret_cast<const uint8_t*>(&my_seed) + sizeof(my_seed)));
    uint64_t job_seed = 0;
    std::memcpy(&job_seed, seeds[0].data(), sizeof(job_seed));
    int sm_count = 0;
    TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, world->device()));
    if (world->rank() == 0)
      std::printf("%s: %d ranks, seed %llu (rerun with --seed=%llu), device wait timeout %.0f s\n",
                  info.program.c_str(), world->world_size(), static_cast<unsigned long long>(job_seed),
                  static_cast<unsigned long long>(job_seed), wait_timeout_s);

    context = std::make_unique<Context>(*world, *options, *report, job_seed, sm_count);
    body(*context);

    if (world->rank() == 0) std::printf("%d passed, %d failed\n", report->passed(), report->failed());
    std::fflush(stdout);
    const int exit_code = report->failed() == 0 ? 0 : 1;
    context.reset();  // the heap (collective) before the world
    world.reset();
    return exit_code;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s: error: %s\n", info.program.c_str(), e.what());
    std::fflush(stderr);
    std::printf("%d passed, %d failed\n", report ? report->passed() : 0, (report ? report->failed() : 0) + 1);
    std::fflush(stdout);
    std::_Exit(1);  // see run_tutorial's comment: no collective teardown with peers that may wait for us
  }
}

}  // namespace tdist::examples
