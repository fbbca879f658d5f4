// Intra-kernel profiler, device side: kernels record timestamped events per block into a buffer the
// host reads back and writes as a Chrome / Perfetto trace (runtime/kernel_profiler.hpp,
// docs/profiling.md).
//
// Compiled out by default. Without TDIST_KERNEL_PROFILE every record call is an empty inline
// function and no code or symbol remains. With it (CMake option TDIST_KERNEL_PROFILE for nvcc code;
// the JIT adds it to every program while a KernelProfiler is enabled, and the define enters the
// cache key), a record costs one predictable branch while no buffer is set, and with a buffer an
// atomic add, a 16-byte store and a 4-byte store.
//
// Which buffer: `tdist_profile_config`, one copy per compiled module, like the wait configuration
// (timeout.cuh): the JIT writes it after loading a module and again before a launch when the
// profiler was enabled, reset or disabled since; nvcc-compiled code sets its own translation unit's
// copy with tdist::configure_kernel_profile() (runtime/kernel_profiler.hpp).
//
// Buffer layout (one per process, device memory; sizes in ProfileConfig):
//   ProfileHeader                      64 bytes
//   slots[num_kernels][max_blocks][num_tracks], each
//     ProfileSlotHeader                16 bytes: `count` records claimed so far (may exceed capacity)
//     ProfileRecord records[capacity]  16 bytes each, in claim order
// A slot is the track of one (kernel, block, track) triple: every launch of that kernel appends to
// it, so the slot shows the block's history over the profiled calls. A track is written by one
// thread at a time (the kernel's recording lane for that track); the count is claimed with an atomic
// add all the same, so that two launches overlapping under programmatic dependent launch stay
// correct. Records past the capacity are counted, never written; blocks at or past max_blocks count
// into ProfileHeader::lost_records.
//
// Events nest per track: every kBegin kind is closed by its end kind before an enclosing one is
// (tile begin, wait begin, wait end, tile end), which lets the trace writer pair them.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

// What a record marks. Begin kinds are even and their end is the next value; kMark is an instant.
// Shared by host and device: the trace writer names them (runtime/kernel_profiler.hpp).
enum class ProfileEvent : unsigned short {
  kTileBegin = 0,  // payload: tile index
  kTileEnd = 1,
  kWaitBegin = 2,  // payload: what is waited for (chunk, phase, peer)
  kWaitEnd = 3,
  kCopyIssue = 4,  // payload: peer (and chunk, kernel-defined)
  kCopyLand = 5,
  kUserBegin = 6,  // payload: user-defined
  kUserEnd = 7,
  kMark = 8,  // instant; payload user-defined
};
constexpr unsigned kNumProfileEvents = 9;

// Which kernel a track belongs to: the first index of the slot array. The host names them.
enum class ProfileKernel : unsigned {
  kAllGatherGemm = 0,  // fused AllGather-GEMM (gemm/sm90_gemm.cuh with AllGatherWaitHooks)
  kAllGatherPush = 1,  // collectives/all_gather.cuh, tdist_ag_push
  kUser0 = 2,          // free for the user's own kernels
  kUser1 = 3,
  kFlashDecodeSplit = 4,    // attention/flash_decode.cuh, flash_decode_split
  kFlashDecodeCombine = 5,  // attention/flash_decode.cuh, flash_decode_combine
};
constexpr unsigned kNumProfileKernels = 6;

// One event, 16 bytes.
struct alignas(16) ProfileRecord {
  u64 time_ns;           // %globaltimer
  unsigned short event;  // ProfileEvent
  unsigned short sm;     // %smid
  u32 payload;
};

struct alignas(16) ProfileSlotHeader {
  u32 count;  // records claimed; those at index >= capacity were dropped
  u32 reserved[3];
};

constexpr u32 kProfileMagic = 0x46504454u;  // "TDPF"
constexpr u32 kProfileVersion = 1;

