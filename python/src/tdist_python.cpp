// tdist._C: the Python extension over libtdist (nanobind). No torch types here: tensors reach this
// module as plain descriptors (pointer, element count, dtype name, device, contiguity) built by the
// Python layer from torch tensors, __cuda_array_interface__ or DLPack (dlpack_describe below), and
// streams as integers (cudaStream_t). Every argument check lives here, so the messages are the same
// whichever framework the caller uses; failures raise tdist.Error (tdist::Error) or
// tdist.TimeoutError (tdist::TimeoutError).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "tdist/version.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/ops/collective_select.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"  // RowChunks
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/tcp_store.hpp"
#include "tdist/runtime/world.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

PyObject* g_error = nullptr;          // tdist.Error
PyObject* g_timeout_error = nullptr;  // tdist.TimeoutError

template <typename... Args>
std::string msg(Args&&... args) {
  return tdist::detail::concat(std::forward<Args>(args)...);
}

[[noreturn]] void fail(const std::string& what) { throw tdist::Error(what); }

// ---------------------------------------------------------------------------------------------
// Tensor descriptors
// ---------------------------------------------------------------------------------------------

// (data pointer, element count, dtype name, device type, device index (-1: unknown), contiguous)
using DescTuple = std::tuple<uint64_t, int64_t, std::string, std::string, int, bool>;

struct Desc {
  uint64_t ptr = 0;
  int64_t numel = 0;
  std::string dtype;
  std::string device_type;
  int device_index = -1;
  bool contiguous = true;
  Desc() = default;
  explicit Desc(const DescTuple& t)
      : ptr(std::get<0>(t)), numel(std::get<1>(t)), dtype(std::get<2>(t)), device_type(std::get<3>(t)),
        device_index(std::get<4>(t)), contiguous(std::get<5>(t)) {}
  void* data() const { return reinterpret_cast<void*>(ptr); }
};

// Collective dtypes, by the names torch, DLPack and __cuda_array_interface__ descriptors use.
std::optional<tdist::DType> collective_dtype(const std::string& name) {
  if (name == "float32") return tdist::DType::kFloat32;
  if (name == "float16") return tdist::DType::kFloat16;
  if (name == "bfloat16") return tdist::DType::kBFloat16;
  return std::nullopt;
}

// `device`: the runtime's GPU, or -1 when unknown (checks that need no GPU).
tdist::DType check_tensor(const char* op, const char* name, const Desc& d, int device) {
  if (d.device_type != "cuda")
    fail(msg("tdist.", op, ": '", name, "' must be a CUDA tensor, got one on device type '", d.device_type, "'"));
  auto dt = collective_dtype(d.dtype);
  if (!dt)
    fail(msg("tdist.", op, ": '", name, "' has dtype ", d.dtype,
                "; supported dtypes are bfloat16, float16 and float32"));
  if (!d.contiguous) fail(msg("tdist.", op, ": '", name, "' must be contiguous (call .contiguous() first)"));
  if (d.numel < 0) fail(msg("tdist.", op, ": '", name, "' has a negative element count"));
  if (device >= 0 && d.device_index >= 0 && d.device_index != device)
    fail(msg("tdist.", op, ": '", name, "' is on cuda:", d.device_index, " but tdist runs this rank on cuda:",
                device, " (the device given to tdist.init)"));
  if (d.numel > 0 && d.ptr == 0) fail(msg("tdist.", op, ": '", name, "' has a null data pointer"));
  return *dt;
}

void check_same_dtype(const char* op, const Desc& in, const Desc& out) {
  if (in.dtype != out.dtype)
    fail(msg("tdist.", op, ": 'output' has dtype ", out.dtype, " but 'input' has ", in.dtype,
                "; they must match"));
}

// Whether two byte ranges overlap.
bool overlap(const Desc& a, const Desc& b, size_t elem) {
  if (a.numel == 0 || b.numel == 0) return false;
  const uint64_t a_end = a.ptr + static_cast<uint64_t>(a.numel) * elem;
  const uint64_t b_end = b.ptr + static_cast<uint64_t>(b.numel) * elem;
  return a.ptr < b_end && b.ptr < a_end;
}

// The checks every collective makes of its two tensors, input first; returns their dtype.
tdist::DType check_input_output(const char* op, const Desc& in, const Desc& out, int device) {
  const auto dt = check_tensor(op, "input", in, device);
  check_tensor(op, "output", out, device);
  check_same_dtype(op, in, out);
  return dt;
}

// The argument checks of each op; pure (no GPU), shared by the runtime and the CPU tests.
tdist::DType check_all_reduce(const Desc& in, const Desc& out, int device) {
  const auto dt = check_input_output("all_reduce", in, out, device);
  if (in.numel != out.numel)
    fail(msg("tdist.all_reduce: 'output' has ", out.numel, " elements but 'input' has ", in.numel,
                "; they must match"));
  if (in.ptr != out.ptr && overlap(in, out, tdist::dtype_size(dt)))
    fail("tdist.all_reduce: 'input' and 'output' overlap without being the same tensor");
  return dt;
}

// AllGather and ReduceScatter: `whole` holds world_size parts of `part`'s size, and the op runs in
// place when `part` is rank's part of `whole`; the names are the tensors' argument names.
void check_whole_and_part(const char* op, const Desc& whole, const char* whole_name, const Desc& part,
                          const char* part_name, size_t elem, int world_size, int rank) {
  if (whole.numel != part.numel * world_size)
    fail(msg("tdist.", op, ": '", whole_name, "' has ", whole.numel, " elements, expected world_size * ", part_name,
             ".numel() = ", world_size, " * ", part.numel, " = ", part.numel * world_size));
  const bool in_place = part.ptr == whole.ptr + static_cast<uint64_t>(rank) * part.numel * elem;
  if (!in_place && overlap(part, whole, elem))
    fail(msg("tdist.", op, ": '", part_name, "' overlaps '", whole_name, "' other than in place (", part_name, " is ",
             whole_name, "'s part for rank ", rank, ")"));
}

tdist::DType check_all_gather(const Desc& in, const Desc& out, int world_size, int rank, int device) {
  const auto dt = check_input_output("all_gather", in, out, device);
  check_whole_and_part("all_gather", out, "output", in, "input", tdist::dtype_size(dt), world_size, rank);
  return dt;
}

tdist::DType check_reduce_scatter(const Desc& in, const Desc& out, int world_size, int rank, int device) {
  const auto dt = check_input_output("reduce_scatter", in, out, device);
  check_whole_and_part("reduce_scatter", in, "input", out, "output", tdist::dtype_size(dt), world_size, rank);
  return dt;
}

// The binding of check_all_gather / check_reduce_scatter: descriptor tuples in, dtype name out.
template <tdist::DType (*Check)(const Desc&, const Desc&, int, int, int)>
std::string check_by_rank(const DescTuple& in, const DescTuple& out, int world_size, int rank, int device) {
  return tdist::to_string(Check(Desc(in), Desc(out), world_size, rank, device));
}

// ---------------------------------------------------------------------------------------------
// Overlapped GEMMs (tdist/ops/gemm_overlap.hpp): argument checks on descriptors
// ---------------------------------------------------------------------------------------------

