// tdist's device API: symmetric addressing, signals, one-sided copies and barriers between ranks.
// Header-only CUDA C++; compiles under nvcc and NVRTC. See each header for its ordering contract.
#pragma once

#include "tdist/device/barrier.cuh"
#include "tdist/device/common.cuh"
#include "tdist/device/copy.cuh"
#include "tdist/device/grid_dependency.cuh"
#include "tdist/device/groups.cuh"
#include "tdist/device/memory_order.cuh"
#include "tdist/device/signal.cuh"
#include "tdist/device/symmetric.cuh"
#include "tdist/device/timeout.cuh"
