// tdist._C's decode attention: the single-GPU op on raw device pointers (python/tdist/flash_decode.py
// turns torch tensors into them and checks their shapes), its device-side error report, and the
// split model for tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <mutex>

#include "runtime_access.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/ops/flash_decode.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// One op per device (its split workspace and error record), made on the first call there.
tdist::FlashDecode& decode_for_current_device() {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<tdist::FlashDecode>> ops;
  const int device = tdist::current_device();
  std::lock_guard<std::mutex> lock(mu);
  auto& op = ops[device];
  if (!op) op = std::make_unique<tdist::FlashDecode>();
  return *op;
}

// The op's arguments from the Python layer's pointers and sizes.
tdist::FlashDecodeArgs make_args(uint64_t q, uint64_t k_cache, uint64_t v_cache, uint64_t block_table,
                                 uint64_t seq_lens, uint64_t out, uint64_t lse, const std::string& dtype, int64_t batch,
                                 int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t num_pages,
                                 int64_t page_size, int64_t page_stride, int64_t max_pages, double softmax_scale,
                                 double softcap, int64_t max_seq_len) {
  tdist::FlashDecodeArgs a;
  a.dtype = tdist::parse_dtype(dtype, "q");
  a.batch = batch;
  a.q_heads = q_heads;
  a.kv_heads = kv_heads;
  a.head_dim = head_dim;
  a.q = reinterpret_cast<const void*>(q);
  a.k_cache = reinterpret_cast<const void*>(k_cache);
  a.v_cache = reinterpret_cast<const void*>(v_cache);
  a.num_pages = num_pages;
  a.page_size = page_size;
  a.page_stride = page_stride;
  a.block_table = reinterpret_cast<const int32_t*>(block_table);
  a.max_pages = max_pages;
  a.seq_lens = reinterpret_cast<const int32_t*>(seq_lens);
  a.out = reinterpret_cast<void*>(out);
  a.lse = reinterpret_cast<float*>(lse);
  a.softmax_scale = static_cast<float>(softmax_scale);
  a.softcap = static_cast<float>(softcap);
  a.max_seq_len = max_seq_len;
  return a;
}

void flash_decode(uint64_t q, uint64_t k_cache, uint64_t v_cache, uint64_t block_table, uint64_t seq_lens, uint64_t out,
                  uint64_t lse, const std::string& dtype, int64_t batch, int64_t q_heads, int64_t kv_heads,
                  int64_t head_dim, int64_t num_pages, int64_t page_size, int64_t page_stride, int64_t max_pages,
                  double softmax_scale, double softcap, int64_t max_seq_len, int device, uint64_t stream) {
  const tdist::FlashDecodeArgs a =
      make_args(q, k_cache, v_cache, block_table, seq_lens, out, lse, dtype, batch, q_heads, kv_heads, head_dim,
                num_pages, page_size, page_stride, max_pages, softmax_scale, softcap, max_seq_len);
  tdist::check_flash_decode_args(a);  // before touching the device: a bad call fails the same way anywhere
  nb::gil_scoped_release release;
  tdist_python::ScopedDevice scope(device);
  decode_for_current_device().run(a, reinterpret_cast<cudaStream_t>(stream));
}

// The sequence-parallel op over a symmetric buffer the Python runtime allocated (every rank's
// address of it in `bases`), on `device`.
class DistributedDecode {
 public:
  DistributedDecode(int rank, int world_size, const std::vector<uint64_t>& bases, uint64_t bytes, int64_t max_batch,
                    int64_t q_heads, int64_t head_dim, int device)
      : device_(device) {
    TDIST_CHECK_ARG(world_size >= 1 && world_size <= tdist::device::kMaxLsaRanks &&
                        static_cast<int>(bases.size()) == world_size && rank >= 0 && rank < world_size,
                    "bases", "expected one address per rank of a world of at most ", tdist::device::kMaxLsaRanks,
                    ", got ", bases.size(), " for rank ", rank, " of ", world_size);
    const tdist::DistributedFlashDecodeConfig config{.max_batch = max_batch, .q_heads = q_heads, .head_dim = head_dim};
    TDIST_CHECK_ARG(bytes >= tdist::DistributedFlashDecode::heap_bytes(config, world_size), "bytes",
                    "expected at least ", tdist::DistributedFlashDecode::heap_bytes(config, world_size), ", got ",
                    bytes);
    tdist::device::SymmetricHeapView view{};
    view.rank = rank;
    view.num_ranks = world_size;
    view.lsa_rank = rank;
    view.lsa_size = world_size;
    view.size = bytes;
    for (int r = 0; r < world_size; ++r) view.lsa_bases[r] = reinterpret_cast<char*>(bases[r]);
    tdist_python::ScopedDevice scope(device_);
    op_ = std::make_unique<tdist::DistributedFlashDecode>(view, view.lsa_bases[rank], config);
  }