// The three layers by their Python names.
tdist::OverlapOp parse_gemm_op(const std::string& op) {
  if (op == "ag_gemm") return tdist::OverlapOp::kAllGatherGemm;
  if (op == "gemm_rs") return tdist::OverlapOp::kGemmReduceScatter;
  if (op == "gemm_ar") return tdist::OverlapOp::kGemmAllReduce;
  fail(msg("tdist: unknown overlapped GEMM '", op, "' (ag_gemm, gemm_rs, gemm_ar)"));
}

// One operand of an overlapped GEMM: CUDA, bf16 / fp16, contiguous, on this rank's GPU, 16-byte
// aligned (the GEMM's TMA and the copy engine read whole 16-byte units).
tdist::DType check_gemm_tensor(const char* op, const char* name, const Desc& d, int device) {
  // The GEMMs' narrower dtype list where check_tensor would check the dtype, then its other checks.
  if (d.device_type == "cuda" && d.dtype != "bfloat16" && d.dtype != "float16")
    fail(msg("tdist.", op, ": '", name, "' has dtype ", d.dtype, "; the overlapped GEMMs take bfloat16 or float16"));
  const tdist::DType dtype = check_tensor(op, name, d, device);
  if (d.numel > 0 && d.ptr % 16 != 0)
    fail(msg("tdist.", op, ": '", name, "' must start at a 16-byte aligned address, got 0x", std::hex, d.ptr,
             std::dec, " (a view at an odd offset; call .clone() first)"));
  return dtype;
}

// The operands of one call by role; `gathered` only for ag_gemm (optional there).
struct GemmOperands {
  Desc a, b, d;
  std::optional<Desc> gathered;
};

const char* a_name(tdist::OverlapOp op) { return op == tdist::OverlapOp::kAllGatherGemm ? "a_local" : "a"; }

// Checks of one ag_gemm / gemm_rs / gemm_ar call (pure: no GPU). m: the whole M (all ranks' rows),
// n, k: this rank's GEMM (ag_gemm: the local shard's N; gemm_rs / gemm_ar: the local K slice).
tdist::DType check_gemm_overlap(tdist::OverlapOp op, const GemmOperands& t, int64_t m, int64_t n, int64_t k,
                                int world_size, int rank, int device) {
  const std::string op_name = tdist::to_string(op);
  const char* o = op_name.c_str();
  const char* an = a_name(op);
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail(msg("tdist.", o, ": rank ", rank, " is out of range for a world of ", world_size));
  if (m < 0 || m >= (int64_t{1} << 31)) fail(msg("tdist.", o, ": 'm' must be in [0, 2^31), got ", m));
  if (n <= 0 || n % 8 != 0 || n >= (int64_t{1} << 31))
    fail(msg("tdist.", o, ": N (rows of 'b') must be a positive multiple of 8 below 2^31, got ", n));
  if (k <= 0 || k % 8 != 0 || k >= (int64_t{1} << 31))
    fail(msg("tdist.", o, ": K (columns of '", an, "' and 'b') must be a positive multiple of 8 below 2^31, got ", k));
  if (t.gathered && op != tdist::OverlapOp::kAllGatherGemm)
    fail(msg("tdist.", o, ": only ag_gemm has a gathered output"));
  const auto dt = check_gemm_tensor(o, an, t.a, device);
  check_gemm_tensor(o, "b", t.b, device);
  check_gemm_tensor(o, "d", t.d, device);
  if (t.gathered) check_gemm_tensor(o, "gathered", *t.gathered, device);
  auto same_dtype = [&](const char* name, const Desc& x) {
    if (x.dtype != t.a.dtype)
      fail(msg("tdist.", o, ": '", name, "' has dtype ", x.dtype, " but '", an, "' has ", t.a.dtype,
               "; they must match"));
  };
  same_dtype("b", t.b);
  same_dtype("d", t.d);
  if (t.gathered) same_dtype("gathered", *t.gathered);
  // This rank's rows of m, split as the library splits them (m and the rank are checked above).
  const tdist::kernels::gemm::RowChunks chunks{static_cast<uint64_t>(m), world_size};
  const int64_t rows = static_cast<int64_t>(chunks.rows(rank));
  auto count = [&](const char* name, const Desc& x, int64_t want, const std::string& formula) {
    if (x.numel != want)
      fail(msg("tdist.", o, ": '", name, "' has ", x.numel, " elements, expected ", formula, " = ", want));
  };
  const bool ag = op == tdist::OverlapOp::kAllGatherGemm;
  const bool rs = op == tdist::OverlapOp::kGemmReduceScatter;
  count(an, t.a, (ag ? rows : m) * k,
        ag ? msg("this rank's rows of m=", m, " (", rows, ") x K=", k) : msg("m=", m, " x K=", k));
  count("b", t.b, n * k, msg("N=", n, " x K=", k));
  count("d", t.d, (rs ? rows : m) * n,
        rs ? msg("this rank's rows of m=", m, " (", rows, ") x N=", n) : msg("m=", m, " x N=", n));
  if (t.gathered) count("gathered", *t.gathered, m * k, msg("m=", m, " x K=", k));
  const size_t elem = tdist::dtype_size(dt);
  auto disjoint = [&](const char* out_name, const Desc& out, const char* other_name, const Desc& other) {
    if (overlap(out, other, elem))
      fail(msg("tdist.", o, ": '", out_name, "' overlaps '", other_name, "'; outputs must not share memory with "
               "the inputs or each other"));
  };
  disjoint("d", t.d, an, t.a);
  disjoint("d", t.d, "b", t.b);
  if (t.gathered) {
    disjoint("gathered", *t.gathered, an, t.a);
    disjoint("gathered", *t.gathered, "b", t.b);
    disjoint("gathered", *t.gathered, "d", t.d);
  }
  return dt;
}

// Symmetric memory a context takes from the heap (the library's *_heap_bytes: the sizes its
// constructors allocate); k for ag_gemm, max_n for gemm_rs / gemm_ar.
size_t gemm_context_bytes(tdist::OverlapOp op, tdist::DType dtype, int64_t max_m, int64_t k, int64_t max_n,
                          int world_size, int num_sms) {
  const int w = std::max(world_size, 1);
  if (op == tdist::OverlapOp::kAllGatherGemm)
    return tdist::all_gather_gemm_heap_bytes({.max_m = max_m, .k = k, .dtype = dtype}, w, num_sms);
  const tdist::GemmReduceScatterConfig c{.max_m = max_m, .max_n = max_n, .dtype = dtype};
  return op == tdist::OverlapOp::kGemmAllReduce ? tdist::gemm_all_reduce_heap_bytes(c, w, num_sms)
                                                : tdist::gemm_reduce_scatter_heap_bytes(c, w, num_sms);
}

