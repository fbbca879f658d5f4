// tdist._C's tensor-parallel MoE ops (tdist/ops/moe.hpp) on the Python runtime's World and heap, on
// raw device pointers (python/tdist/moe.py turns torch tensors into them, checks their shapes and
// caches one context per configuration). The second projection routes its own ids with a
// MoeRouter: the routing is a pure function of the ids (docs/moe.md), so it equals the first
// projection's and the two calls need not share a handle (torch.library ops cannot pass one).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "runtime_access.hpp"
#include "tdist/common/dtype.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/grouped_gemm.hpp"
#include "tdist/ops/moe.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using tdist_python::ptr;

// One MoE op (MoeAgGroupGemm or MoeGroupGemmRs plus its router) in a shared box the runtime's close
// also holds, so that tdist.finalize destroys it (collectively) before the heap.
template <typename Op>
struct MoeBox {
  std::unique_ptr<Op> op;
  std::unique_ptr<tdist::MoeRouter> router;
  void reset() {
    router.reset();
    op.reset();
  }
};

template <typename Op>
class MoeContext {
 public:
  MoeContext(nb::handle runtime, const char* name, int64_t max_m, int64_t k, int64_t max_n, int experts, int topk,
             const std::string& dtype)
      : name_(name) {
    const tdist_python::RuntimeParts rt = tdist_python::runtime_parts(runtime, name);
    config_.max_m = max_m;
    config_.k = k;
    config_.max_n = max_n;
    config_.experts = experts;
    config_.topk = topk;
    config_.dtype = tdist::parse_dtype(dtype, "dtype");
    device_ = rt.world->device();
    rank_ = rt.world->rank();
    world_size_ = rt.world->world_size();
    tdist::check_moe_routing_args(max_m, topk, experts, world_size_, rank_);  // before the collective constructor
    box_ = std::make_shared<MoeBox<Op>>();
    {
      nb::gil_scoped_release release;
      tdist_python::ScopedDevice scope(device_);
      box_->op = std::make_unique<Op>(*rt.world, *rt.heap, config_);
      box_->router = std::make_unique<tdist::MoeRouter>(max_m, topk, experts, world_size_, rank_);
    }
    tdist_python::reset_on_runtime_close(runtime, box_, device_);
  }

  // Synchronises; throws naming topk_ids if a routing of this context met an expert id out of range.
  void check_errors() {
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    if constexpr (std::is_same_v<Op, tdist::MoeAgGroupGemm>)
      op().check_errors();  // the op routes with a router of its own
    else
      router().check_errors();
  }

  // Collective: returns the context's memory to the heap.
  void close() { tdist_python::close_box(*box_, device_); }
  bool closed() const { return !box_->op; }
  int64_t max_m() const { return config_.max_m; }
  int64_t k() const { return config_.k; }
  int64_t max_n() const { return config_.max_n; }

 protected:
  Op& op() {
    if (!box_->op) throw tdist::Error(tdist::detail::concat("tdist.", name_, ": the context is closed"));
    return *box_->op;
  }
  tdist::MoeRouter& router() {
    op();
    return *box_->router;
  }

  const char* name_;
  tdist::MoeConfig config_;
  int device_ = 0, rank_ = 0, world_size_ = 0;
  std::shared_ptr<MoeBox<Op>> box_;
};

class MoeAg : public MoeContext<tdist::MoeAgGroupGemm> {
 public:
  MoeAg(nb::handle runtime, int64_t max_m, int64_t k, int experts, int topk, const std::string& dtype)
      : MoeContext(runtime, "moe_ag_group_gemm", max_m, k, 0, experts, topk, dtype) {}

