// Intra-kernel profiler, host side: the process's record buffer, reading it back, and the Chrome /
// Perfetto trace writer. The device side and the buffer layout are in device/profile.cuh; the guide
// is docs/profiling.md.
//
//   tdist::KernelProfiler::enable();           // before the ops are built: their kernels compile with it
//   tdist::AllGatherGemm op(world, heap, cfg);
//   op.run(args, stream);                      // a warm-up call
//   tdist::KernelProfiler::reset();
//   op.run(args, stream);
//   auto snap = tdist::KernelProfiler::read(world.rank());
//   tdist::write_chrome_trace("trace.json", {snap});
//
// One buffer per process, on the device current at enable(). While enabled, every kernel the JIT
// compiles gets -DTDIST_KERNEL_PROFILE=1 (a key of its own in the cache: an unprofiled cubin is never
// taken for a profiled one), and every JIT module that has the recorder gets the buffer's address
// before its next launch. Kernels compiled before enable() record nothing. enable(), disable(),
// reset() and read() synchronise the device; none of them may run during CUDA graph capture.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tdist/common/json.hpp"
#include "tdist/device/profile.cuh"

namespace tdist {

struct KernelProfilerOptions {
  int max_blocks = 0;         // blocks with a slot, per kernel; 0: twice the device's SM count
  int num_tracks = 2;         // tracks per block (the GEMM uses 2: producer and math)
  int records_per_track = 0;  // 0: TDIST_KERNEL_PROFILE_RECORDS (16 .. 1048576), else 4096
};

// Records per track from TDIST_KERNEL_PROFILE_RECORDS, else 4096; a malformed or out-of-range
// value is an error naming the variable.
int kernel_profile_records_from_env();

// The events of one (kernel, block, track) slot, in record order.
struct ProfileTrack {
  device::ProfileKernel kernel{};
  uint32_t block = 0;
  uint32_t track = 0;
  uint32_t claimed = 0;  // records the kernel tried to write; records.size() < claimed: dropped
  std::vector<device::ProfileRecord> records;
};

// What one rank recorded: the tracks that hold any record.
struct ProfileSnapshot {
  int rank = 0;
  uint32_t max_blocks = 0, num_tracks = 0, capacity = 0;
  uint64_t lost_records = 0;  // recorded by blocks without a slot (>= max_blocks)
  std::vector<ProfileTrack> tracks;

  // Records past a track's capacity, summed.
  uint64_t dropped_records() const;

  // Parses a whole buffer as the device wrote it (device/profile.cuh); throws tdist::Error naming
  // what is malformed (magic, version, sizes).
  static ProfileSnapshot from_buffer(const void* bytes, size_t size, int rank);
  // A compact byte form for moving snapshots between ranks (World::all_gather), and back.
  std::string serialize() const;
  static ProfileSnapshot deserialize(const std::string& bytes);
};

class KernelProfiler {
 public:
  // Allocates the buffer on the current device (zeroed) and turns recording on; an error when it
  // is already enabled or an option is out of range (naming it).
  static void enable(const KernelProfilerOptions& options = {});
  // Frees the buffer; modules stop recording at their next launch. No-op when not enabled.
  static void disable();
  static bool enabled();
  // Zeroes the counters (the records stay but count for nothing); synchronises the device first.
  static void reset();
  // Synchronises the device and copies the buffer back; an error when not enabled.
  static ProfileSnapshot read(int rank);

  // For loaders (the JIT): the configuration modules get (null buffer when off), and a number that
  // changes whenever it does.
  static device::ProfileConfig config();
  static uint64_t generation();
  // Whether JIT programs get -DTDIST_KERNEL_PROFILE=1: while enabled, or always in a library built
  // with the CMake option TDIST_KERNEL_PROFILE.
  static bool jit_define();
};

// The blocks of one kernel in a snapshot, grouped by launch, for kernels whose recording thread opens
// a `user` span at entry and closes it at exit (decode attention's): launches[k][i] is the records of
// one block of launch k, from its outermost user begin to that span's end. A slot's records may
// interleave blocks of consecutive launches (one resident early, under programmatic dependent launch,
// beside the one still running), which run on different SMs: a block is the run of records on one
// SM, and the k-th block of a slot by start time belongs to launch k. Records outside a user span
// are left out.
std::vector<std::vector<std::vector<device::ProfileRecord>>> blocks_by_launch(const ProfileSnapshot& s,
                                                                              device::ProfileKernel kernel);

// Name of a kernel's tracks in traces: "ag_gemm", "ag_push", "user0", "user1", "decode_split",
// "decode_combine".
const char* profile_kernel_name(device::ProfileKernel kernel);
// "tile", "wait", "copy", "user" for a begin or end kind; "mark" for kMark.
const char* profile_event_name(device::ProfileEvent event);

// Counts of what the trace writer had to repair, reported in the trace's otherData too.
struct TraceStats {
  uint64_t events = 0;     // B, E and i events written
  uint64_t dropped = 0;    // records past a track's capacity
  uint64_t lost = 0;       // records of blocks without a slot
  uint64_t unmatched = 0;  // end records without their begin (skipped)
  uint64_t truncated = 0;  // begins without their end, closed at the track's last record
};

// Chrome trace JSON ({"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}): pid = rank,
// one tid per (kernel, block, track) with its name in metadata, B/E pairs per begin/end record and an
// instant event per kMark, ts in microseconds from the first record over all snapshots. Pairs are
// balanced by construction (see TraceStats).
json::Value chrome_trace(const std::vector<ProfileSnapshot>& ranks, TraceStats* stats = nullptr);
// Writes chrome_trace(ranks) to `path` (through a renamed temporary file).
TraceStats write_chrome_trace(const std::string& path, const std::vector<ProfileSnapshot>& ranks);

#if defined(__CUDACC__)
// Points this translation unit's nvcc-compiled kernels at the profiler's buffer (or at none when it
// is off). Call it from the same .cu file as the kernels after enable() or disable(). Without
// TDIST_KERNEL_PROFILE the unit has no recorder and this does nothing.
static inline cudaError_t configure_kernel_profile() {
#if defined(TDIST_KERNEL_PROFILE)
  const device::ProfileConfig config = KernelProfiler::config();
  return cudaMemcpyToSymbol(tdist_profile_config, &config, sizeof(config));
#else
  return cudaSuccess;
#endif
}
#endif

}  // namespace tdist