// DLPack dtype (code, bits) -> the names used above.
std::string dlpack_dtype_name(const nb::dlpack::dtype& t) {
  const int code = t.code, bits = t.bits;
  if (t.lanes != 1) return msg("vector(", code, ",", bits, "x", t.lanes, ")");
  switch (code) {
    case static_cast<int>(nb::dlpack::dtype_code::Int): return msg("int", bits);
    case static_cast<int>(nb::dlpack::dtype_code::UInt): return msg("uint", bits);
    case static_cast<int>(nb::dlpack::dtype_code::Float): return msg("float", bits);
    case static_cast<int>(nb::dlpack::dtype_code::Bfloat): return msg("bfloat", bits);
    case static_cast<int>(nb::dlpack::dtype_code::Complex): return msg("complex", bits);
    case static_cast<int>(nb::dlpack::dtype_code::Bool): return "bool";
    default: return msg("dlpack(", code, ",", bits, ")");
  }
}

std::string dlpack_device_name(int type) {
  switch (type) {
    case nb::device::cpu::value: return "cpu";
    case nb::device::cuda::value: return "cuda";
    case nb::device::cuda_host::value: return "cuda_host";
    case nb::device::cuda_managed::value: return "cuda_managed";
    case nb::device::rocm::value: return "rocm";
    default: return msg("dlpack_device_", type);
  }
}

DescTuple dlpack_describe(nb::ndarray<nb::ro> a) {
  int64_t numel = 1;
  bool contiguous = true;
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    const int64_t n = static_cast<int64_t>(a.shape(i));
    numel *= n;
    if (n != 1 && a.stride(i) != expected) contiguous = false;
    expected *= n;
  }
  return {reinterpret_cast<uint64_t>(a.data()), numel, dlpack_dtype_name(a.dtype()),
          dlpack_device_name(a.device_type()), a.device_id(), contiguous};
}

// ---------------------------------------------------------------------------------------------
// Runtime: World + SymmetricHeap + Collectives of this process
// ---------------------------------------------------------------------------------------------

class Runtime {
 public:
  // From the launcher's environment (tdistrun, torchrun without an agent store, mpirun, Slurm).
  static std::unique_ptr<Runtime> from_env(int device, size_t heap_bytes, size_t max_bytes, double timeout_s) {
    auto rt = std::unique_ptr<Runtime>(new Runtime());
    tdist::WorldOptions opts;
    opts.device = device;
    if (timeout_s > 0) opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    rt->world_ = std::make_unique<tdist::World>(opts);
    rt->finish_init(heap_bytes, max_bytes);
    return rt;
  }