  // Runs with `method` as asked (auto: the op's own choice, timed where the op times it); returns
  // what auto resolves to without timing, or the method asked for (run false: only that).
  // FP8 (a context of dtype e4m3): a_local_scales and b_scales too, d bf16.
  std::string run(uint64_t a_local, uint64_t topk_ids, uint64_t b, uint64_t d, int64_t m, int64_t n, uint64_t stream,
                  const std::string& method, bool run, uint64_t a_local_scales, uint64_t b_scales) {
    tdist::MoeAgGroupGemmArgs a;
    a.a_local = ptr<const void>(a_local);
    a.topk_ids = ptr<const int>(topk_ids);
    a.b = ptr<const void>(b);
    a.d = ptr<void>(d);
    a.m = m;
    a.n = n;
    a.a_local_scales = ptr<const float>(a_local_scales);
    a.b_scales = ptr<const float>(b_scales);
    const tdist::OverlapMethod requested = tdist::parse_overlap_method(method, "method");
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    const tdist::OverlapMethod chosen = op().method(a, requested);  // checks the arguments first
    if (run) op().run(a, reinterpret_cast<cudaStream_t>(stream), requested);
    return tdist::to_string(chosen);
  }
};

class MoeRs : public MoeContext<tdist::MoeGroupGemmRs> {
 public:
  MoeRs(nb::handle runtime, int64_t max_m, int64_t max_n, int experts, int topk, const std::string& dtype)
      : MoeContext(runtime, "moe_group_gemm_rs", max_m, 0, max_n, experts, topk, dtype) {}

  // Routes `topk_ids` on `stream`, then runs (all_reduce: run_all_reduce) with `method` as asked;
  // returns what auto resolves to without timing, or the method asked for. FP8 (a context of dtype
  // e4m3): h_scales (strides in elements; 0, 0: row-major) and b_scales too, d bf16.
  std::string run(uint64_t h, uint64_t b, uint64_t topk_ids, uint64_t topk_weights, uint64_t d, int64_t m, int64_t n,
                  int64_t k, uint64_t stream, const std::string& method, bool all_reduce, bool run, uint64_t h_scales,
                  uint64_t b_scales, int64_t h_scales_row_stride, int64_t h_scales_kb_stride) {
    TDIST_CHECK_ARG(m >= 0 && m <= config_.max_m, "m", "0 to the context's max_m (", config_.max_m, "), got ", m);
    TDIST_CHECK_ARG(m == 0 || topk_ids != 0, "topk_ids", "a device pointer");
    const tdist::OverlapMethod requested = tdist::parse_overlap_method(method, "method");
    tdist::MoeGroupGemmRsArgs a;
    a.h = ptr<const void>(h);
    a.b = ptr<const void>(b);
    a.topk_weights = ptr<const float>(topk_weights);
    a.d = ptr<void>(d);
    a.m = m;
    a.n = n;
    a.k = k;
    a.h_scales = ptr<const float>(h_scales);
    a.h_scales_row_stride = h_scales_row_stride;
    a.h_scales_kb_stride = h_scales_kb_stride;
    a.b_scales = ptr<const float>(b_scales);
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    a.routing = &router().route(ptr<const int>(topk_ids), m, s);
    if (all_reduce) {
      if (run) op().run_all_reduce(a, s);
      return "all_reduce";
    }
    const tdist::OverlapMethod chosen = op().method(a, requested);  // checks the arguments first
    if (run) op().run(a, s, requested);
    return tdist::to_string(chosen);
  }
};

// The grouped GEMM alone (python/tdist/moe.py: tdist.moe.grouped_gemm): one GroupedGemm per device,
// made on the first call there (it reads that device's SM count); not collective.
tdist::GroupedGemm& grouped_gemm_for(int device) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<tdist::GroupedGemm>> ops;
  std::lock_guard<std::mutex> lock(mu);
  auto& op = ops[device];
  if (!op) op = std::make_unique<tdist::GroupedGemm>();
  return *op;
}

// The grouped GEMMs' offsets type from its torch name.
tdist::IndexType offsets_type(const std::string& offsets_dtype) {
  TDIST_CHECK_ARG(offsets_dtype == "int32" || offsets_dtype == "int64", "offsets", "expected int32 or int64, got ",
                  offsets_dtype);
  return offsets_dtype == "int32" ? tdist::IndexType::kInt32 : tdist::IndexType::kInt64;
}

