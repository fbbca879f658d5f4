// The host side of the device API's bounded waits (device/timeout.cuh): the timeout and the action
// from the environment, the process's fault record (runtime/device_fault.hpp) and, in
// nvcc-compiled translation units, the write of that unit's WaitConfig.
#pragma once

#include <cuda_runtime_api.h>

#include "tdist/common/env.hpp"
#include "tdist/device/timeout.cuh"
#include "tdist/runtime/device_fault.hpp"

namespace tdist {

// Seconds from TDIST_WAIT_TIMEOUT_S (a decimal number from 0.001 to 86400), else the default; a
// malformed or out-of-range value is an error naming the variable.
inline double wait_timeout_seconds_from_env() {
  return env::seconds("TDIST_WAIT_TIMEOUT_S", device::kDefaultWaitTimeoutSeconds, env::kMinTimeoutSeconds,
                      env::kMaxTimeoutSeconds);
}

// Needs a CUDA context (the fault record is allocated on first use).
inline device::WaitConfig make_wait_config(int rank, double timeout_seconds,
                                           device::TimeoutAction action = wait_timeout_action_from_env()) {
  return device::WaitConfig{static_cast<device::u64>(timeout_seconds * 1e9), rank, action, device_fault_record()};
}

#if defined(__CUDACC__)
// Sets the wait timeout, the action and the rank printed by this translation unit's kernels. Call it from the
// same .cu file as the kernels, after selecting the device. Returns the CUDA status.
static inline cudaError_t configure_waits(int rank, double timeout_seconds = wait_timeout_seconds_from_env(),
                                          device::TimeoutAction action = wait_timeout_action_from_env()) {
  const device::WaitConfig config = make_wait_config(rank, timeout_seconds, action);
  return cudaMemcpyToSymbol(tdist_device_config, &config, sizeof(config));
}
#endif

}  // namespace tdist
