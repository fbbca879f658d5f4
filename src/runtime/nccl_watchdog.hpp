// Deadlines for NCCL operations on user streams (World::watch_nccl). NCCL's kernels wait for their
// peers without a timeout: a peer that died or called another op leaves them spinning, the stream
// never drains and the process hangs. After each NCCL call an op records an event on its stream; a
// thread polls the events in order and, when one is still pending past its deadline, calls
// `on_timeout` once (World aborts its communicator, which makes the NCCL kernels return, and records
// a device fault so that the host raises DeviceTimeoutError). Events are polled, never waited on.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace tdist::detail {

class NcclWatchdog {
 public:
  using OnTimeout = std::function<void(const std::string& what, double seconds)>;
  NcclWatchdog(int device, double timeout_seconds, OnTimeout on_timeout);
  ~NcclWatchdog();
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  // The NCCL work enqueued on `stream` so far must finish within the timeout. `what` names it in
  // the error. Outside graph captures only (the caller checks).
  void watch(cudaStream_t stream, const std::string& what);

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    cudaEvent_t done;
    Clock::time_point deadline;
    std::string what;
  };
  void loop();

  int device_;
  double timeout_s_;
  OnTimeout on_timeout_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Entry> pending_;
  bool stop_ = false;
  bool fired_ = false;  // once the communicator is aborted, nothing more is watched
  std::thread thread_;
};

}  // namespace tdist::detail
