// NVTX ranges around tdist's ops, for profiling from C++ with Nsight Systems (`nsys profile ...`):
// every public op entry opens one range in the NVTX domain "tdist", named after the op, its shape
// and its method, closed when the entry returns.
//
//   TDIST_NVTX_RANGE("tdist::all_reduce", "count=", count, " ", to_string(dtype), " ", to_string(method));
//
// One line, at the top of the op's entry (after its method is resolved when the method is worth
// naming). The first argument is the range's name (a string literal); the rest, any values
// std::ostream prints, are appended to the message. `tdist::NvtxRange range("tdist::x", ...)` is the
// same without the macro.
//
// Cost: header-only on NVTX v3 (<nvtx3/nvToolsExt.h> of the CUDA toolkit; no library to link: it
// dlopens the profiler's injection library when NVTX_INJECTION64_PATH names one). Without a
// profiler the domain handle is null, and a range costs one load and one branch: the message is
// not built and no NVTX call is made. With TDIST_NVTX=0 (CMake option TDIST_NVTX=OFF) the macro
// expands to nothing, its arguments are not evaluated, and NVTX's header is not included.
#pragma once

#ifndef TDIST_NVTX
#if __has_include(<nvtx3/nvToolsExt.h>)
#define TDIST_NVTX 1
#else
#define TDIST_NVTX 0
#endif
#endif

#if TDIST_NVTX
#include <nvtx3/nvToolsExt.h>

#include <string>

#include "tdist/common/error.hpp"  // detail::concat
#endif

namespace tdist {

#if TDIST_NVTX

namespace detail {

// The domain "tdist", created once (the first call also initialises NVTX: it looks for the
// profiler's injection library). Null when no profiler is attached.
inline nvtxDomainHandle_t nvtx_domain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("tdist");
  return domain;
}

}  // namespace detail

// Whether a profiler records tdist's ranges in this process.
inline bool nvtx_recording() { return detail::nvtx_domain() != nullptr; }

class NvtxRange {
 public:
  // `name` then `parts...` concatenated into the range's message (NVTX copies it).
  template <typename... Parts>
  explicit NvtxRange(const char* name, const Parts&... parts) {
    domain_ = detail::nvtx_domain();
    if (domain_ == nullptr) return;
    if constexpr (sizeof...(Parts) == 0) {
      push(name);
    } else {
      push(detail::concat(name, " ", parts...).c_str());
    }
  }
  ~NvtxRange() {
    if (pushed_) nvtxDomainRangePop(domain_);
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

  // Whether this range was handed to a profiler.
  bool recorded() const { return pushed_; }

 private:
  void push(const char* message) {
    nvtxEventAttributes_t attr{};
    attr.version = NVTX_VERSION;
    attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attr.message.ascii = message;
    // Popped whatever level comes back: a tool that does not track levels returns a negative one
    // and still expects the pop.
    nvtxDomainRangePushEx(domain_, &attr);
    pushed_ = true;
  }

  nvtxDomainHandle_t domain_ = nullptr;
  bool pushed_ = false;
};

#else  // TDIST_NVTX

inline bool nvtx_recording() { return false; }

// Compiled out: the same interface, doing nothing.
class NvtxRange {
 public:
  template <typename... Parts>
  explicit NvtxRange(const char*, const Parts&...) {}
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
  bool recorded() const { return false; }
};

#endif  // TDIST_NVTX

}  // namespace tdist

#define TDIST_NVTX_CAT_(a, b) a##b
#define TDIST_NVTX_CAT(a, b) TDIST_NVTX_CAT_(a, b)
#if TDIST_NVTX
#define TDIST_NVTX_RANGE(...) const ::tdist::NvtxRange TDIST_NVTX_CAT(tdist_nvtx_range_, __LINE__)(__VA_ARGS__)
#else
#define TDIST_NVTX_RANGE(...) static_assert(true, "TDIST_NVTX_RANGE compiled out")
#endif
