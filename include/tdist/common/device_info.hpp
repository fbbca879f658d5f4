// Facts of a CUDA device that host code sizes launches and chooses kernels by. Each call asks the
// runtime (cheap: no synchronisation); errors throw tdist::Error with file and line.
#pragma once

namespace tdist {

// The calling thread's current device (cudaGetDevice).
int current_device();
// Multiprocessors of `device`: the persistent kernels' grid and the tile choices' wave size.
int sm_count(int device);
// Compute capability of `device` as 10 x major + minor.
int compute_capability(int device);

}  // namespace tdist
