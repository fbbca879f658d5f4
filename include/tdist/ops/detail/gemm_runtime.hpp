// Typed host glue of the sm90 GEMM kernel family (include/tdist/kernels/gemm/sm90_gemm.cuh): one
// object per (scheduler, hooks) pair owns the instance names, the compile requests and the launch,
// so no caller assembles a kernel name or a parameter list by hand. Used by tdist::Gemm,
// tdist::GroupedGemm and the overlap ops.
//
// API
//   GemmSchedulerTraits<Scheduler>  device type name of a scheduler (kernels::gemm::TileScheduler,
//                                   kernels::gemm::GroupedScheduler, GatherGroupedScheduler) and its
//                                   file-name tag.
//   GemmHooksTraits<Params>         maps the parameter struct of a hooks type, as the host fills it, to
//                                   the device hooks type (which derives from it, same layout) and the
//                                   header that defines it. Shipped: kernels::gemm::NoTileHooks (plain
//                                   GEMM), AllGatherWaitParams -> AllGatherWaitHooks, ChunkPublishParams
//                                   -> ChunkPublishHooks, MoeGatherWaitParams -> MoeGatherWaitHooks
//                                   (overlap.cuh). A new hooks type adds one
//                                   specialisation here.
//   GemmRuntime<Scheduler, Params>  the instances of one (scheduler, hooks) pair over (dtype, tile):
//     static kernel_name(dtype, tile)      name expression: sm90_gemm_tn<T, BM, BN, BK, S, C, Hooks[, Scheduler]>
//     static compile_request(tile)         one JIT request (bf16 and fp16 name expressions), arch sm_90a
//     static instance_tiles()              the shipped tiles, and the 2-CTA cluster of the 128-row ones
//                                          for the runtimes with clusters (kClusters: no hooks, or the
//                                          MoE gather waits)
//     static compile_requests()            one per instance tile, arch empty (TDIST_JIT_REGISTER_KERNELS)
//     kernel(dtype, tile)                  the loaded kernel (compiled or read from the cache on first use)
//     launch(checked_args, tile, b_rows, sched, params, max_ctas, stream)
//                                          the launch: tensor maps (B over b_rows rows), grid, parameters
//     run(args, tile, params, options, stream)   (TileScheduler only) checks the args, builds the
//                                          schedule of options.group_m / first_row, launches
//   Fp8GroupedRuntime               the FP8 grouped instances (sm90_fp8_gemm.cuh, Fp8GroupedKernel):
//                                   loaded modules, launch (with the MoE source waits or without)
//   HookedGemm<Params>              GemmRuntime<TileScheduler, Params>: the plain-order GEMM whose tiles
//                                   run the hooks of Params. An overlap op holds one per hooks type:
//
//     detail::HookedGemm<kernels::gemm::AllGatherWaitParams> ag_gemm(num_sms);
//     ag_gemm.run(args, tile, params, {.first_row = rank_row0, .max_ctas = ctas}, stream);
//     TDIST_JIT_REGISTER_KERNELS(ag_gemm, detail::HookedGemm<kernels::gemm::AllGatherWaitParams>::compile_requests);
//
// Thread safety: kernel() and run()/launch() may be called from several threads (one mutex guards
// the loaded instances).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tdist/common/error.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/kernels/gemm/grouped_scheduler.cuh"
#include "tdist/kernels/gemm/overlap_params.cuh"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/detail/gemm_instance.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/ops/grouped_gemm.hpp"

namespace tdist::detail {

template <typename Scheduler>
struct GemmSchedulerTraits;
template <>
struct GemmSchedulerTraits<kernels::gemm::TileScheduler> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::TileScheduler";
  static constexpr const char* kTag = "";  // the default scheduler: names and files as before it was a parameter
};
template <>
struct GemmSchedulerTraits<kernels::gemm::GroupedScheduler> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::GroupedScheduler";
  static constexpr const char* kTag = "grouped";
};

template <>
struct GemmSchedulerTraits<kernels::gemm::GatherGroupedScheduler> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::GatherGroupedScheduler";
  static constexpr const char* kTag = "grouped_gather";
};