  void run(uint64_t q, uint64_t k_cache, uint64_t v_cache, uint64_t block_table, uint64_t seq_lens, uint64_t out,
           uint64_t lse, const std::string& dtype, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
           int64_t num_pages, int64_t page_size, int64_t page_stride, int64_t max_pages, double softmax_scale,
           double softcap, int64_t max_seq_len, uint64_t stream) {
    const tdist::FlashDecodeArgs a =
        make_args(q, k_cache, v_cache, block_table, seq_lens, out, lse, dtype, batch, q_heads, kv_heads, head_dim,
                  num_pages, page_size, page_stride, max_pages, softmax_scale, softcap, max_seq_len);
    tdist::check_flash_decode_args(a);
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    op_->run(a, reinterpret_cast<cudaStream_t>(stream));
  }

  void check_errors() {
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    op_->check_errors();
  }

  void close() {
    nb::gil_scoped_release release;
    tdist_python::ScopedDevice scope(device_);
    op_.reset();  // waits for the device: peers' lines may still land in the buffer
  }

 private:
  int device_;
  std::unique_ptr<tdist::DistributedFlashDecode> op_;
};

}  // namespace

void bind_flash_decode(nb::module_& m) {
  m.def("flash_decode", &flash_decode, "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "seq_lens"_a, "out"_a, "lse"_a,
        "dtype"_a, "batch"_a, "q_heads"_a, "kv_heads"_a, "head_dim"_a, "num_pages"_a, "page_size"_a, "page_stride"_a,
        "max_pages"_a, "softmax_scale"_a, "softcap"_a, "max_seq_len"_a, "device"_a, "stream"_a,
        "Decode attention on raw device pointers (block_table 0: contiguous cache); use tdist.flash_decode.");
  m.def(
      "flash_decode_check_errors",
      [](int device) {
        nb::gil_scoped_release release;
        tdist_python::ScopedDevice scope(device);
        decode_for_current_device().check_errors();
      },
      "device"_a,
      "Synchronises `device` and raises tdist.Error naming block_table or seq_lens when a decode call since the "
      "last check met an entry outside the cache or a length beyond the capacity.");
  nb::class_<DistributedDecode>(m, "DistributedFlashDecode",
                                "Sequence-parallel decode attention over a symmetric buffer; use tdist.flash_decode.")
      .def(nb::init<int, int, const std::vector<uint64_t>&, uint64_t, int64_t, int64_t, int64_t, int>(), "rank"_a,
           "world_size"_a, "bases"_a, "bytes"_a, "max_batch"_a, "q_heads"_a, "head_dim"_a, "device"_a)
      .def("run", &DistributedDecode::run, "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "seq_lens"_a, "out"_a,
           "lse"_a, "dtype"_a, "batch"_a, "q_heads"_a, "kv_heads"_a, "head_dim"_a, "num_pages"_a, "page_size"_a,
           "page_stride"_a, "max_pages"_a, "softmax_scale"_a, "softcap"_a, "max_seq_len"_a, "stream"_a)
      .def("check_errors", &DistributedDecode::check_errors)
      .def("close", &DistributedDecode::close);
  m.def(
      "distributed_flash_decode_bytes",
      [](int64_t max_batch, int64_t q_heads, int64_t head_dim, int world_size) {
        return tdist::DistributedFlashDecode::heap_bytes({max_batch, q_heads, head_dim}, world_size);
      },
      "max_batch"_a, "q_heads"_a, "head_dim"_a, "world_size"_a,
      "Bytes of the symmetric buffer a DistributedFlashDecode of this size takes.");
  m.def(
      "flash_decode_plan",
      [](int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_seq_len, int num_sms,
         int ctas_per_sm) {
        const tdist::FlashDecodeSplitPlan p =
            tdist::plan_flash_decode(batch, q_heads, kv_heads, head_dim, max_seq_len, num_sms, ctas_per_sm);
        return std::make_tuple(p.heads_per_cta, p.head_chunks, p.num_splits);
      },
      "batch"_a, "q_heads"_a, "kv_heads"_a, "head_dim"_a, "max_seq_len"_a, "num_sms"_a,
      "ctas_per_sm"_a = tdist::FlashDecodeSplitModel::kCtasPerSm,
      "The split model: (query heads per CTA, head chunks, splits per sequence).");
}