  // From an NCCL unique id that every rank received (through torch.distributed or a store).
  static std::unique_ptr<Runtime> from_unique_id(const nb::bytes& uid, int rank, int world_size, int device,
                                                 size_t heap_bytes, size_t max_bytes, double timeout_s) {
    ncclUniqueId id;
    if (uid.size() != sizeof(id))
      fail(msg("tdist.init: the NCCL unique id has ", uid.size(), " bytes, expected ", sizeof(id)));
    if (world_size < 1 || rank < 0 || rank >= world_size)
      fail(msg("tdist.init: rank ", rank, " is out of range for a world of ", world_size));
    if (device < 0) fail(msg("tdist.init: device must be a CUDA device index, got ", device));
    std::memcpy(&id, uid.c_str(), sizeof(id));
    auto rt = std::unique_ptr<Runtime>(new Runtime());
    {
      nb::gil_scoped_release release;
      int count = 0;
      const cudaError_t err = cudaGetDeviceCount(&count);
      if (err != cudaSuccess || count == 0)
        fail(msg("tdist.init: no CUDA device is usable (", cudaGetErrorString(err), ")"));
      if (device >= count) fail(msg("tdist.init: device ", device, " requested, ", count, " visible"));
      if (cudaSetDevice(device) != cudaSuccess) fail(msg("tdist.init: cudaSetDevice(", device, ") failed"));
      // Every rank is alive here: the id came from a collective of torch.distributed.
      const ncclResult_t r = ncclCommInitRank(&rt->own_comm_, world_size, id, rank);
      if (r != ncclSuccess) fail(msg("tdist.init: ncclCommInitRank failed: ", ncclGetErrorString(r)));
      const auto timeout = timeout_s > 0 ? std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))
                                         : tdist::TcpStoreOptions::default_timeout();
      rt->world_ = std::make_unique<tdist::World>(rt->own_comm_, timeout);
    }
    rt->finish_init(heap_bytes, max_bytes);
    return rt;
  }

  // Teardown is collective, so it happens in close() (tdist.finalize) only. A runtime never closed
  // (the interpreter exits without finalize, or after an error on some rank) is left to the process's
  // exit: waiting here for peers that may be gone could hang the exit.
  ~Runtime() {
    if (closed_) return;
    for (auto& [key, ctx] : ag_) (void)ctx.release();
    for (auto& [key, ctx] : rs_) (void)ctx.release();
    for (auto& [key, ctx] : ar_) (void)ctx.release();
    (void)coll_.release();
    (void)heap_.release();
    (void)world_.release();
  }

  // Collective teardown: the context, the heap (every buffer), the World, then our communicator.
  void close() {
    if (closed_) return;
    closed_ = true;
    nb::gil_scoped_release release;
    if (world_) cudaSetDevice(world_->device());
    cudaDeviceSynchronize();
    ag_.clear();  // the GEMM contexts free their symmetric buffers into the heap
    rs_.clear();
    ar_.clear();
    coll_.reset();
    buffers_.clear();
    heap_.reset();
    world_.reset();
    if (own_comm_) {
      if (ncclCommFinalize(own_comm_) == ncclSuccess) ncclCommDestroy(own_comm_);
      else ncclCommAbort(own_comm_);
      own_comm_ = nullptr;
    }
  }

  bool closed() const { return closed_; }
  int rank() const { return world().rank(); }
  int world_size() const { return world().world_size(); }
  int local_rank() const { return world().local_rank(); }
  int local_world_size() const { return world().local_world_size(); }
  int device() const { return world().device(); }
  size_t heap_capacity() const { return heap().capacity(); }
  size_t heap_bytes_in_use() const { return heap().bytes_in_use(); }
  size_t max_bytes() const { return coll().max_bytes(); }

  // Collective: a zeroed symmetric buffer; returns its address.
  uint64_t allocate(size_t bytes) {
    if (bytes == 0) bytes = 1;  // an empty tensor still gets a distinct address
    void* p;
    {
      nb::gil_scoped_release release;
      p = heap().allocate(bytes);
    }
    buffers_[reinterpret_cast<uint64_t>(p)] = bytes;
    return reinterpret_cast<uint64_t>(p);
  }

  // Collective: frees a buffer from allocate(); `ptr` must be its start.
  void free(uint64_t ptr) {
    auto it = buffers_.find(ptr);
    if (it == buffers_.end())
      fail(msg("tdist.free: 0x", std::hex, ptr, " is not the start of a live buffer from tdist.empty"));
    buffers_.erase(it);
    nb::gil_scoped_release release;
    // The buffer may still be read by queued work of any stream.
    cudaDeviceSynchronize();
    heap().free(reinterpret_cast<void*>(ptr));
  }

  bool is_symmetric(uint64_t ptr) const { return heap().contains(reinterpret_cast<const void*>(ptr)); }

  uint64_t peer_ptr(uint64_t ptr, int peer) const {
    if (!is_symmetric(ptr))
      fail("tdist.peer: the tensor does not lie in tdist's symmetric heap (allocate it with tdist.empty)");
    if (peer < 0 || peer >= world_size())
      fail(msg("tdist.peer: rank ", peer, " is out of range for a world of ", world_size()));
    return reinterpret_cast<uint64_t>(heap().peer_ptr(reinterpret_cast<const void*>(ptr), peer));
  }

  // The collectives: tensors checked before the method is parsed (a bad tensor is reported first),
  // then run_collective with the count Collectives takes (per rank for all_gather and reduce_scatter).
  void all_reduce(const DescTuple& in_t, const DescTuple& out_t, uint64_t stream, const std::string& method) {
    const Desc in(in_t), out(out_t);
    const auto dt = check_all_reduce(in, out, device());
    run_collective(&tdist::Collectives::all_reduce, in, out, in.numel, dt, stream,
                   tdist::parse_all_reduce_method(method, "method"));
  }

  void all_gather(const DescTuple& in_t, const DescTuple& out_t, uint64_t stream, const std::string& method) {
    const Desc in(in_t), out(out_t);
    const auto dt = check_all_gather(in, out, world_size(), rank(), device());
    run_collective(&tdist::Collectives::all_gather, in, out, in.numel, dt, stream,
                   tdist::parse_all_gather_method(method, "method"));
  }

  void reduce_scatter(const DescTuple& in_t, const DescTuple& out_t, uint64_t stream, const std::string& method) {
    const Desc in(in_t), out(out_t);
    const auto dt = check_reduce_scatter(in, out, world_size(), rank(), device());
    run_collective(&tdist::Collectives::reduce_scatter, in, out, out.numel, dt, stream,
                   tdist::parse_reduce_scatter_method(method, "method"));
  }

  void barrier(uint64_t stream) {
    nb::gil_scoped_release release;
    coll().barrier(reinterpret_cast<cudaStream_t>(stream));
  }

  // The method a call would run (auto and the environment override resolved).
  std::string all_reduce_method(const DescTuple& in_t, const DescTuple& out_t, const std::string& method) const {
    const Desc in(in_t), out(out_t);
    const auto dt = check_all_reduce(in, out, device());
    return tdist::to_string(coll().all_reduce_method(in.data(), out.data(), static_cast<size_t>(in.numel), dt,
                                                     tdist::parse_all_reduce_method(method, "method")));
  }

  // Overlapped GEMMs. Collective: every rank calls with the same m, n, k and method. The context for
  // the call's (op, dtype[, K]) is created on first use and re-created larger when a call exceeds it
  // (both collective, never while `stream` captures a CUDA graph). Returns the method that ran.
  std::string ag_gemm(const DescTuple& a, const DescTuple& b, const DescTuple& d, const std::optional<DescTuple>& gathered,
                      int64_t m, int64_t n, int64_t k, uint64_t stream, const std::string& method) {
    return gemm(tdist::OverlapOp::kAllGatherGemm, a, b, d, gathered, m, n, k, stream, method, true);
  }
  std::string gemm_rs(const DescTuple& a, const DescTuple& b, const DescTuple& d, int64_t m, int64_t n, int64_t k,
                      uint64_t stream, const std::string& method) {
    return gemm(tdist::OverlapOp::kGemmReduceScatter, a, b, d, std::nullopt, m, n, k, stream, method, true);
  }
  std::string gemm_ar(const DescTuple& a, const DescTuple& b, const DescTuple& d, int64_t m, int64_t n, int64_t k,
                      uint64_t stream, const std::string& method) {
    return gemm(tdist::OverlapOp::kGemmAllReduce, a, b, d, std::nullopt, m, n, k, stream, method, true);
  }
  // The method such a call would run ("auto" and TDIST_OVERLAP_METHOD resolved), without running it;
  // creates or grows the context like a call (collective then).
  std::string gemm_method(const std::string& op, const DescTuple& a, const DescTuple& b, const DescTuple& d,
                          const std::optional<DescTuple>& gathered, int64_t m, int64_t n, int64_t k, uint64_t stream,
                          const std::string& method) {
    return gemm(parse_gemm_op(op), a, b, d, gathered, m, n, k, stream, method, false);
  }

  // The live GEMM contexts: (op, dtype, k (ag_gemm; 0 otherwise), max_m, max_n (gemm_rs / gemm_ar; 0 otherwise)).
  std::vector<std::tuple<std::string, std::string, int64_t, int64_t, int64_t>> gemm_contexts() const {
    std::vector<std::tuple<std::string, std::string, int64_t, int64_t, int64_t>> v;
    for (const auto& [key, ctx] : ag_)
      if (ctx) v.emplace_back("ag_gemm", tdist::to_string(key.first), key.second, ctx->config().max_m, 0);
    for (const auto& [key, ctx] : rs_)
      if (ctx) v.emplace_back("gemm_rs", tdist::to_string(key), 0, ctx->config().max_m, ctx->config().max_n);
    for (const auto& [key, ctx] : ar_)
      if (ctx) v.emplace_back("gemm_ar", tdist::to_string(key), 0, ctx->config().max_m, ctx->config().max_n);
    return v;
  }

  // Host-side collective over the ranks (through the World); for tests and the benchmark.
  void host_barrier(const std::string& tag) {
    nb::gil_scoped_release release;
    world_mut().barrier(tag);
  }

 private:
  Runtime() = default;

  void finish_init(size_t heap_bytes, size_t max_bytes) {
    nb::gil_scoped_release release;
    heap_ = std::make_unique<tdist::SymmetricHeap>(*world_, heap_bytes);
    if (cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, world_->device()) != cudaSuccess)
      fail("tdist.init: cannot read the GPU's SM count");
    if (max_bytes == 0) max_bytes = std::max<size_t>(heap_->capacity() / 8, 1 << 20);
    if (2 * max_bytes >= heap_->capacity())
      fail(msg("tdist.init: max_bytes=", max_bytes, " needs a workspace of 2 * max_bytes, more than the "
                  "symmetric heap's ", heap_->capacity(), " bytes; raise heap_size or lower max_bytes"));
    coll_ = std::make_unique<tdist::Collectives>(*world_, *heap_, max_bytes);
  }

  // What the collective calls share once their arguments are checked: nothing to run for no
  // elements, else Collectives' call on `stream` with the GIL released.
  template <typename Method>
  using CollectiveCall = void (tdist::Collectives::*)(const void*, void*, size_t, tdist::DType, cudaStream_t, Method);
  template <typename Method>
  void run_collective(CollectiveCall<Method> call, const Desc& in, const Desc& out, int64_t count, tdist::DType dt,
                      uint64_t stream, Method method) {
    if (count == 0) return;
    nb::gil_scoped_release release;
    (coll().*call)(in.data(), out.data(), static_cast<size_t>(count), dt, reinterpret_cast<cudaStream_t>(stream),
                   method);
  }

  std::string gemm(tdist::OverlapOp op, const DescTuple& a_t, const DescTuple& b_t, const DescTuple& d_t,
                   const std::optional<DescTuple>& g_t, int64_t m, int64_t n, int64_t k, uint64_t stream_id,
                   const std::string& method, bool run) {
    GemmOperands t{Desc(a_t), Desc(b_t), Desc(d_t), std::nullopt};
    if (g_t) t.gathered.emplace(*g_t);
    const auto dt = check_gemm_overlap(op, t, m, n, k, world_size(), rank(), device());
    const auto requested = tdist::parse_overlap_method(method, "method");
    if (m == 0) return tdist::to_string(requested);  // nothing to compute; no context needed
    const auto stream = reinterpret_cast<cudaStream_t>(stream_id);
    tdist::OverlapMethod chosen;
    // The context's choice for `requested`, then (run) the call, without the GIL.
    const auto resolve_and_run = [&](auto& ctx, const auto& args) {
      nb::gil_scoped_release release;
      chosen = ctx.method(args, requested);
      if (run) ctx.run(args, stream, chosen);
    };
    switch (op) {
      case tdist::OverlapOp::kAllGatherGemm: {
        tdist::AllGatherGemmArgs args;
        args.a_local = t.a.data();
        args.b = t.b.data();
        args.d = t.d.data();
        args.a_gathered = t.gathered ? t.gathered->data() : nullptr;
        args.m = m;
        args.n = n;
        resolve_and_run(ag_context(dt, k, m, stream), args);
        break;
      }
      case tdist::OverlapOp::kGemmReduceScatter: {
        const tdist::GemmReduceScatterArgs args{t.a.data(), t.b.data(), t.d.data(), m, n, k};
        resolve_and_run(rs_context(rs_, op, dt, m, n, stream), args);
        break;
      }
      case tdist::OverlapOp::kGemmAllReduce: {
        const tdist::GemmAllReduceArgs args{t.a.data(), t.b.data(), t.d.data(), m, n, k};
        resolve_and_run(rs_context(ar_, op, dt, m, n, stream), args);
        break;
      }
    }
    return tdist::to_string(chosen);
  }

  static bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
      (void)cudaGetLastError();  // e.g. the legacy stream while another stream captures: treat as capturing
      return true;
    }
    return status != cudaStreamCaptureStatusNone;
  }

  // Before a context is (re)created: not during a graph capture, and the heap must have room.
  // `have` describes the context being replaced ("" when none), `bytes_old` its estimated heap use.
  void check_new_context(tdist::OverlapOp op, const std::string& want, const std::string& have, size_t bytes_new,
                         size_t bytes_old, cudaStream_t stream) const {
    const char* o = tdist::to_string(op);
    if (capturing(stream))
      fail(msg("tdist.", o, ": this call needs a new GEMM context (", want, have.empty() ? "" : "; the current one has ",
               have, ") but the stream is capturing a CUDA graph, and creating a context allocates symmetric memory, "
               "compiles kernels and synchronises every rank. Call the op once with the largest shapes before the "
               "capture (a warm-up, on every rank)"));
    const size_t free_bytes = heap().capacity() - heap().bytes_in_use() + bytes_old;
    if (bytes_new > free_bytes)
      fail(msg("tdist.", o, ": its GEMM context (", want, ") needs about ", mib(bytes_new),
               " MiB of symmetric memory, but the heap has ", mib(free_bytes), " MiB free of ", mib(heap().capacity()),
               " MiB; raise heap_size in tdist.init (e.g. heap_size=\"", suggest_heap(bytes_new - free_bytes),
               "\") or free tdist.empty buffers"));
  }

  static size_t mib(size_t bytes) { return (bytes + (size_t{1} << 20) - 1) >> 20; }
  std::string suggest_heap(size_t missing) const {
    const size_t gib = ((heap().capacity() + missing) + (size_t{1} << 30) - 1) >> 30;
    return msg(gib, "G");
  }

  // Creates a context (collective), rewording a heap shortage so that it names heap_size.
  template <typename Ctx, typename Config>
  std::unique_ptr<Ctx> make_context(tdist::OverlapOp op, const Config& config, const std::string& want) {
    try {
      nb::gil_scoped_release release;
      return std::make_unique<Ctx>(world_mut(), heap(), config);
    } catch (const tdist::TimeoutError&) {
      throw;
    } catch (const tdist::Error& e) {
      const std::string what = e.what();
      if (what.find("out of memory") != std::string::npos)
        fail(msg("tdist.", tdist::to_string(op), ": creating its GEMM context (", want,
                 ") ran out of symmetric memory; raise heap_size in tdist.init. ", what));
      throw;
    }
  }

  // Growth: a context re-created for a larger M takes at least twice the old max_m when the heap has
  // room for it, so a run of growing M re-creates it O(log M) times.
  static int64_t grown(int64_t old_max, int64_t need) {
    return need <= old_max ? old_max : std::max(need, 2 * old_max);
  }

  tdist::AllGatherGemm& ag_context(tdist::DType dt, int64_t k, int64_t m, cudaStream_t stream) {
    auto& slot = ag_[{dt, k}];
    if (slot && slot->config().max_m >= m) return *slot;
    const int w = world_size();
    const auto op = tdist::OverlapOp::kAllGatherGemm;
    const int64_t old_m = slot ? slot->config().max_m : 0;
    const size_t old_bytes = slot ? gemm_context_bytes(op, dt, old_m, k, 0, w, num_sms_) : 0;
    const size_t room = heap().capacity() - heap().bytes_in_use() + old_bytes;
    tdist::AllGatherGemmConfig c;
    c.k = k;
    c.dtype = dt;
    c.max_m = grown(old_m, m);
    if (gemm_context_bytes(op, dt, c.max_m, k, 0, w, num_sms_) > room) c.max_m = m;
    const std::string want = msg("max_m=", c.max_m, ", K=", k, ", ", tdist::to_string(dt));
    check_new_context(op, want, slot ? msg("max_m=", old_m) : std::string(),
                      gemm_context_bytes(op, dt, c.max_m, k, 0, w, num_sms_), old_bytes, stream);
    if (slot) {
      nb::gil_scoped_release release;
      slot.reset();  // collective: its buffers go back to the heap first
    }
    slot = make_context<tdist::AllGatherGemm>(op, c, want);
    return *slot;
  }

  template <typename Ctx>
  Ctx& rs_context(std::map<tdist::DType, std::unique_ptr<Ctx>>& contexts, tdist::OverlapOp op, tdist::DType dt,
                  int64_t m, int64_t n, cudaStream_t stream) {
    auto& slot = contexts[dt];
    if (slot && slot->config().max_m >= m && slot->config().max_n >= n) return *slot;
    const int w = world_size();
    const int64_t old_m = slot ? slot->config().max_m : 0, old_n = slot ? slot->config().max_n : 0;
    const size_t old_bytes = slot ? gemm_context_bytes(op, dt, old_m, 0, old_n, w, num_sms_) : 0;
    const size_t room = heap().capacity() - heap().bytes_in_use() + old_bytes;
    tdist::GemmReduceScatterConfig c;
    c.dtype = dt;
    c.max_n = std::max(n, old_n);
    c.max_m = grown(old_m, m);
    if (gemm_context_bytes(op, dt, c.max_m, 0, c.max_n, w, num_sms_) > room) c.max_m = std::max(m, old_m);
    if (gemm_context_bytes(op, dt, c.max_m, 0, c.max_n, w, num_sms_) > room) {  // the old sizes do not fit beside: just this call's
      c.max_m = m;
      c.max_n = n;
    }
    const std::string want = msg("max_m=", c.max_m, ", max_n=", c.max_n, ", ", tdist::to_string(dt));
    check_new_context(op, want, slot ? msg("max_m=", old_m, ", max_n=", old_n) : std::string(),
                      gemm_context_bytes(op, dt, c.max_m, 0, c.max_n, w, num_sms_), old_bytes, stream);
    if (slot) {
      nb::gil_scoped_release release;
      slot.reset();
    }
    slot = make_context<Ctx>(op, c, want);
    return *slot;
  }

  const tdist::World& world() const {
    if (!world_) fail("tdist: the runtime is closed (tdist.finalize was called)");
    return *world_;
  }
  tdist::World& world_mut() {
    if (!world_) fail("tdist: the runtime is closed (tdist.finalize was called)");
    return *world_;
  }
  tdist::SymmetricHeap& heap() const {
    if (!heap_) fail("tdist: the runtime is closed (tdist.finalize was called)");
    return *heap_;
  }
  tdist::Collectives& coll() const {
    if (!coll_) fail("tdist: the runtime is closed (tdist.finalize was called)");
    return *coll_;
  }

  ncclComm_t own_comm_ = nullptr;
  std::unique_ptr<tdist::World> world_;
  std::unique_ptr<tdist::SymmetricHeap> heap_;
  int num_sms_ = 0;  // of this rank's GPU: the overlap contexts' Collectives size their flags by it
  std::unique_ptr<tdist::Collectives> coll_;
  std::map<uint64_t, size_t> buffers_;  // live tdist.empty buffers: address -> bytes
  // Overlapped-GEMM contexts, created on first use and re-created larger when a call exceeds them.
  std::map<std::pair<tdist::DType, int64_t>, std::unique_ptr<tdist::AllGatherGemm>> ag_;  // by (dtype, K)
  std::map<tdist::DType, std::unique_ptr<tdist::GemmReduceScatter>> rs_;                  // by dtype
  std::map<tdist::DType, std::unique_ptr<tdist::GemmAllReduce>> ar_;                      // by dtype
  bool closed_ = false;
};