struct alignas(64) ProfileHeader {
  u32 magic;         // kProfileMagic
  u32 version;       // kProfileVersion
  u32 num_kernels;   // kNumProfileKernels when written
  u32 max_blocks;    // blocks with a slot, per kernel
  u32 num_tracks;    // tracks per block
  u32 capacity;      // records per slot
  u32 lost_records;  // records of blocks >= max_blocks (no slot)
  u32 reserved[9];
};

// What a module reads before recording; null buffer: profiling off.
struct ProfileConfig {
  ProfileHeader* buffer;
  u32 max_blocks;
  u32 num_tracks;
  u32 capacity;
  u32 reserved;
};

// Bytes of one slot, and of a whole buffer of the given geometry.
TDIST_HOST_DEVICE u64 profile_slot_bytes(u32 capacity) {
  return sizeof(ProfileSlotHeader) + static_cast<u64>(capacity) * sizeof(ProfileRecord);
}
TDIST_HOST_DEVICE u64 profile_buffer_bytes(u32 max_blocks, u32 num_tracks, u32 capacity) {
  return sizeof(ProfileHeader) +
         static_cast<u64>(kNumProfileKernels) * max_blocks * num_tracks * profile_slot_bytes(capacity);
}

#if !defined(__CUDA_ARCH__)
// Name of the per-module ProfileConfig variable, for loaders that write it (the JIT). Host only:
// NVRTC would keep the string in every cubin, and the loader looks the symbol up only in cubins
// that hold its name (a failed lookup is an API error that compute-sanitizer reports).
constexpr const char* kProfileConfigSymbol = "tdist_profile_config";
#endif

}  // namespace tdist::device

#if defined(__CUDACC__) && defined(TDIST_KERNEL_PROFILE)
#if defined(__CUDACC_RTC__) || defined(TDIST_JIT_MODULE)
// One program per module: external linkage lets the JIT find the symbol by its plain name.
extern "C" __device__ tdist::device::ProfileConfig tdist_profile_config;
__device__ tdist::device::ProfileConfig tdist_profile_config = {nullptr, 0, 0, 0, 0};
#else
// Internal linkage: each translation unit owns its copy (tdist::configure_kernel_profile sets it).
static __device__ tdist::device::ProfileConfig tdist_profile_config = {nullptr, 0, 0, 0, 0};
#endif
#endif

#if defined(__CUDACC__)
namespace tdist::device {

// True in code compiled with the profiler (whether or not a buffer is set at run time).
constexpr bool kKernelProfileCompiled =
#if defined(TDIST_KERNEL_PROFILE)
    true;
#else
    false;
#endif

// Records `event` on `track` of this block of `kernel`. Called by one thread per track (the caller
// picks it); other threads of the block must not record on the same track at the same time.
TDIST_DEVICE void profile_record(ProfileKernel kernel, u32 track, ProfileEvent event, u32 payload) {
#if defined(TDIST_KERNEL_PROFILE)
  const ProfileConfig cfg = tdist_profile_config;
  if (cfg.buffer == nullptr) return;  // compiled in, not enabled: the one branch
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  u32 sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const u32 block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (block >= cfg.max_blocks || track >= cfg.num_tracks) {
    atomicAdd(&cfg.buffer->lost_records, 1u);
    return;
  }
  const u64 slot_index = (static_cast<u64>(kernel) * cfg.max_blocks + block) * cfg.num_tracks + track;
  char* slot = reinterpret_cast<char*>(cfg.buffer + 1) + slot_index * profile_slot_bytes(cfg.capacity);
  const u32 i = atomicAdd(&reinterpret_cast<ProfileSlotHeader*>(slot)->count, 1u);
  if (i >= cfg.capacity) return;  // counted, not written
  ProfileRecord* r = reinterpret_cast<ProfileRecord*>(slot + sizeof(ProfileSlotHeader)) + i;
  ProfileRecord rec;
  rec.time_ns = t;
  rec.event = static_cast<unsigned short>(event);
  rec.sm = static_cast<unsigned short>(sm);
  rec.payload = payload;
  *r = rec;
#else
  (void)kernel, (void)track, (void)event, (void)payload;
#endif
}

}  // namespace tdist::device
#endif  // __CUDACC__
