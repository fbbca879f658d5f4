// tdist._C's expert-parallel all-to-all: tdist::EpBuffer on the Python runtime's World and heap, on
// raw device pointers (python/tdist/ep.py turns torch tensors into them, checks their shapes and
// wraps the buffer's outputs as tensors). Handles stay here (the buffer's last dispatches); Python
// names them by a sequence number and the slot's recv_count address.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "runtime_access.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/ep.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using tdist_python::ptr;
uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

tdist::EpMode parse_mode(const std::string& mode) {
  if (mode == "low_latency") return tdist::EpMode::kLowLatency;
  if (mode == "high_throughput") return tdist::EpMode::kHighThroughput;
  TDIST_CHECK_ARG(false, "mode", "'low_latency' or 'high_throughput', got '", mode, "'");
  return tdist::EpMode::kLowLatency;
}

// An EpBuffer and what its calls left for later ones: the handles of the last dispatches (per slot,
// with the sequence number of the dispatch that filled it) and the receive hooks not yet run. The
// buffer itself sits in a shared box that the runtime's close also holds, so that tdist.finalize
// destroys it (collectively) before the heap even when Python still holds this object.
class Ep {
 public:
  Ep(nb::handle runtime, int64_t max_tokens, int64_t hidden, int num_experts, int topk, int num_sms,
     const std::string& mode, int expert_alignment) {
    const tdist_python::RuntimeParts rt = tdist_python::runtime_parts(runtime, "ep.Buffer");
    tdist::EpConfig config;
    config.max_tokens = max_tokens;
    config.hidden = hidden;
    config.num_experts = num_experts;
    config.topk = topk;
    config.num_sms = num_sms;
    config.mode = parse_mode(mode);
    config.expert_alignment = expert_alignment;
    tdist::check_ep_config(config, rt.world->world_size());  // before the collective constructor
    device_ = rt.world->device();
    world_size_ = rt.world->world_size();
    box_ = std::make_shared<Box>();
    {
      nb::gil_scoped_release release;
      tdist_python::ScopedDevice scope(device_);
      box_->op = std::make_unique<tdist::EpBuffer>(*rt.world, *rt.heap, config);
    }
    tdist_python::reset_on_runtime_close(runtime, box_, device_);
  }

  // Collective: returns the buffer's memory to the heap.
  void close() { tdist_python::close_box(*box_, device_); }
  bool closed() const { return !box_->op; }

  int num_local_experts() { return op().num_local_experts(); }
  int64_t recv_rows_per_expert() { return op().recv_rows_per_expert(); }
  int world_size() const { return world_size_; }
  int device() const { return device_; }

  // (seq, recv_x, recv_scales, recv_count, recv_route, hook id (0: none)).
  std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t> ll_dispatch(uint64_t x, uint64_t topk_idx,
                                                                                     int64_t num_tokens, int64_t hidden,
                                                                                     int topk, bool fp8, bool ue8m0,
                                                                                     bool return_hook, uint64_t stream) {
    tdist::EpLlDispatchArgs a;
    a.x = ptr<const void>(x);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.num_tokens = num_tokens;
    a.hidden = hidden;
    a.topk = topk;
    a.fp8 = fp8;
    a.ue8m0 = ue8m0;
    a.return_hook = return_hook;
    op().check_dispatch(a);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    tdist::EpLlHandle h = op().ll_dispatch(a, reinterpret_cast<cudaStream_t>(stream));
    const uint64_t seq = ++ll_seq_;
    uint64_t hook = 0;
    if (h.hook) {
      hook = ++hook_ids_;
      box_->hooks[hook] = std::move(h.hook);
    }
    h.hook = nullptr;
    slots_.at(static_cast<size_t>(h.slot)) = {seq, h};
    return {seq, addr(h.recv_x), addr(h.recv_scales), addr(h.recv_count), addr(h.recv_route), hook};
  }

  // Returns the combine's hook id (0: none).
  uint64_t ll_combine(uint64_t y, uint64_t topk_idx, uint64_t topk_weights, uint64_t out, uint64_t seq,
                      uint64_t recv_count, bool return_hook, uint64_t stream) {
    const tdist::EpLlHandle& h = handle_of(seq, recv_count);
    tdist::EpLlCombineArgs a;
    a.y = ptr<const void>(y);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.topk_weights = ptr<const float>(topk_weights);
    a.out = ptr<void>(out);
    a.return_hook = return_hook;
    op().check_combine(a, h);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    std::function<void(cudaStream_t)> fn = op().ll_combine(a, h, reinterpret_cast<cudaStream_t>(stream));
    if (!fn) return 0;
    const uint64_t id = ++hook_ids_;
    box_->hooks[id] = std::move(fn);
    return id;
  }