nb::bytes nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) fail(msg("ncclGetUniqueId failed: ", ncclGetErrorString(r)));
  return nb::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

// A DLPack-exporting view of device memory (no copy); `owner` stays alive as long as the view.
nb::ndarray<nb::array_api> device_array(uint64_t ptr, const std::vector<size_t>& shape, const std::vector<int64_t>& strides,
                           int dtype_code, int bits, int device_id, nb::handle owner) {
  if (!strides.empty() && strides.size() != shape.size()) fail("device_array: strides and shape differ in length");
  nb::dlpack::dtype dt{static_cast<uint8_t>(dtype_code), static_cast<uint8_t>(bits), 1};
  return nb::ndarray<nb::array_api>(reinterpret_cast<void*>(ptr), shape.size(), shape.data(), owner,
                       strides.empty() ? nullptr : strides.data(), dt, nb::device::cuda::value, device_id);
}

// ---------------------------------------------------------------------------------------------
// JIT
// ---------------------------------------------------------------------------------------------

class PyModule;

class PyKernel {
 public:
  PyKernel(std::shared_ptr<PyModule> module, std::string name) : module_(std::move(module)), name_(std::move(name)) {}
  const std::string& name() const { return name_; }
  void launch(std::tuple<unsigned, unsigned, unsigned> grid, std::tuple<unsigned, unsigned, unsigned> block,
              const std::vector<std::pair<std::string, nb::object>>& args, size_t shared_bytes, uint64_t stream,
              std::tuple<unsigned, unsigned, unsigned> cluster, bool pdl);

