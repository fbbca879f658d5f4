#include "tdist/runtime/device_fault.hpp"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/env.hpp"

namespace tdist {
namespace {

const char* site_name(device::u32 site) {
  switch (static_cast<device::WaitSite>(site)) {
    case device::WaitSite::kSignalWaitUntil: return "signal_wait_until";
    case device::WaitSite::kLlRead: return "a low-latency (LL) collective's read";
    case device::WaitSite::kLl128Read: return "an LL128 collective's read";
    case device::WaitSite::kGemmChunk: return "an overlapped GEMM's wait for a chunk of rows";
    case device::WaitSite::kEpCountFlag: return "an expert-parallel token count's wait";
    case device::WaitSite::kUser: return "a user kernel's wait";
    case device::WaitSite::kNcclOp: return "an NCCL operation";
  }
  return "a device wait";
}

std::atomic<device::FaultRecord*> g_record{nullptr};
std::mutex g_detail_mu;
std::string g_detail;  // what the host said about a fault it recorded itself

struct NamedRange {
  uint64_t end;
  std::string owner;
};
std::mutex g_names_mu;
std::map<uint64_t, NamedRange>& names() {               // by start address
  static auto* m = new std::map<uint64_t, NamedRange>;  // never destroyed: heaps may outlive statics
  return *m;
}

}  // namespace

device::FaultRecord* device_fault_record() {
  if (device::FaultRecord* r = g_record.load(std::memory_order_acquire)) return r;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (device::FaultRecord* r = g_record.load(std::memory_order_relaxed)) return r;
  void* host = nullptr;
  TDIST_CUDA_CHECK(cudaHostAlloc(&host, sizeof(device::FaultRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  void* dev = nullptr;
  TDIST_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
  TDIST_CHECK(dev == host, "the device address of the fault record differs from its host address (no unified addressing)");
  auto* r = static_cast<device::FaultRecord*>(host);
  *r = device::FaultRecord{};
  g_record.store(r, std::memory_order_release);
  return r;  // kept for the life of the process: kernels may hold its address
}

device::TimeoutAction wait_timeout_action_from_env() {
  return env::choice("TDIST_WAIT_TIMEOUT_ACTION", "abort", {"abort", "trap"}) == "trap" ? device::TimeoutAction::kTrap
                                                                                        : device::TimeoutAction::kAbort;
}

std::string describe_device_fault(const device::FaultRecord& f) {
  if (static_cast<device::WaitSite>(f.site) == device::WaitSite::kNcclOp) {
    std::string said;
    {
      std::lock_guard<std::mutex> lock(g_detail_mu);
      said = g_detail;
    }
    return detail::concat("on rank ", f.rank, ": ", said.empty() ? std::string("an NCCL operation timed out") : said,
                          ". The NCCL communicator was aborted and every device wait of this process gives up; end "
                          "the process. TDIST_NCCL_TIMEOUT_S sets the deadline.");
  }
  char address[32];
  std::snprintf(address, sizeof(address), "0x%llx", f.address);
  const auto owner = memory_owner(f.address);
  return detail::concat(
      "a device wait timed out after ", static_cast<double>(f.timeout_ns) * 1e-9, " s on rank ", f.rank, ": ",
      site_name(f.site), " in block (", f.block[0], ",", f.block[1], ",", f.block[2], "), thread (", f.thread[0], ",",
      f.thread[1], ",", f.thread[2], ") waited at address ", address, owner ? " (" + *owner + ")" : std::string(),
      " for a value ", device::cmp_name(static_cast<device::Cmp>(f.cmp)), " ", f.expected, " and saw ", f.seen,
      ". A peer never signalled (it died, hung, or called a different operation). Every wait of "
      "this process has been aborted and its kernels returned; the CUDA context is still usable "
      "(tensors can be copied out), but the world's flags are out of step: save what is needed and end the "
      "process. TDIST_WAIT_TIMEOUT_S sets the timeout.");
}

bool device_fault_recorded() {
  const device::FaultRecord* r = g_record.load(std::memory_order_acquire);
  if (r == nullptr) return false;
  if (reinterpret_cast<const volatile device::u32&>(r->state) != device::kFaultRecorded) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  return true;
}

std::optional<std::string> device_fault_message() {
  if (!device_fault_recorded()) return std::nullopt;
  return describe_device_fault(*g_record.load(std::memory_order_acquire));
}

void check_device_faults() {
  if (auto message = device_fault_message()) throw DeviceTimeoutError(*message);
}

void record_host_fault(device::WaitSite site, int rank, double timeout_seconds, const std::string& what) {
  device::FaultRecord* r = device_fault_record();
  auto* state = reinterpret_cast<device::u32*>(&r->state);
  device::u32 none = device::kFaultNone;
  if (!__atomic_compare_exchange_n(state, &none, device::kFaultClaimed, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    return;  // a device wait (or another host fault) came first
  {
    std::lock_guard<std::mutex> lock(g_detail_mu);
    g_detail = what;
  }
  r->site = static_cast<device::u32>(site);
  r->rank = rank;
  r->cmp = 0;
  r->address = r->expected = r->seen = 0;
  for (int i = 0; i < 3; ++i) r->block[i] = r->thread[i] = 0;
  r->timeout_ns = static_cast<device::u64>(timeout_seconds * 1e9);
  __atomic_store_n(state, device::kFaultRecorded, __ATOMIC_RELEASE);
}

void name_memory(const void* base, size_t bytes, const std::string& owner) {
  const auto start = reinterpret_cast<uint64_t>(base);
  std::lock_guard<std::mutex> lock(g_names_mu);
  auto& m = names();
  // Drop every range that overlaps [start, start + bytes): the one starting before it, if it reaches in,
  // and those starting inside it.
  auto it = m.lower_bound(start);
  if (it != m.begin() && std::prev(it)->second.end > start) it = std::prev(it);
  while (it != m.end() && it->first < start + bytes) it = m.erase(it);
  m[start] = NamedRange{start + bytes, owner};
}

void forget_memory_names(const void* base, size_t bytes) {
  const auto start = reinterpret_cast<uint64_t>(base);
  std::lock_guard<std::mutex> lock(g_names_mu);
  auto& m = names();
  m.erase(m.lower_bound(start), m.lower_bound(start + bytes));
}

std::optional<std::string> memory_owner(uint64_t address) {
  std::lock_guard<std::mutex> lock(g_names_mu);
  const auto& m = names();
  auto it = m.upper_bound(address);
  if (it == m.begin()) return std::nullopt;
  --it;
  if (address >= it->second.end) return std::nullopt;
  return it->second.owner;
}

void clear_device_fault() {
  if (device::FaultRecord* r = g_record.load(std::memory_order_acquire)) {
    *r = device::FaultRecord{};
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

}  // namespace tdist