  // Launches a receive hook on `stream`, once.
  void run_hook(uint64_t id, uint64_t stream) {
    auto it = box_->hooks.find(id);
    TDIST_CHECK_ARG(it != box_->hooks.end(), "hook",
                    "a receive hook of this buffer not run yet (each runs once, and tdist.finalize or close() "
                    "drops them), got hook ",
                    id);
    std::function<void(cudaStream_t)> fn = std::move(it->second);
    box_->hooks.erase(it);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    fn(reinterpret_cast<cudaStream_t>(stream));
  }

  // (call, recv_x, recv_src, recv_topk_idx, recv_topk_weights, recv_expert_row, expert_x, expert_src,
  //  info, max_recv_rows, max_expert_rows, num_recv, num_expert_rows, expert_counts, expert_offsets)
  using HtTuple = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                             int64_t, int64_t, int64_t, int64_t, std::vector<int>, std::vector<int>>;
  HtTuple ht_dispatch(uint64_t x, uint64_t topk_idx, uint64_t topk_weights, int64_t num_tokens, int64_t hidden,
                      int topk, bool sync_counts, uint64_t stream) {
    tdist::EpHtDispatchArgs a;
    a.x = ptr<const void>(x);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.topk_weights = ptr<const float>(topk_weights);
    a.num_tokens = num_tokens;
    a.hidden = hidden;
    a.topk = topk;
    a.sync_counts = sync_counts;
    op().check_ht_dispatch(a);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    ht_ = op().ht_dispatch(a, reinterpret_cast<cudaStream_t>(stream));
    const tdist::EpHtHandle& h = ht_;
    return {h.call,
            addr(h.recv_x),
            addr(h.recv_src),
            addr(h.recv_topk_idx),
            addr(h.recv_topk_weights),
            addr(h.recv_expert_row),
            addr(h.expert_x),
            addr(h.expert_src),
            addr(h.info),
            h.max_recv_rows,
            h.max_expert_rows,
            h.num_recv,
            h.num_expert_rows,
            h.expert_counts,
            h.expert_offsets};
  }

  // `y` (expert-major rows) or `y_compact` (compact rows); the other 0.
  void ht_combine(uint64_t y, uint64_t y_compact, uint64_t topk_idx, uint64_t out, uint64_t call, uint64_t stream) {
    tdist::EpHtHandle h = ht_;
    h.call = call;  // a handle of an earlier dispatch fails the buffer's check, which names it
    tdist::EpHtCombineArgs a;
    a.y = ptr<const void>(y);
    a.y_compact = ptr<const void>(y_compact);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.out = ptr<void>(out);
    op().check_ht_combine(a, h);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    op().ht_combine(a, h, reinterpret_cast<cudaStream_t>(stream));
  }

  // (code, token, slot, value) of the device error word, cleared; synchronises `stream`.
  std::tuple<int, int, int, int> device_error(uint64_t stream) {
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    const tdist::EpDeviceError e = op().device_error(reinterpret_cast<cudaStream_t>(stream));
    return {e.code, e.token, e.slot, e.value};
  }

  void check_errors(uint64_t stream) {
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    op().check_errors(reinterpret_cast<cudaStream_t>(stream));
  }

 private:
  struct Box {
    std::unique_ptr<tdist::EpBuffer> op;
    std::map<uint64_t, std::function<void(cudaStream_t)>> hooks;  // receive hooks not run yet, by id
    void reset() {
      hooks.clear();
      op.reset();
    }
  };

  tdist::EpBuffer& op() {
    if (!box_->op) throw tdist::Error("tdist.ep.Buffer: the buffer is closed (close() or tdist.finalize)");
    return *box_->op;
  }