// order_scratch: 0, or int32 [grouped_gemm_scratch_entries(m)] (GroupedGemmRunOptions::order_scratch).
void grouped_gemm(uint64_t a, uint64_t b, uint64_t d, uint64_t offsets, const std::string& offsets_dtype, int64_t m,
                  int64_t n, int64_t k, int num_groups, const std::string& dtype, uint64_t order_scratch, int device,
                  uint64_t stream) {
  tdist::GroupedGemmArgs args;
  args.a = ptr<const void>(a);
  args.b = ptr<const void>(b);
  args.d = ptr<void>(d);
  args.offsets = ptr<const void>(offsets);
  args.offsets_type = offsets_type(offsets_dtype);
  args.m = m;
  args.n = n;
  args.k = k;
  args.num_groups = num_groups;
  args.dtype = tdist::parse_dtype(dtype, "a");
  const tdist::GroupedGemmArgs checked = tdist::check_grouped_gemm_args(args);  // before touching the device
  if (m == 0) return;
  nb::gil_scoped_release release;
  tdist_python::ScopedDevice scope(device);
  grouped_gemm_for(device).run(checked, reinterpret_cast<cudaStream_t>(stream),
                               tdist::GroupedGemmRunOptions{.order_scratch = ptr<uint32_t>(order_scratch)});
}

// The FP8 grouped GEMM alone (python/tdist/moe.py: tdist.moe.grouped_gemm_fp8): e4m3 a and b, f32
// scales (a's with the given strides in elements, b's [G][ceil(n / 128)][ceil(k / 128)]), bf16 d.
void grouped_gemm_fp8(uint64_t a, uint64_t a_scales, int64_t a_scales_row_stride, int64_t a_scales_kb_stride,
                      uint64_t b, uint64_t b_scales, uint64_t d, uint64_t offsets, const std::string& offsets_dtype,
                      int64_t m, int64_t n, int64_t k, int num_groups, int device, uint64_t stream) {
  tdist::GroupedGemmFp8Args args;
  args.a = ptr<const void>(a);
  args.a_scales = ptr<const float>(a_scales);
  args.a_scales_row_stride = a_scales_row_stride;
  args.a_scales_kb_stride = a_scales_kb_stride;
  args.b = ptr<const void>(b);
  args.b_scales = ptr<const float>(b_scales);
  args.d = ptr<void>(d);
  args.offsets = ptr<const void>(offsets);
  args.offsets_type = offsets_type(offsets_dtype);
  args.m = m;
  args.n = n;
  args.k = k;
  args.num_groups = num_groups;
  const tdist::GroupedGemmFp8Args checked = tdist::check_grouped_gemm_fp8_args(args);  // before the device
  if (m == 0) return;
  nb::gil_scoped_release release;
  tdist_python::ScopedDevice scope(device);
  grouped_gemm_for(device).run(checked, reinterpret_cast<cudaStream_t>(stream));
}

// FP8 row quantisation (python/tdist/moe.py: quantize_fp8_rows, swiglu_quantize_fp8): x's rows (dtype
// bf16 / f16 / f32, ldx elements apart; with swiglu SiLU(gate) * up of [gate | up]) -> dense e4m3 q
// [rows][k] and f32 scales, block kb of row r at scales[r * scale_row_stride + kb * scale_kb_stride].
void quantize_fp8(uint64_t x, const std::string& dtype, int64_t ldx, uint64_t q, uint64_t scales,
                  int64_t scale_row_stride, int64_t scale_kb_stride, int64_t rows, int64_t k, bool swiglu, int device,
                  uint64_t stream) {
  tdist::Fp8QuantizeArgs args;
  args.x = ptr<const void>(x);
  args.dtype = tdist::parse_dtype(dtype, "x");
  args.ldx = ldx;
  args.q = ptr<void>(q);
  args.scales = ptr<float>(scales);
  args.scale_ld = scale_row_stride;
  args.scale_kb_stride = scale_kb_stride;
  args.rows = rows;
  args.k = k;
  args.swiglu = swiglu;
  const tdist::Fp8QuantizeArgs checked = tdist::check_fp8_quantize_args(args);  // before the device
  if (rows == 0) return;
  nb::gil_scoped_release release;
  tdist_python::ScopedDevice scope(device);
  tdist::quantize_fp8_rows(checked, reinterpret_cast<cudaStream_t>(stream));
}