template <typename Params>
struct GemmHooksTraits;
template <>
struct GemmHooksTraits<kernels::gemm::NoTileHooks> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::NoTileHooks";
  static constexpr const char* kHeader = nullptr;  // sm90_gemm.cuh defines it
  static constexpr const char* kTag = "";
};
template <>
struct GemmHooksTraits<kernels::gemm::AllGatherWaitParams> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::AllGatherWaitHooks";
  static constexpr const char* kHeader = "tdist/kernels/gemm/overlap.cuh";
  static constexpr const char* kTag = "AllGatherWaitHooks";
};
template <>
struct GemmHooksTraits<kernels::gemm::MoeGatherWaitParams> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::MoeGatherWaitHooks";
  static constexpr const char* kHeader = "tdist/kernels/gemm/overlap.cuh";
  static constexpr const char* kTag = "MoeGatherWaitHooks";
};
template <>
struct GemmHooksTraits<kernels::gemm::ChunkPublishParams> {
  static constexpr const char* kDeviceType = "tdist::kernels::gemm::ChunkPublishHooks";
  static constexpr const char* kHeader = "tdist/kernels/gemm/overlap.cuh";
  static constexpr const char* kTag = "ChunkPublishHooks";
};

// The untyped part: names, requests, loaded modules, parameter blocks.
std::string gemm_instance_name(DType dtype, const GemmTile& tile, const char* hooks_type, const char* scheduler_type);
jit::CompileRequest gemm_instance_request(const GemmTile& tile, const char* hooks_type, const char* hooks_header,
                                          const char* hooks_tag, const char* scheduler_type, const char* scheduler_tag);
// tmap_a, tmap_b (over b_rows rows of B), tmap_d, d, ldd, m, n, k: the kernel's parameters before
// the scheduler and the hooks.
jit::KernelArgs gemm_operand_args(const GemmArgs& checked_args, const GemmTile& tile, int64_t b_rows);

// The loaded instances of one runtime, by (dtype, tile). A name and a compile request are a dozen
// strings: `name` and `request` are called on an instance's first use only, not on every launch.
class GemmModules {
 public:
  using NameFn = std::string (*)(DType, const GemmTile&);
  using RequestFn = jit::CompileRequest (*)(const GemmTile&);
  // The kernel name(dtype, tile) of the module compiled from request(tile), compiled or loaded once.
  const jit::Kernel& load(DType dtype, const GemmTile& tile, NameFn name, RequestFn request);

 private:
  struct Loaded;
  std::mutex mu_;
  std::map<std::tuple<int, int, int, int, int, int>, std::shared_ptr<Loaded>> loaded_;  // (dtype, tile)
};

template <typename Scheduler, typename Params>
class GemmRuntime {
  static_assert(std::is_trivially_copyable_v<Scheduler> && std::is_trivially_copyable_v<Params>,
                "kernel parameters are trivially copyable");
  using SchedTraits = GemmSchedulerTraits<Scheduler>;
  using HooksTraits = GemmHooksTraits<Params>;

 public:
  // Instances with a 2-CTA cluster (multicast B; with_b_multicast picks them): the plain and the
  // grouped GEMM without hooks, and the MoE ops' gathered-A GEMM whose tiles wait for their tokens.
  static constexpr bool kClusters = std::is_same_v<Params, kernels::gemm::NoTileHooks> ||
                                    (std::is_same_v<Params, kernels::gemm::MoeGatherWaitParams> &&
                                     std::is_same_v<Scheduler, kernels::gemm::GatherGroupedScheduler>);

  explicit GemmRuntime(int num_sms) : num_sms_(num_sms) {}

  static std::string kernel_name(DType dtype, const GemmTile& tile) {
    return gemm_instance_name(
        dtype, tile, HooksTraits::kDeviceType,
        std::is_same_v<Scheduler, kernels::gemm::TileScheduler> ? nullptr : SchedTraits::kDeviceType);
  }
  static jit::CompileRequest compile_request(const GemmTile& tile) {
    return gemm_instance_request(
        tile, HooksTraits::kDeviceType, HooksTraits::kHeader, HooksTraits::kTag,
        std::is_same_v<Scheduler, kernels::gemm::TileScheduler> ? nullptr : SchedTraits::kDeviceType,
        SchedTraits::kTag);
  }
  // The shipped tiles, each followed by its 2-CTA cluster where with_b_multicast can give one (the
  // 128-row tiles of a runtime with clusters).
  static std::vector<GemmTile> instance_tiles() {
    std::vector<GemmTile> v;
    for (const GemmTile& t : gemm_tiles()) {
      v.push_back(t);
      if (kClusters && takes_cluster(t)) v.push_back({t.block_m, t.block_n, t.block_k, t.stages, 2});
    }
    return v;
  }
  static std::vector<jit::CompileRequest> compile_requests() {
    std::vector<jit::CompileRequest> v;
    for (const GemmTile& t : instance_tiles()) {
      v.push_back(compile_request(t));
      v.back().arch.clear();  // tdist-compile sets it
    }
    return v;
  }

  const jit::Kernel& kernel(DType dtype, const GemmTile& tile) {
    return modules_.load(dtype, tile, &kernel_name, &compile_request);
  }