 private:
  std::shared_ptr<PyModule> module_;
  std::string name_;
  tdist::jit::Kernel kernel_;
};

class PyModule : public std::enable_shared_from_this<PyModule> {
 public:
  explicit PyModule(std::shared_ptr<const tdist::jit::CompiledKernel> c) : compiled_(std::move(c)) {}
  const tdist::jit::CompiledKernel& compiled() const { return *compiled_; }
  // Loads the cubin on first use (needs a GPU driver).
  tdist::jit::Kernel get(const std::string& name) {
    if (!module_) {
      if (!tdist::jit::driver_available())
        fail(msg("tdist.jit: cannot load kernel '", name,
                    "': no CUDA driver or GPU is available (compiling works without one, launching does not)"));
      module_ = tdist::jit::Module::load(compiled_);
    }
    return module_->kernel(name);
  }

 private:
  std::shared_ptr<const tdist::jit::CompiledKernel> compiled_;
  std::shared_ptr<tdist::jit::Module> module_;
};

void add_arg(tdist::jit::KernelArgs& a, size_t index, const std::string& type, const nb::object& v) {
  auto as_int = [&]() -> int64_t {
    if (!nb::isinstance<nb::int_>(v) && !nb::isinstance<nb::bool_>(v))
      fail(msg("tdist.jit: argument ", index, " is declared ", type, " but its value is not an int"));
    return nb::cast<int64_t>(v);
  };
  auto as_uint = [&]() -> uint64_t {
    if (!nb::isinstance<nb::int_>(v) && !nb::isinstance<nb::bool_>(v))
      fail(msg("tdist.jit: argument ", index, " is declared ", type, " but its value is not an int"));
    if (nb::cast<nb::int_>(v) < nb::int_(0))
      fail(msg("tdist.jit: argument ", index, " is declared ", type, " but its value is negative"));
    return nb::cast<uint64_t>(v);
  };
  auto as_float = [&]() -> double {
    if (!nb::isinstance<nb::float_>(v) && !nb::isinstance<nb::int_>(v))
      fail(msg("tdist.jit: argument ", index, " is declared ", type, " but its value is not a number"));
    return nb::cast<double>(v);
  };
  auto ranged = [&](int64_t x, int64_t lo, int64_t hi) {
    if (x < lo || x > hi) fail(msg("tdist.jit: argument ", index, " = ", x, " does not fit in ", type));
    return x;
  };
  auto uranged = [&](uint64_t x, uint64_t hi) {
    if (x > hi) fail(msg("tdist.jit: argument ", index, " = ", x, " does not fit in ", type));
    return x;
  };
  if (type == "ptr") a.add(static_cast<uint64_t>(as_uint()));
  else if (type == "i8") a.add(static_cast<int8_t>(ranged(as_int(), INT8_MIN, INT8_MAX)));
  else if (type == "i16") a.add(static_cast<int16_t>(ranged(as_int(), INT16_MIN, INT16_MAX)));
  else if (type == "i32") a.add(static_cast<int32_t>(ranged(as_int(), INT32_MIN, INT32_MAX)));
  else if (type == "i64") a.add(static_cast<int64_t>(as_int()));
  else if (type == "u8") a.add(static_cast<uint8_t>(uranged(as_uint(), UINT8_MAX)));
  else if (type == "u16") a.add(static_cast<uint16_t>(uranged(as_uint(), UINT16_MAX)));
  else if (type == "u32") a.add(static_cast<uint32_t>(uranged(as_uint(), UINT32_MAX)));
  else if (type == "u64") a.add(static_cast<uint64_t>(as_uint()));
  else if (type == "bool") a.add(static_cast<bool>(as_int() != 0));
  else if (type == "f32") a.add(static_cast<float>(as_float()));
  else if (type == "f64") a.add(as_float());
  else
    fail(msg("tdist.jit: argument ", index, " has unknown type '", type,
                "' (ptr, i8, i16, i32, i64, u8, u16, u32, u64, bool, f32, f64)"));
}