// The routing alone into the caller's int32 tensors (python/tdist/moe.py: tdist.moe.routing of GPU
// ids, which the ops' backward calls): a MoeRouter on one device for up to max_m tokens. Not
// collective, and no runtime: it owns ordinary device memory only.
class RouterOnDevice {
 public:
  RouterOnDevice(int64_t max_m, int topk, int experts, int world_size, int rank, int device)
      : device_(device), max_m_(max_m) {
    tdist::check_moe_routing_args(max_m, topk, experts, world_size, rank);
    tdist_python::ScopedDevice scope(device_);
    router_ = std::make_unique<tdist::MoeRouter>(max_m, topk, experts, world_size, rank);
  }
  ~RouterOnDevice() {
    tdist_python::ScopedDevice scope(device_);
    router_.reset();
  }

  // Arrays as tdist::MoeRoutingArrays (the compact order too: compact_offsets must be given).
  void route_into(uint64_t topk_ids, int64_t m, uint64_t offsets, uint64_t counts, uint64_t token_of_row,
                  uint64_t row_of_pair, uint64_t compact_offsets, uint64_t row_of_compact, uint64_t token_of_compact,
                  uint64_t pair_of_compact, uint64_t compact_of_pair, uint64_t stream) {
    const tdist::MoeRoutingArrays out{.offsets = ptr<int>(offsets),
                                      .counts = ptr<int>(counts),
                                      .token_of_row = ptr<int>(token_of_row),
                                      .row_of_pair = ptr<int>(row_of_pair),
                                      .compact_offsets = ptr<int>(compact_offsets),
                                      .row_of_compact = ptr<int>(row_of_compact),
                                      .token_of_compact = ptr<int>(token_of_compact),
                                      .pair_of_compact = ptr<int>(pair_of_compact),
                                      .compact_of_pair = ptr<int>(compact_of_pair)};
    TDIST_CHECK_ARG(out.compact_offsets != nullptr, "compact_offsets", "a device pointer");
    tdist_python::ScopedDevice scope(device_);
    router_->route_into(ptr<const int>(topk_ids), m, out, reinterpret_cast<cudaStream_t>(stream));
  }

  // Synchronises; throws naming topk_ids if a routing since the last check met an id out of range.
  void check_errors() {
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    router_->check_errors();
  }
  int64_t max_m() const { return max_m_; }

 private:
  int device_;
  int64_t max_m_;
  std::unique_ptr<tdist::MoeRouter> router_;
};

}  // namespace