  // Launches on checked args (check_gemm_args) with B's tensor map over `b_rows` rows; the grid is
  // min(SMs, max_ctas if > 0, args.m x args.n tiles).
  void launch(const GemmArgs& checked, const GemmTile& tile, int64_t b_rows, const Scheduler& sched,
              const Params& params, int max_ctas, cudaStream_t stream) {
    TDIST_CHECK_ARG(kClusters || tile.cluster_m == 1, "tile", "the ", kernel_name(checked.dtype, tile),
                    " instances take no cluster (cluster_m 1), got ", tile.cluster_m);
    const jit::Kernel& k = kernel(checked.dtype, tile);
    const jit::LaunchConfig cfg = gemm_launch_config(checked, tile, num_sms_, max_ctas, stream);
    jit::KernelArgs kargs = gemm_operand_args(checked, tile, b_rows);
    kargs.add(sched).add(params);
    jit::launch(k, cfg, kargs);
  }

  // The plain-order GEMM D = A x B^T (TileScheduler runtimes only); M == 0 or N == 0 is a no-op.
  void run(const GemmArgs& args, const GemmTile& tile, const Params& params, const GemmRunOptions& options,
           cudaStream_t stream) {
    static_assert(std::is_same_v<Scheduler, kernels::gemm::TileScheduler>, "run() walks the plain tile order");
    const GemmArgs checked = check_gemm_args(args);
    if (checked.m == 0 || checked.n == 0) return;
    check_gemm_tile(tile);
    const Scheduler sched = gemm_schedule(checked, tile, options.group_m, options.first_row);
    launch(checked, tile, checked.n, sched, params, options.max_ctas, stream);
  }

  int num_sms() const { return num_sms_; }

 private:
  int num_sms_;
  GemmModules modules_;
};

// What the bf16 / fp16 and the FP8 grouped GEMMs share (ops/grouped_gemm.hpp):
// The checks after their operands': the rows of B (num_groups x n below 2^31), the offsets' type,
// and, with work to do (m and n > 0), the offsets' pointer. Errors name the argument.
void check_grouped_offsets(int num_groups, int64_t m, int64_t n, const void* offsets, IndexType offsets_type);
// The walk of `options` (group_m, first_row, m_tile_order, m_tile_count) over checked args and a
// checked tile whose BLOCK_M divides the group alignment.
kernels::gemm::GroupedScheduler grouped_walk(const void* offsets, IndexType offsets_type, int num_groups, int64_t m,
                                             int64_t n, const GemmTile& tile, const GroupedGemmRunOptions& options);
// A grouped problem's A, D and B (its first N rows) as the dense GEMM's argument struct, with
// element type `dtype` (its tensor maps and launch shape).
template <typename GroupedArgs>
GemmArgs grouped_operands(const GroupedArgs& a, DType dtype) {
  GemmArgs g;
  g.a = a.a;
  g.b = a.b;
  g.d = a.d;
  g.m = a.m;
  g.n = a.n;
  g.k = a.k;
  g.dtype = dtype;
  g.lda = a.lda;
  g.ldb = a.ldb;
  g.ldd = a.ldd;
  return g;
}

// The FP8 grouped instances (kernels/gemm/sm90_fp8_gemm.cuh) of one GroupedGemm or MoE op: loaded
// by tile on first use, launched on checked args (check_grouped_gemm_fp8_args) and a checked tile.
class Fp8GroupedRuntime {
 public:
  explicit Fp8GroupedRuntime(int num_sms) : num_sms_(num_sms) {}
  // The TMA instance, or with checked_args.a_gather the gathering one; with `source_waits` (which
  // needs a_gather) the gathering one whose tiles wait for their sources first.
  void launch(const GroupedGemmFp8Args& checked_args, const GemmTile& tile,
              const kernels::gemm::GroupedScheduler& sched, int max_ctas, cudaStream_t stream,
              const kernels::gemm::MoeGatherWaitParams* source_waits = nullptr);

 private:
  int num_sms_;
  GemmModules modules_[3];  // by Fp8GroupedKernel
};

// The checks of a gathered A's index (GroupedGemmArgs / GroupedGemmFp8Args::a_gather) for rows of
// `row_bytes`: errors name a_gather.token_of_row, .gathered, .local, .ld_bytes.
void check_row_gather(const kernels::gemm::RowGather& gather, int64_t row_bytes);

template <typename Params>
using HookedGemm = GemmRuntime<kernels::gemm::TileScheduler, Params>;
using PlainGemm = GemmRuntime<kernels::gemm::TileScheduler, kernels::gemm::NoTileHooks>;

}  // namespace tdist::detail