void PyKernel::launch(std::tuple<unsigned, unsigned, unsigned> grid, std::tuple<unsigned, unsigned, unsigned> block,
                      const std::vector<std::pair<std::string, nb::object>>& args, size_t shared_bytes,
                      uint64_t stream, std::tuple<unsigned, unsigned, unsigned> cluster, bool pdl) {
  auto dim = [](const std::tuple<unsigned, unsigned, unsigned>& t, const char* what) {
    const auto [x, y, z] = t;
    if (x == 0 || y == 0 || z == 0) fail(msg("tdist.jit: ", what, " dimensions must be positive"));
    return tdist::jit::Dim3(x, y, z);
  };
  tdist::jit::LaunchConfig cfg;
  cfg.grid = dim(grid, "grid");
  cfg.block = dim(block, "block");
  cfg.cluster = dim(cluster, "cluster");
  cfg.shared_bytes = shared_bytes;
  cfg.programmatic_dependent_launch = pdl;
  cfg.stream = reinterpret_cast<cudaStream_t>(stream);
  tdist::jit::KernelArgs a;
  for (size_t i = 0; i < args.size(); ++i) add_arg(a, i, args[i].first, args[i].second);
  if (!kernel_) kernel_ = module_->get(name_);
  nb::gil_scoped_release release;
  tdist::jit::launch(kernel_, cfg, a);
}

std::shared_ptr<PyModule> jit_compile(const std::string& source, const std::vector<std::string>& name_expressions,
                                      const std::string& arch, const std::string& file_name,
                                      const std::vector<std::tuple<std::string, std::string, std::string>>& constants,
                                      const std::vector<std::string>& defines,
                                      const std::vector<std::string>& include_dirs,
                                      const std::vector<std::string>& flags, const std::string& compiler) {
  tdist::jit::CompileRequest req;
  req.source = source;
  req.file_name = file_name;
  req.name_expressions = name_expressions;
  for (const auto& [type, name, value] : constants) req.constants.push_back({type, name, value});
  req.defines = defines;
  req.include_dirs = include_dirs;
  req.flags = flags;
  req.arch = arch;
  req.compiler = tdist::jit::parse_compiler_kind(compiler);
  std::shared_ptr<const tdist::jit::CompiledKernel> c;
  {
    nb::gil_scoped_release release;
    c = tdist::jit::compile(req);
  }
  return std::make_shared<PyModule>(std::move(c));
}

}  // namespace

