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

#include "tdist/common/error.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/ops/detail/collective_select.hpp"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/overlap_ops.hpp"
#include "tdist/runtime/device_fault.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/tcp_store.hpp"
#include "tdist/runtime/world.hpp"
#include "tdist/version.hpp"
#include "runtime_access.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

PyObject* g_error = nullptr;          // tdist.Error
PyObject* g_timeout_error = nullptr;         // tdist.TimeoutError
PyObject* g_device_timeout_error = nullptr;  // tdist.DeviceTimeoutError

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
      : ptr(std::get<0>(t)),
        numel(std::get<1>(t)),
        dtype(std::get<2>(t)),
        device_type(std::get<3>(t)),
        device_index(std::get<4>(t)),
        contiguous(std::get<5>(t)) {}
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
    fail(msg("tdist.", op, ": '", name, "' is on cuda:", d.device_index, " but tdist runs this rank on cuda:", device,
             " (the device given to tdist.init)"));
  if (d.numel > 0 && d.ptr == 0) fail(msg("tdist.", op, ": '", name, "' has a null data pointer"));
  return *dt;
}

void check_same_dtype(const char* op, const Desc& in, const Desc& out) {
  if (in.dtype != out.dtype)
    fail(msg("tdist.", op, ": 'output' has dtype ", out.dtype, " but 'input' has ", in.dtype, "; they must match"));
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
    fail(
        msg("tdist.all_reduce: 'output' has ", out.numel, " elements but 'input' has ", in.numel, "; they must match"));
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
// Overlapped ops (tdist/ops/overlap_ops.hpp): argument checks on descriptors, from the op's traits
// ---------------------------------------------------------------------------------------------

// One operand of an overlapped op: CUDA, bf16 / fp16, contiguous, on this rank's GPU, 16-byte
// aligned (the GEMM's TMA and the copy engine read whole 16-byte units).
tdist::DType check_overlap_tensor(const char* op, const char* name, const Desc& d, int device) {
  // The GEMMs' narrower dtype list where check_tensor would check the dtype, then its other checks.
  if (d.device_type == "cuda" && d.dtype != "bfloat16" && d.dtype != "float16")
    fail(msg("tdist.", op, ": '", name, "' has dtype ", d.dtype, "; the overlapped GEMMs take bfloat16 or float16"));
  const tdist::DType dtype = check_tensor(op, name, d, device);
  if (d.numel > 0 && d.ptr % 16 != 0)
    fail(msg("tdist.", op, ": '", name, "' must start at a 16-byte aligned address, got 0x", std::hex, d.ptr, std::dec,
             " (a view at an odd offset; call .clone() first)"));
  return dtype;
}

// The names of the operands whose rows (or columns) are `e`, quoted and joined with "and".
std::string operands_with(const tdist::OverlapOpTraits& op, tdist::Extent e, bool rows) {
  std::string s;
  for (const auto& t : op.operands)
    if (t.role == tdist::OperandRole::kInput && (rows ? t.rows : t.cols) == e)
      s += msg(s.empty() ? "" : " and ", "'", t.name, "'");
  return s;
}

// What an extent is in a message: "m=7", "this rank's rows of m=7 (3)", "N=24", "K=64".
std::string extent_formula(tdist::Extent e, const tdist::OverlapExtents& x) {
  switch (e) {
    case tdist::Extent::kRows: return msg("this rank's rows of m=", x.m, " (", x.rows, ")");
    case tdist::Extent::kM: return msg("m=", x.m);
    default: return msg(tdist::to_string(e), "=", x[e]);
  }
}

// Checks of one call of `op` (pure: no GPU): `descs` in the traits' operand order, an optional
// output may be absent. m: the whole M (all ranks' rows); n, k: this rank's GEMM.
tdist::DType check_overlap(const tdist::OverlapOpTraits& op, const std::vector<std::optional<Desc>>& descs, int64_t m,
                           int64_t n, int64_t k, int world_size, int rank, int device) {
  const char* o = op.name;
  const int count = op.num_operands();
  if (static_cast<int>(descs.size()) > count) {
    std::string names;
    for (const auto& t : op.operands) names += msg(names.empty() ? "" : ", ", t.name);
    fail(msg("tdist.", o, ": takes ", count, " operands (", names, "), got ", descs.size()));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail(msg("tdist.", o, ": rank ", rank, " is out of range for a world of ", world_size));
  if (m < 0 || m >= (int64_t{1} << 31)) fail(msg("tdist.", o, ": 'm' must be in [0, 2^31), got ", m));
  if (n <= 0 || n % op.n_multiple != 0 || n >= (int64_t{1} << 31))
    fail(msg("tdist.", o, ": N (rows of ", operands_with(op, tdist::Extent::kN, true),
             ") must be a positive multiple of ", op.n_multiple, " below 2^31, got ", n));
  if (k <= 0 || k % 8 != 0 || k >= (int64_t{1} << 31))
    fail(msg("tdist.", o, ": K (columns of ", operands_with(op, tdist::Extent::kK, false),
             ") must be a positive multiple of 8 below 2^31, got ", k));
  const tdist::OverlapExtents x = tdist::overlap_extents(m, n, k, world_size, rank);
  std::optional<tdist::DType> dtype;
  const char* first = nullptr;
  const Desc* first_desc = nullptr;
  for (int i = 0; i < count; ++i) {
    const tdist::OperandTraits& t = op.operands[i];
    const bool present = i < static_cast<int>(descs.size()) && descs[i].has_value();
    if (!present) {
      if (t.role == tdist::OperandRole::kOptionalOutput) continue;
      fail(msg("tdist.", o, ": '", t.name, "' is missing"));
    }
    const Desc& d = *descs[i];
    const tdist::DType dt = check_overlap_tensor(o, t.name, d, device);
    if (!first_desc) {
      first = t.name;
      first_desc = &d;
      dtype = dt;
    } else if (d.dtype != first_desc->dtype) {
      fail(msg("tdist.", o, ": '", t.name, "' has dtype ", d.dtype, " but '", first, "' has ", first_desc->dtype,
               "; they must match"));
    }
    const int64_t want = x[t.rows] * x[t.cols];
    if (d.numel != want)
      fail(msg("tdist.", o, ": '", t.name, "' has ", d.numel, " elements, expected ", extent_formula(t.rows, x), " x ",
               extent_formula(t.cols, x), " = ", want));
  }
  // Outputs share memory with nothing else.
  const size_t elem = tdist::dtype_size(*dtype);
  for (int i = 0; i < count; ++i) {
    if (op.operands[i].role == tdist::OperandRole::kInput || i >= static_cast<int>(descs.size()) || !descs[i]) continue;
    for (int j = 0; j < count; ++j) {
      if (j == i || j >= static_cast<int>(descs.size()) || !descs[j]) continue;
      if (op.operands[j].role != tdist::OperandRole::kInput && j > i) continue;  // each output pair once
      if (overlap(*descs[i], *descs[j], elem))
        fail(msg("tdist.", o, ": '", op.operands[i].name, "' overlaps '", op.operands[j].name,
                 "'; outputs must not share memory with the inputs or each other"));
    }
  }
  return *dtype;
}

// Descriptors from Python's tuples (None: an absent optional output; trailing ones dropped).
std::vector<std::optional<Desc>> descs_of(const std::vector<std::optional<DescTuple>>& tuples) {
  std::vector<std::optional<Desc>> v;
  for (const auto& t : tuples) v.push_back(t ? std::optional<Desc>(Desc(*t)) : std::nullopt);
  while (!v.empty() && !v.back()) v.pop_back();
  return v;
}

// The catalogue as Python reads it: one dict per op.
nb::list overlap_op_catalogue() {
  nb::list ops;
  for (const tdist::OverlapOpTraits* t : tdist::overlap_ops()) {
    nb::list operands;
    for (const auto& o : t->operands) {
      const char* role = o.role == tdist::OperandRole::kInput    ? "input"
                         : o.role == tdist::OperandRole::kOutput ? "output"
                                                                 : "optional_output";
      operands.append(nb::make_tuple(o.name, tdist::to_string(o.rows), tdist::to_string(o.cols), role));
    }
    nb::dict d;
    d["name"] = t->name;
    d["summary"] = t->summary;
    d["operands"] = operands;
    d["n_multiple"] = t->n_multiple;
    d["context_by_k"] = t->context_by_k;
    d["context_by_n"] = t->context_by_n;
    d["comm"] = tdist::to_string(t->comm);
    ops.append(d);
  }
  return ops;
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
  return {reinterpret_cast<uint64_t>(a.data()), numel,         dlpack_dtype_name(a.dtype()),
          dlpack_device_name(a.device_type()),  a.device_id(), contiguous};
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
      // Every rank is alive here: the id came from a collective of torch.distributed.
      const auto timeout = timeout_s > 0 ? std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))
                                         : tdist::TcpStoreOptions::default_timeout();
      rt->world_ = std::make_unique<tdist::World>(id, rank, world_size, device, timeout);
    }
    rt->finish_init(heap_bytes, max_bytes);
    return rt;
  }

  // Teardown is collective, so it happens in close() (tdist.finalize) only. A runtime never closed
  // (the interpreter exits without finalize, or after an error on some rank) is left to the process's
  // exit: waiting here for peers that may be gone could hang the exit.
  ~Runtime() {
    if (closed_) return;
    (void)close_hooks_.release();
    (void)cache_.release();
    (void)coll_.release();
    (void)heap_.release();
    (void)world_.release();
  }

  // Collective teardown: the contexts, the heap (every buffer), then the World (and its communicator).
  void close() {
    if (closed_) return;
    closed_ = true;
    nb::gil_scoped_release release;
    if (world_) cudaSetDevice(world_->device());
    cudaDeviceSynchronize();
    for (auto& fn : *close_hooks_) fn();  // other binding files' objects on the heap (EP, MoE)
    close_hooks_->clear();
    cache_.reset();  // the overlapped-op contexts free their symmetric buffers into the heap
    coll_.reset();
    buffers_.clear();
    heap_.reset();
    world_.reset();
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

  // Collective: a zeroed symmetric buffer; returns its address. `owner` names it in fault messages.
  uint64_t allocate(size_t bytes, const std::string& owner) {
    if (bytes == 0) bytes = 1;  // an empty tensor still gets a distinct address
    void* p;
    {
      nb::gil_scoped_release release;
      p = heap().allocate(bytes);
      heap().name_block(p, owner);
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

  // An overlapped op by its catalogue name; `descs` in the op's operand order (an optional output
  // may be None). Collective: every rank calls with the same m, n, k and method. The context for the
  // call is created on first use and re-created larger when a call exceeds it (OverlapContextCache:
  // collective, never while `stream` captures a CUDA graph). With `run` false, only resolves the
  // method (creating or growing the context like a call). Returns the method that ran.
  std::string overlap(const std::string& op_name, const std::vector<std::optional<DescTuple>>& tuples, int64_t m,
                      int64_t n, int64_t k, uint64_t stream_id, const std::string& method, bool run) {
    const tdist::OverlapOpTraits& op = tdist::find_overlap_op(op_name);
    const auto descs = descs_of(tuples);
    const auto dt = check_overlap(op, descs, m, n, k, world_size(), rank(), device());
    const auto requested = tdist::parse_overlap_method(method, "method");
    if (m == 0) return tdist::to_string(requested);  // nothing to compute; no context needed
    tdist::OverlapCall call;
    for (size_t i = 0; i < descs.size(); ++i) call.operands[i] = descs[i] ? descs[i]->data() : nullptr;
    call.m = m;
    call.n = n;
    call.k = k;
    const auto stream = reinterpret_cast<cudaStream_t>(stream_id);
    nb::gil_scoped_release release;
    tdist::OverlapContext& ctx = cache().get(op, dt, m, n, k, stream);
    const tdist::OverlapMethod chosen = ctx.method(call, requested);
    if (run) ctx.run(call, stream, chosen);
    return tdist::to_string(chosen);
  }

  // The live contexts: (op, dtype, k (ops sized by K; else 0), max_m, max_n (ops sized by N; else 0)).
  std::vector<std::tuple<std::string, std::string, int64_t, int64_t, int64_t>> overlap_contexts() const {
    std::vector<std::tuple<std::string, std::string, int64_t, int64_t, int64_t>> v;
    if (!cache_) return v;
    for (const auto& [op, c] : cache_->contexts())
      v.emplace_back(op->name, tdist::to_string(c.dtype), c.k, c.max_m, c.max_n);
    return v;
  }

  // For runtime_access.hpp.
  tdist_python::RuntimeParts parts() { return {&world_mut(), &heap()}; }
  void add_close_hook(std::function<void()> fn) { close_hooks_->push_back(std::move(fn)); }

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
    if (max_bytes == 0) max_bytes = std::max<size_t>(heap_->capacity() / 8, 1 << 20);
    if (2 * max_bytes >= heap_->capacity())
      fail(msg("tdist.init: max_bytes=", max_bytes,
               " needs a workspace of 2 * max_bytes, more than the "
               "symmetric heap's ",
               heap_->capacity(), " bytes; raise heap_size or lower max_bytes"));
    coll_ = std::make_unique<tdist::Collectives>(*world_, *heap_, max_bytes);
    cache_ = std::make_unique<tdist::OverlapContextCache>(*world_, *heap_);
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

  tdist::OverlapContextCache& cache() const {
    if (!cache_) fail("tdist: the runtime is closed (tdist.finalize was called)");
    return *cache_;
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

  std::unique_ptr<tdist::World> world_;
  std::unique_ptr<tdist::SymmetricHeap> heap_;
  std::unique_ptr<tdist::Collectives> coll_;
  std::map<uint64_t, size_t> buffers_;  // live tdist.empty buffers: address -> bytes
  // Overlapped-op contexts, created on first use and re-created larger when a call exceeds them.
  std::unique_ptr<tdist::OverlapContextCache> cache_;
  bool closed_ = false;
  std::unique_ptr<std::vector<std::function<void()>>> close_hooks_ =
      std::make_unique<std::vector<std::function<void()>>>();
};

nb::bytes nccl_unique_id() {
  const ncclUniqueId id = tdist::World::new_unique_id();
  return nb::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

// A DLPack-exporting view of device memory (no copy); `owner` stays alive as long as the view.
nb::ndarray<nb::array_api> device_array(uint64_t ptr, const std::vector<size_t>& shape,
                                        const std::vector<int64_t>& strides, int dtype_code, int bits, int device_id,
                                        nb::handle owner) {
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
  if (type == "ptr")
    a.add(static_cast<uint64_t>(as_uint()));
  else if (type == "i8")
    a.add(static_cast<int8_t>(ranged(as_int(), INT8_MIN, INT8_MAX)));
  else if (type == "i16")
    a.add(static_cast<int16_t>(ranged(as_int(), INT16_MIN, INT16_MAX)));
  else if (type == "i32")
    a.add(static_cast<int32_t>(ranged(as_int(), INT32_MIN, INT32_MAX)));
  else if (type == "i64")
    a.add(static_cast<int64_t>(as_int()));
  else if (type == "u8")
    a.add(static_cast<uint8_t>(uranged(as_uint(), UINT8_MAX)));
  else if (type == "u16")
    a.add(static_cast<uint16_t>(uranged(as_uint(), UINT16_MAX)));
  else if (type == "u32")
    a.add(static_cast<uint32_t>(uranged(as_uint(), UINT32_MAX)));
  else if (type == "u64")
    a.add(static_cast<uint64_t>(as_uint()));
  else if (type == "bool")
    a.add(static_cast<bool>(as_int() != 0));
  else if (type == "f32")
    a.add(static_cast<float>(as_float()));
  else if (type == "f64")
    a.add(as_float());
  else
    fail(msg("tdist.jit: argument ", index, " has unknown type '", type,
             "' (ptr, i8, i16, i32, i64, u8, u16, u32, u64, bool, f32, f64)"));
}

void PyKernel::launch(std::tuple<unsigned, unsigned, unsigned> grid, std::tuple<unsigned, unsigned, unsigned> block,
                      const std::vector<std::pair<std::string, nb::object>>& args, size_t shared_bytes, uint64_t stream,
                      std::tuple<unsigned, unsigned, unsigned> cluster, bool pdl) {
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

tdist_python::RuntimeParts tdist_python::runtime_parts(nb::handle runtime, const char* op) {
  Runtime* rt = nullptr;
  if (!nb::try_cast<Runtime*>(runtime, rt) || rt == nullptr)
    fail(msg("tdist.", op, ": expected tdist's runtime (tdist.init), got ", nb::inst_name(runtime).c_str()));
  if (rt->closed()) fail(msg("tdist.", op, ": the runtime is closed (tdist.finalize was called)"));
  return rt->parts();
}

void tdist_python::on_runtime_close(nb::handle runtime, std::function<void()> fn) {
  nb::cast<Runtime*>(runtime)->add_close_hook(std::move(fn));
}

void bind_flash_decode(nb::module_& m);  // bind_flash_decode.cpp
void bind_ep(nb::module_& m);            // bind_ep.cpp
void bind_moe(nb::module_& m);           // bind_moe.cpp

NB_MODULE(_C, m) {
  nb::set_leak_warnings(false);
  m.doc() = "tdist's C++ core (libtdist) for Python; use the tdist package rather than this module.";

  g_error = PyErr_NewExceptionWithDoc(
      "tdist.Error",
      "Raised by tdist on a failure: an invalid argument, a CUDA, NCCL or compile error. Its message is "
      "the C++ library's (tdist::Error).",
      PyExc_RuntimeError, nullptr);
  nb::object timeout_bases = nb::make_tuple(nb::handle(g_error), nb::handle(PyExc_TimeoutError));
  g_timeout_error =
      PyErr_NewExceptionWithDoc("tdist.TimeoutError",
                                "A wait (rendezvous, barrier, NCCL initialisation, a device wait) ran past its "
                                "deadline (tdist::TimeoutError). A subclass of tdist.Error and of the built-in "
                                "TimeoutError.",
                                timeout_bases.ptr(), nullptr);
  if (g_timeout_error)
    g_device_timeout_error = PyErr_NewExceptionWithDoc(
        "tdist.DeviceTimeoutError",
        "A device wait timed out (a peer never signalled) and every wait of the process was aborted "
        "(tdist::DeviceTimeoutError). The CUDA context is still usable: tensors can be copied out. The "
        "world's flags are out of step: save what is needed and end the process.",
        g_timeout_error, nullptr);
  if (!g_error || !g_timeout_error || !g_device_timeout_error) throw nb::python_error();
  m.attr("Error") = nb::handle(g_error);
  m.attr("TimeoutError") = nb::handle(g_timeout_error);
  m.attr("DeviceTimeoutError") = nb::handle(g_device_timeout_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const tdist::DeviceTimeoutError& e) {
      PyErr_SetString(g_device_timeout_error, e.what());
    } catch (const tdist::TimeoutError& e) {
      PyErr_SetString(g_timeout_error, e.what());
    } catch (const tdist::Error& e) {
      PyErr_SetString(g_error, e.what());
    }
  });

  m.def(
      "_raise_error", [](const std::string& what) { throw tdist::Error(what); },
      "Throws tdist::Error(what) from C++ (tests the exception translation).");
  m.def(
      "_raise_timeout", [](const std::string& what) { throw tdist::TimeoutError(what); },
      "Throws tdist::TimeoutError(what) from C++ (tests the exception translation).");

  m.def("check_device_faults", &tdist::check_device_faults,
        "Raises tdist.DeviceTimeoutError when a device wait of this process has timed out (and aborted).");
  m.def(
      "device_fault_message", [] { return tdist::device_fault_message(); },
      "The message of this process's aborted device wait, or None.");
  m.def(
      "_wait_fault_record",
      [] {
        // Where kernels that are not the JIT's (Triton's) record an aborted wait: 0 when waits trap.
        const bool trap = tdist::wait_timeout_action_from_env() == tdist::device::TimeoutAction::kTrap;
        return trap ? uintptr_t{0} : reinterpret_cast<uintptr_t>(tdist::device_fault_record());
      },
      "Address of this process's host-mapped FaultRecord under TDIST_WAIT_TIMEOUT_ACTION=abort, else 0.");
  m.def("clear_device_fault", &tdist::clear_device_fault,
        "Forgets an aborted device wait so that waits wait again (after the world has been rebuilt).");
  m.def(
      "_describe_device_fault",
      [](int rank, unsigned site, unsigned long long address, unsigned long long expected, unsigned long long seen) {
        tdist::device::FaultRecord r{};
        r.state = tdist::device::kFaultRecorded;
        r.site = site, r.rank = rank, r.cmp = static_cast<unsigned>(tdist::device::Cmp::kGe);
        r.address = address, r.expected = expected, r.seen = seen, r.timeout_ns = 2000000000ull;
        return tdist::describe_device_fault(r);
      },
      "rank"_a, "site"_a, "address"_a, "expected"_a, "seen"_a, "The message of a made-up record (tests).");

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
      "all_reduce"_a = std::string("auto"), "all_gather"_a = std::string("auto"),
      "reduce_scatter"_a = std::string("auto"), "Throws tdist.Error for a method name no op knows.");
  m.def("overlap_ops", &overlap_op_catalogue,
        "The catalogue of overlapped ops: one dict per op (name, summary, operands as (name, rows, cols, role), "
        "n_multiple, context_by_k, context_by_n, comm).");
  m.def(
      "check_overlap",
      [](const std::string& op, const std::vector<std::optional<DescTuple>>& descs, int64_t m, int64_t n, int64_t k,
         int world_size, int rank, int device) {
        return std::string(tdist::to_string(
            check_overlap(tdist::find_overlap_op(op), descs_of(descs), m, n, k, world_size, rank, device)));
      },
      "op"_a, "descs"_a, "m"_a, "n"_a, "k"_a, "world_size"_a, "rank"_a = 0, "device"_a = -1,
      "Argument checks of an overlapped op on descriptors in its operand order (m: all ranks' rows; n, k: this "
      "rank's GEMM); returns the dtype name.");
  m.def(
      "parse_overlap_method",
      [](const std::string& method) {
        return std::string(tdist::to_string(tdist::parse_overlap_method(method, "method")));
      },
      "method"_a,
      "The overlapped ops' method name (auto, fused, chunked, sequential, baseline); tdist.Error otherwise.");
  m.def(
      "overlap_context_bytes",
      [](const std::string& op, const std::string& dtype, int64_t max_m, int64_t max_n, int64_t k, int world_size,
         int num_sms) {
        const auto dt = collective_dtype(dtype);
        if (!dt) fail(msg("overlap_context_bytes: unknown dtype '", dtype, "'"));
        if (num_sms < 1) fail(msg("overlap_context_bytes: num_sms must be positive, got ", num_sms));
        if (world_size < 1) fail(msg("overlap_context_bytes: world_size must be positive, got ", world_size));
        const tdist::OverlapOpTraits& t = tdist::find_overlap_op(op);
        return t.heap_bytes(tdist::overlap_context_for(t, *dt, max_m, max_n, k), world_size, num_sms);
      },
      "op"_a, "dtype"_a, "max_m"_a, "max_n"_a, "k"_a, "world_size"_a, "num_sms"_a = 132,
      "Symmetric-heap bytes of one overlapped-op context (max_n for ops sized by N, k for ops sized by K) on GPUs "
      "with num_sms SMs (132: H100 / H200 SXM).");
  m.def(
      "parse_size", [](const std::string& s) { return tdist::SymmetricHeap::parse_size(s, "heap_size"); },
      "Bytes from '512M', '2G', '1048576' (TDIST_SYMMETRIC_HEAP_SIZE's format).");
  m.def("nccl_unique_id", &nccl_unique_id, "A new NCCL unique id (bytes), made on the rank that bootstraps.");
  m.def(
      "nccl_version",
      [] {
        int v = 0;
        ncclGetVersion(&v);
        return v;
      },
      "NCCL's version code (e.g. 22809) of the loaded libnccl.");
  m.def("device_array", &device_array, "ptr"_a, "shape"_a, "strides"_a, "dtype_code"_a, "bits"_a, "device_id"_a,
        "owner"_a.none(), nb::rv_policy::reference,
        "A DLPack-exporting view of CUDA memory at ptr that keeps owner alive.");
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
      .def("allocate", &Runtime::allocate, "bytes"_a, "owner"_a = "a symmetric tensor (tdist.empty)")
      .def("free", &Runtime::free, "ptr"_a)
      .def("is_symmetric", &Runtime::is_symmetric, "ptr"_a)
      .def("peer_ptr", &Runtime::peer_ptr, "ptr"_a, "peer"_a)
      .def("all_reduce", &Runtime::all_reduce, "input"_a, "output"_a, "stream"_a, "method"_a)
      .def("all_gather", &Runtime::all_gather, "input"_a, "output"_a, "stream"_a, "method"_a)
      .def("reduce_scatter", &Runtime::reduce_scatter, "input"_a, "output"_a, "stream"_a, "method"_a)
      .def("overlap", &Runtime::overlap, "op"_a, "descs"_a, "m"_a, "n"_a, "k"_a, "stream"_a, "method"_a, "run"_a = true)
      .def("overlap_contexts", &Runtime::overlap_contexts)
      .def("barrier", &Runtime::barrier, "stream"_a)
      .def("all_reduce_method", &Runtime::all_reduce_method, "input"_a, "output"_a, "method"_a)
      .def("host_barrier", &Runtime::host_barrier, "tag"_a);

  nb::class_<PyModule>(m, "JitModule", "A compiled CUDA module (cubin), loaded on the first launch.")
      .def_prop_ro("arch", [](const PyModule& p) { return p.compiled().arch; })
      .def_prop_ro("compiler", [](const PyModule& p) { return p.compiled().compiler; })
      .def_prop_ro("log", [](const PyModule& p) { return p.compiled().log; })
      .def_prop_ro("key", [](const PyModule& p) { return tdist::jit::to_hex(p.compiled().key); })
      .def_prop_ro("cubin",
                   [](const PyModule& p) { return nb::bytes(p.compiled().cubin.data(), p.compiled().cubin.size()); })
      .def_prop_ro("spill_stores", [](const PyModule& p) { return p.compiled().spill_stores; })
      .def_prop_ro("spill_loads", [](const PyModule& p) { return p.compiled().spill_loads; })
      .def_prop_ro("name_expressions",
                   [](const PyModule& p) {
                     std::vector<std::string> v;
                     for (const auto& [expr, sym] : p.compiled().lowered_names) v.push_back(expr);
                     return v;
                   })
      .def(
          "lowered_name", [](const PyModule& p, const std::string& e) { return p.compiled().lowered_name(e); },
          "name_expression"_a);

  nb::class_<PyKernel>(m, "JitKernel", "One kernel of a JitModule.")
      .def(nb::init<std::shared_ptr<PyModule>, std::string>(), "module"_a, "name"_a)
      .def_prop_ro("name", &PyKernel::name)
      .def("launch", &PyKernel::launch, "grid"_a, "block"_a, "args"_a, "shared_bytes"_a, "stream"_a, "cluster"_a,
           "pdl"_a);

  m.def("jit_compile", &jit_compile, "source"_a, "name_expressions"_a, "arch"_a, "file_name"_a, "constants"_a,
        "defines"_a, "include_dirs"_a, "flags"_a, "compiler"_a);
  m.def(
      "version", [] { return std::string(tdist::version()); }, "libtdist's version");
  m.def("version_report", &tdist::version_report, "device"_a = -1, "versions tdist runs with, one per line");
  bind_flash_decode(m);
  bind_ep(m);
  bind_moe(m);
}