  // The handle of dispatch `seq`, which filled the slot whose recv_count is at `recv_count`.
  const tdist::EpLlHandle& handle_of(uint64_t seq, uint64_t recv_count) {
    for (const auto& [s, h] : slots_)
      if (s == seq && s != 0 && addr(h.recv_count) == recv_count) return h;
    TDIST_CHECK_ARG(false, "handle",
                    "the handle of one of this buffer's last two low-latency dispatches (a dispatch's outputs are "
                    "overwritten two dispatches later), got the handle of dispatch ",
                    seq, " after dispatch ", ll_seq_);
    return slots_[0].second;
  }

  int device_ = 0;
  int world_size_ = 0;
  std::shared_ptr<Box> box_;
  uint64_t ll_seq_ = 0, hook_ids_ = 0;
  std::array<std::pair<uint64_t, tdist::EpLlHandle>, tdist::EpBuffer::kSlots> slots_{};
  tdist::EpHtHandle ht_;
};

}  // namespace

void bind_ep(nb::module_& m) {
  nb::class_<Ep>(m, "EpBuffer", "tdist::EpBuffer on the runtime's heap; use tdist.ep.Buffer.")
      .def(nb::init<nb::handle, int64_t, int64_t, int, int, int, const std::string&, int>(), "runtime"_a,
           "max_tokens"_a, "hidden"_a, "num_experts"_a, "topk"_a, "num_sms"_a, "mode"_a, "expert_alignment"_a)
      .def("close", &Ep::close)
      .def_prop_ro("closed", &Ep::closed)
      .def_prop_ro("num_local_experts", &Ep::num_local_experts)
      .def_prop_ro("recv_rows_per_expert", &Ep::recv_rows_per_expert)
      .def_prop_ro("world_size", &Ep::world_size)
      .def_prop_ro("device", &Ep::device)
      .def("ll_dispatch", &Ep::ll_dispatch, "x"_a, "topk_idx"_a, "num_tokens"_a, "hidden"_a, "topk"_a, "fp8"_a,
           "ue8m0"_a, "return_hook"_a, "stream"_a)
      .def("ll_combine", &Ep::ll_combine, "y"_a, "topk_idx"_a, "topk_weights"_a, "out"_a, "seq"_a, "recv_count"_a,
           "return_hook"_a, "stream"_a)
      .def("run_hook", &Ep::run_hook, "hook"_a, "stream"_a)
      .def("ht_dispatch", &Ep::ht_dispatch, "x"_a, "topk_idx"_a, "topk_weights"_a, "num_tokens"_a, "hidden"_a,
           "topk"_a, "sync_counts"_a, "stream"_a)
      .def("ht_combine", &Ep::ht_combine, "y"_a, "y_compact"_a, "topk_idx"_a, "out"_a, "call"_a, "stream"_a)
      .def("device_error", &Ep::device_error, "stream"_a)
      .def("check_errors", &Ep::check_errors, "stream"_a);
  m.def(
      "ep_check_config",
      [](int64_t max_tokens, int64_t hidden, int num_experts, int topk, int num_sms, const std::string& mode,
         int expert_alignment, int world_size) {
        tdist::EpConfig c{max_tokens, hidden, num_experts, topk, num_sms, parse_mode(mode), expert_alignment};
        tdist::check_ep_config(c, world_size);
        return tdist::ep_heap_bytes(c, world_size);
      },
      "max_tokens"_a, "hidden"_a, "num_experts"_a, "topk"_a, "num_sms"_a, "mode"_a, "expert_alignment"_a,
      "world_size"_a,
      "Checks an EP configuration for world_size ranks (tdist.Error naming the field) and returns the symmetric "
      "bytes per rank its buffer takes.");
  m.def(
      "ep_count_tokens",
      [](const std::vector<int64_t>& topk_idx, int64_t num_tokens, int topk, int num_experts, int world_size) {
        TDIST_CHECK_ARG(topk >= 1 && static_cast<int64_t>(topk_idx.size()) == num_tokens * topk, "topk_idx",
                        "num_tokens * topk = ", num_tokens * topk, " ids, got ", topk_idx.size());
        const tdist::EpTokenCounts c =
            tdist::ep_count_tokens(topk_idx.data(), num_tokens, topk, num_experts, world_size);
        return std::make_tuple(c.tokens_per_rank, c.rows_per_expert);
      },
      "topk_idx"_a, "num_tokens"_a, "topk"_a, "num_experts"_a, "world_size"_a,
      "The layout step's counts on the host: (tokens sent to each rank, rows sent to each expert).");
}