NB_MODULE(_C, m) {
  nb::set_leak_warnings(false);
  m.doc() = "tdist's C++ core (libtdist) for Python; use the tdist package rather than this module.";

  g_error = PyErr_NewExceptionWithDoc(
      "tdist.Error",
      "Raised by tdist on a failure: an invalid argument, a CUDA, NCCL or compile error. Its message is "
      "the C++ library's (tdist::Error).",
      PyExc_RuntimeError, nullptr);
  nb::object timeout_bases = nb::make_tuple(nb::handle(g_error), nb::handle(PyExc_TimeoutError));
  g_timeout_error = PyErr_NewExceptionWithDoc(
      "tdist.TimeoutError",
      "A host-side wait (rendezvous, barrier, NCCL initialisation) ran past its deadline "
      "(tdist::TimeoutError). A subclass of tdist.Error and of the built-in TimeoutError.",
      timeout_bases.ptr(), nullptr);
  if (!g_error || !g_timeout_error) throw nb::python_error();
  m.attr("Error") = nb::handle(g_error);
  m.attr("TimeoutError") = nb::handle(g_timeout_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const tdist::TimeoutError& e) {
      PyErr_SetString(g_timeout_error, e.what());
    } catch (const tdist::Error& e) {
      PyErr_SetString(g_error, e.what());
    }
  });

  m.def("_raise_error", [](const std::string& what) { throw tdist::Error(what); },
        "Throws tdist::Error(what) from C++ (tests the exception translation).");
  m.def("_raise_timeout", [](const std::string& what) { throw tdist::TimeoutError(what); },
        "Throws tdist::TimeoutError(what) from C++ (tests the exception translation).");

  m.def("dlpack_describe", &dlpack_describe, "array"_a,
        "(ptr, numel, dtype, device_type, device_index, contiguous) of an object exporting DLPack.");
  m.def(
      "check_tensor",
      [](const std::string& op, const std::string& name, const DescTuple& d, int device) {
        return std::string(tdist::to_string(check_tensor(op.c_str(), name.c_str(), Desc(d), device)));
      },
      "op"_a, "name"_a, "desc"_a, "device"_a = -1,
      "Checks one collective argument (CUDA, dtype, contiguous, device); returns the dtype name.");
  m.def(
      "check_all_reduce",
      [](const DescTuple& in, const DescTuple& out, int device) {
        return std::string(tdist::to_string(check_all_reduce(Desc(in), Desc(out), device)));
      },
      "input"_a, "output"_a, "device"_a = -1, "Argument checks of all_reduce; returns the dtype name.");
  m.def("check_all_gather", &check_by_rank<check_all_gather>, "input"_a, "output"_a, "world_size"_a, "rank"_a = 0,
        "device"_a = -1, "Argument checks of all_gather; returns the dtype name.");
  m.def("check_reduce_scatter", &check_by_rank<check_reduce_scatter>, "input"_a, "output"_a, "world_size"_a,
        "rank"_a = 0, "device"_a = -1, "Argument checks of reduce_scatter; returns the dtype name.");
  m.def(
      "check_methods",
      [](const std::string& all_reduce, const std::string& all_gather, const std::string& reduce_scatter) {
        tdist::parse_all_reduce_method(all_reduce, "method");
        tdist::parse_all_gather_method(all_gather, "method");
        tdist::parse_reduce_scatter_method(reduce_scatter, "method");
      },
      "all_reduce"_a = std::string("auto"), "all_gather"_a = std::string("auto"), "reduce_scatter"_a = std::string("auto"),
      "Throws tdist.Error for a method name no op knows.");
  m.def(
      "check_gemm_overlap",
      [](const std::string& op, const DescTuple& a, const DescTuple& b, const DescTuple& d,
         const std::optional<DescTuple>& gathered, int64_t m, int64_t n, int64_t k, int world_size, int rank,
         int device) {
        GemmOperands t{Desc(a), Desc(b), Desc(d), std::nullopt};
        if (gathered) t.gathered.emplace(*gathered);
        return std::string(tdist::to_string(check_gemm_overlap(parse_gemm_op(op), t, m, n, k, world_size, rank, device)));
      },
      "op"_a, "a"_a, "b"_a, "d"_a, "gathered"_a.none(), "m"_a, "n"_a, "k"_a, "world_size"_a, "rank"_a = 0,
      "device"_a = -1,
      "Argument checks of ag_gemm / gemm_rs / gemm_ar on descriptors (m: all ranks' rows; n, k: this rank's "
      "GEMM); returns the dtype name.");
  m.def(
      "parse_overlap_method",
      [](const std::string& method) { return std::string(tdist::to_string(tdist::parse_overlap_method(method, "method"))); },
      "method"_a, "The overlapped GEMMs' method name (auto, fused, chunked, sequential, baseline); tdist.Error otherwise.");
  m.def(
      "gemm_context_bytes",
      [](const std::string& op, const std::string& dtype, int64_t max_m, int64_t k, int64_t max_n, int world_size,
         int num_sms) {
        const auto dt = collective_dtype(dtype);
        if (!dt) fail(msg("gemm_context_bytes: unknown dtype '", dtype, "'"));
        if (num_sms < 1) fail(msg("gemm_context_bytes: num_sms must be positive, got ", num_sms));
        return gemm_context_bytes(parse_gemm_op(op), *dt, max_m, k, max_n, world_size, num_sms);
      },
      "op"_a, "dtype"_a, "max_m"_a, "k"_a, "max_n"_a, "world_size"_a, "num_sms"_a = 132,
      "Symmetric-heap bytes of one overlapped-GEMM context (k for ag_gemm, max_n for gemm_rs / gemm_ar) on GPUs "
      "with num_sms SMs (132: H100 / H200 SXM).");
  m.def("parse_size", [](const std::string& s) { return tdist::SymmetricHeap::parse_size(s, "heap_size"); },
        "Bytes from '512M', '2G', '1048576' (TDIST_SYMMETRIC_HEAP_SIZE's format).");
  m.def("nccl_unique_id", &nccl_unique_id, "A new NCCL unique id (bytes), made on the rank that bootstraps.");
  m.def("nccl_version", [] {
    int v = 0;
    ncclGetVersion(&v);
    return v;
  }, "NCCL's version code (e.g. 22809) of the loaded libnccl.");
  m.def("device_array", &device_array, "ptr"_a, "shape"_a, "strides"_a, "dtype_code"_a, "bits"_a, "device_id"_a,
        "owner"_a.none(), nb::rv_policy::reference, "A DLPack-exporting view of CUDA memory at ptr that keeps owner alive.");
  m.def("driver_available", &tdist::jit::driver_available, "Whether a CUDA driver and GPU are usable.");

  nb::class_<Runtime>(m, "Runtime", "World, symmetric heap and collectives context of this process.")
      .def_static("from_env", &Runtime::from_env, "device"_a, "heap_bytes"_a, "max_bytes"_a, "timeout_s"_a)
      .def_static("from_unique_id", &Runtime::from_unique_id, "uid"_a, "rank"_a, "world_size"_a, "device"_a,
                  "heap_bytes"_a, "max_bytes"_a, "timeout_s"_a)
      .def("close", &Runtime::close)
      .def_prop_ro("closed", &Runtime::closed)
      .def_prop_ro("rank", &Runtime::rank)
      .def_prop_ro("world_size", &Runtime::world_size)
      .def_prop_ro("local_rank", &Runtime::local_rank)
      .def_prop_ro("local_world_size", &Runtime::local_world_size)
      .def_prop_ro("device", &Runtime::device)
      .def_prop_ro("heap_capacity", &Runtime::heap_capacity)
      .def_prop_ro("heap_bytes_in_use", &Runtime::heap_bytes_in_use)
      .def_prop_ro("max_bytes", &Runtime::max_bytes)
      .def("allocate", &Runtime::allocate, "bytes"_a)
      .def("free", &Runtime::free, "ptr"_a)
      .def("is_symmetric", &Runtime::is_symmetric, "ptr"_a)
      .def("peer_ptr", &Runtime::peer_ptr, "ptr"_a, "peer"_a)
      .def("all_reduce", &Runtime::all_reduce, "input"_a, "output"_a, "stream"_a, "method"_a)
      .def("all_gather", &Runtime::all_gather, "input"_a, "output"_a, "stream"_a, "method"_a)
      .def("reduce_scatter", &Runtime::reduce_scatter, "input"_a, "output"_a, "stream"_a, "method"_a)
      .def("ag_gemm", &Runtime::ag_gemm, "a_local"_a, "b"_a, "d"_a, "gathered"_a.none(), "m"_a, "n"_a, "k"_a,
           "stream"_a, "method"_a)
      .def("gemm_rs", &Runtime::gemm_rs, "a"_a, "b"_a, "d"_a, "m"_a, "n"_a, "k"_a, "stream"_a, "method"_a)
      .def("gemm_ar", &Runtime::gemm_ar, "a"_a, "b"_a, "d"_a, "m"_a, "n"_a, "k"_a, "stream"_a, "method"_a)
      .def("gemm_method", &Runtime::gemm_method, "op"_a, "a"_a, "b"_a, "d"_a, "gathered"_a.none(), "m"_a, "n"_a,
           "k"_a, "stream"_a, "method"_a)
      .def("gemm_contexts", &Runtime::gemm_contexts)
      .def("barrier", &Runtime::barrier, "stream"_a)
      .def("all_reduce_method", &Runtime::all_reduce_method, "input"_a, "output"_a, "method"_a)
      .def("host_barrier", &Runtime::host_barrier, "tag"_a);

  nb::class_<PyModule>(m, "JitModule", "A compiled CUDA module (cubin), loaded on the first launch.")
      .def_prop_ro("arch", [](const PyModule& p) { return p.compiled().arch; })
      .def_prop_ro("compiler", [](const PyModule& p) { return p.compiled().compiler; })
      .def_prop_ro("log", [](const PyModule& p) { return p.compiled().log; })
      .def_prop_ro("key", [](const PyModule& p) { return tdist::jit::to_hex(p.compiled().key); })
      .def_prop_ro("cubin", [](const PyModule& p) {
        return nb::bytes(p.compiled().cubin.data(), p.compiled().cubin.size());
      })
      .def_prop_ro("spill_stores", [](const PyModule& p) { return p.compiled().spill_stores; })
      .def_prop_ro("spill_loads", [](const PyModule& p) { return p.compiled().spill_loads; })
      .def_prop_ro("name_expressions",
                   [](const PyModule& p) {
                     std::vector<std::string> v;
                     for (const auto& [expr, sym] : p.compiled().lowered_names) v.push_back(expr);
                     return v;
                   })
      .def("lowered_name", [](const PyModule& p, const std::string& e) { return p.compiled().lowered_name(e); },
           "name_expression"_a);

  nb::class_<PyKernel>(m, "JitKernel", "One kernel of a JitModule.")
      .def(nb::init<std::shared_ptr<PyModule>, std::string>(), "module"_a, "name"_a)
      .def_prop_ro("name", &PyKernel::name)
      .def("launch", &PyKernel::launch, "grid"_a, "block"_a, "args"_a, "shared_bytes"_a, "stream"_a, "cluster"_a,
           "pdl"_a);

  m.def("jit_compile", &jit_compile, "source"_a, "name_expressions"_a, "arch"_a, "file_name"_a, "constants"_a,
        "defines"_a, "include_dirs"_a, "flags"_a, "compiler"_a);
  m.def("version", [] { return std::string(tdist::version()); }, "libtdist's version");
  m.def("version_report", &tdist::version_report, "device"_a = -1, "versions tdist runs with, one per line");
}
