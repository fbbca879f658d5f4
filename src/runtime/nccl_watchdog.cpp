#include "src/runtime/nccl_watchdog.hpp"

#include "tdist/common/cuda_check.hpp"

namespace tdist::detail {

NcclWatchdog::NcclWatchdog(int device, double timeout_seconds, OnTimeout on_timeout)
    : device_(device), timeout_s_(timeout_seconds), on_timeout_(std::move(on_timeout)) {
  thread_ = std::thread([this] { loop(); });
}

NcclWatchdog::~NcclWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  for (Entry& e : pending_) cudaEventDestroy(e.done);
}

void NcclWatchdog::watch(cudaStream_t stream, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fired_) return;
  cudaEvent_t done = nullptr;
  TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(done, stream);
  if (recorded != cudaSuccess) {
    cudaEventDestroy(done);
    TDIST_CUDA_CHECK(recorded);
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  pending_.push_back({done, deadline, what});
  wake_.notify_all();
}

void NcclWatchdog::loop() {
  cudaSetDevice(device_);  // event queries in this thread's context of the device
  // Relaxed: this thread's event queries must not invalidate a CUDA-graph capture that another
  // thread runs in the global mode (torch.cuda.graph's default) meanwhile.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (pending_.empty()) {
      wake_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      continue;
    }
    // Oldest first: a stream's events complete in order, and most calls finish long before the
    // deadline, so the head decides.
    while (!pending_.empty()) {
      Entry& head = pending_.front();
      const cudaError_t state = cudaEventQuery(head.done);
      if (state == cudaErrorNotReady) {
        if (Clock::now() < head.deadline) break;
        const std::string what = head.what;
        for (Entry& e : pending_) cudaEventDestroy(e.done);
        pending_.clear();
        fired_ = true;
        lock.unlock();
        on_timeout_(what, timeout_s_);
        lock.lock();
        break;
      }
      cudaEventDestroy(head.done);  // done (or the context failed: nothing left to wait for)
      pending_.pop_front();
    }
    wake_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stop_; });
  }
}

}  // namespace tdist::detail