void bind_moe(nb::module_& m) {
  nb::class_<MoeAg>(m, "MoeAgGroupGemm", "AllGather + grouped GEMM context; use tdist.moe_ag_group_gemm.")
      .def(nb::init<nb::handle, int64_t, int64_t, int, int, const std::string&>(), "runtime"_a, "max_m"_a, "k"_a,
           "experts"_a, "topk"_a, "dtype"_a)
      .def("run", &MoeAg::run, "a_local"_a, "topk_ids"_a, "b"_a, "d"_a, "m"_a, "n"_a, "stream"_a, "method"_a,
           "run"_a = true, "a_local_scales"_a = 0, "b_scales"_a = 0)
      .def("check_errors", &MoeAg::check_errors)
      .def("close", &MoeAg::close)
      .def_prop_ro("closed", &MoeAg::closed)
      .def_prop_ro("max_m", &MoeAg::max_m)
      .def_prop_ro("k", &MoeAg::k);
  nb::class_<MoeRs>(m, "MoeGroupGemmRs",
                    "Grouped GEMM + top-k reduce + ReduceScatter / AllReduce context; use tdist.moe_group_gemm_rs.")
      .def(nb::init<nb::handle, int64_t, int64_t, int, int, const std::string&>(), "runtime"_a, "max_m"_a, "max_n"_a,
           "experts"_a, "topk"_a, "dtype"_a)
      .def("run", &MoeRs::run, "h"_a, "b"_a, "topk_ids"_a, "topk_weights"_a, "d"_a, "m"_a, "n"_a, "k"_a, "stream"_a,
           "method"_a, "all_reduce"_a, "run"_a = true, "h_scales"_a = 0, "b_scales"_a = 0, "h_scales_row_stride"_a = 0,
           "h_scales_kb_stride"_a = 0)
      .def("check_errors", &MoeRs::check_errors)
      .def("close", &MoeRs::close)
      .def_prop_ro("closed", &MoeRs::closed)
      .def_prop_ro("max_m", &MoeRs::max_m)
      .def_prop_ro("max_n", &MoeRs::max_n);
  nb::class_<RouterOnDevice>(m, "MoeRouter", "MoE routing on one GPU into int32 tensors; use tdist.moe.routing.")
      .def(nb::init<int64_t, int, int, int, int, int>(), "max_m"_a, "topk"_a, "experts"_a, "world_size"_a, "rank"_a,
           "device"_a)
      .def("route_into", &RouterOnDevice::route_into, "topk_ids"_a, "m"_a, "offsets"_a, "counts"_a, "token_of_row"_a,
           "row_of_pair"_a, "compact_offsets"_a, "row_of_compact"_a, "token_of_compact"_a, "pair_of_compact"_a,
           "compact_of_pair"_a, "stream"_a)
      .def("check_errors", &RouterOnDevice::check_errors)
      .def_prop_ro("max_m", &RouterOnDevice::max_m);
  m.def("grouped_gemm_scratch_entries", &tdist::grouped_gemm_scratch_entries, "m"_a,
        "int32 entries of grouped_gemm's order_scratch for m rows.");
  m.def("grouped_gemm", &grouped_gemm, "a"_a, "b"_a, "d"_a, "offsets"_a, "offsets_dtype"_a, "m"_a, "n"_a, "k"_a,
        "num_groups"_a, "dtype"_a, "order_scratch"_a, "device"_a, "stream"_a,
        "D = A x B_g^T per group on raw device pointers (tdist/ops/grouped_gemm.hpp); use tdist.moe.grouped_gemm.");
  m.def("grouped_gemm_fp8", &grouped_gemm_fp8, "a"_a, "a_scales"_a, "a_scales_row_stride"_a, "a_scales_kb_stride"_a,
        "b"_a, "b_scales"_a, "d"_a, "offsets"_a, "offsets_dtype"_a, "m"_a, "n"_a, "k"_a, "num_groups"_a, "device"_a,
        "stream"_a,
        "FP8 grouped GEMM on raw device pointers (tdist/ops/grouped_gemm.hpp); use tdist.moe.grouped_gemm_fp8.");
  m.def("quantize_fp8", &quantize_fp8, "x"_a, "dtype"_a, "ldx"_a, "q"_a, "scales"_a, "scale_row_stride"_a,
        "scale_kb_stride"_a, "rows"_a, "k"_a, "swiglu"_a, "device"_a, "stream"_a,
        "FP8 row quantisation on raw device pointers (tdist/ops/grouped_gemm.hpp); use "
        "tdist.moe.quantize_fp8_rows or swiglu_quantize_fp8.");
  m.def("grouped_gemm_alignment", &tdist::grouped_gemm_alignment,
        "Rows of every group of the grouped GEMM are padded to a multiple of this.");
  m.def("moe_capacity", &tdist::moe_capacity, "m"_a, "topk"_a, "experts"_a,
        "Rows of the expert-ordered matrices for any routing of m tokens.");
  m.def(
      "moe_check_routing",
      [](int64_t m, int topk, int experts, int world_size, int rank) {
        tdist::check_moe_routing_args(m, topk, experts, world_size, rank);
      },
      "m"_a, "topk"_a, "experts"_a, "world_size"_a, "rank"_a,
      "Raises tdist.Error naming m, topk, experts, world_size or rank when they cannot be routed.");
  m.def(
      "moe_routing_reference",
      [](const std::vector<int>& topk_ids, int64_t m, int topk, int experts, int world_size, int rank) {
        const tdist::MoeRoutingHost r = tdist::moe_routing_reference(topk_ids, m, topk, experts, world_size, rank);
        return std::make_tuple(r.offsets, r.counts, r.token_of_row, r.row_of_pair);
      },
      "topk_ids"_a, "m"_a, "topk"_a, "experts"_a, "world_size"_a, "rank"_a,
      "The routing of one rank on the host: (offsets [E + 1], counts [E], token_of_row [offsets[E]], "
      "row_of_pair [m * topk]).");
  m.def(
      "moe_method",
      [](int64_t m, int world_size) { return std::string(tdist::to_string(tdist::choose_moe_method(m, world_size))); },
      "m"_a, "world_size"_a, "The method 'auto' runs for m tokens on world_size ranks.");
}
