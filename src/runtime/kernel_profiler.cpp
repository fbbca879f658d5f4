// Intra-kernel profiler, host side (runtime/kernel_profiler.hpp): the process's buffer, reading it
// back, snapshots in compact form, and the Chrome trace writer.
#include "tdist/runtime/kernel_profiler.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"

namespace tdist {

using device::ProfileConfig;
using device::ProfileEvent;
using device::ProfileHeader;
using device::ProfileKernel;
using device::ProfileRecord;
using device::ProfileSlotHeader;

namespace {

constexpr int kDefaultRecordsPerTrack = 4096;
constexpr int kMaxRecordsPerTrack = 1 << 20;
constexpr int kMaxTracks = 64;
constexpr int kMaxBlocks = 1 << 16;
// Largest buffer enable() allocates: a profile is a debugging aid, not a second heap.
constexpr uint64_t kMaxBufferBytes = uint64_t{4} << 30;

struct State {
  std::mutex mu;
  void* buffer = nullptr;  // ProfileHeader, then the slots (device/profile.cuh)
  ProfileConfig config{};
  uint64_t bytes = 0;
  int device = -1;
  std::atomic<uint64_t> generation{1};
};

State& state() {
  static State s;
  return s;
}

// Header of an empty buffer of the given geometry.
ProfileHeader make_header(const ProfileConfig& c) {
  ProfileHeader h{};
  h.magic = device::kProfileMagic;
  h.version = device::kProfileVersion;
  h.num_kernels = device::kNumProfileKernels;
  h.max_blocks = c.max_blocks;
  h.num_tracks = c.num_tracks;
  h.capacity = c.capacity;
  return h;
}

// Compact form: a fixed header, then per track its ids, claimed count, record count and records.
constexpr uint32_t kCompactMagic = 0x43504454u;  // "TDPC"

struct CompactHeader {
  uint32_t magic;
  int32_t rank;
  uint32_t max_blocks, num_tracks, capacity;
  uint32_t num_track_entries;
  uint64_t lost_records;
};

struct CompactTrack {
  uint32_t kernel, block, track, claimed, stored;
};

template <typename T>
void append(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
T take(const std::string& in, size_t& at, const char* what) {
  TDIST_CHECK_ARG(in.size() - at >= sizeof(T) && at <= in.size(), "bytes", "a profile snapshot cut short in its ", what,
                  " (", in.size(), " bytes)");
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

bool is_begin(ProfileEvent e) { return e != ProfileEvent::kMark && static_cast<unsigned>(e) % 2 == 0; }

// What a record's payload means, per kernel and kind (the argument's name in the trace).
const char* payload_name(ProfileKernel k, ProfileEvent e) {
  const unsigned kind = static_cast<unsigned>(e) / 2;  // 0 tile, 1 wait, 2 copy, 3 user, 4 mark
  if (kind == 0) return "tile";
  if (k == ProfileKernel::kAllGatherGemm && kind == 1) return "chunk";
  if (k == ProfileKernel::kAllGatherPush && kind == 1) return "phase";
  if (kind == 2) return "peer";
  return "payload";
}

const char* track_name(ProfileKernel k, uint32_t track) {
  if (k == ProfileKernel::kAllGatherGemm) return track == 0 ? "producer" : track == 1 ? "math" : "track";
  return "track";
}

}  // namespace

int kernel_profile_records_from_env() {
  return static_cast<int>(
      env::integer("TDIST_KERNEL_PROFILE_RECORDS", kDefaultRecordsPerTrack, 16, kMaxRecordsPerTrack));
}

uint64_t ProfileSnapshot::dropped_records() const {
  uint64_t n = 0;
  for (const ProfileTrack& t : tracks) n += t.claimed - t.records.size();
  return n;
}

ProfileSnapshot ProfileSnapshot::from_buffer(const void* bytes, size_t size, int rank) {
  TDIST_CHECK_ARG(bytes != nullptr && size >= sizeof(ProfileHeader), "bytes", "a profile buffer of at least its ",
                  sizeof(ProfileHeader), "-byte header, got ", size, " bytes");
  ProfileHeader h;
  std::memcpy(&h, bytes, sizeof h);
  TDIST_CHECK_ARG(h.magic == device::kProfileMagic, "bytes", "a profile buffer (magic ", device::kProfileMagic,
                  "), got magic ", h.magic);
  TDIST_CHECK_ARG(h.version == device::kProfileVersion, "bytes", "profile buffer version ", device::kProfileVersion,
                  ", got ", h.version);
  TDIST_CHECK_ARG(h.num_kernels == device::kNumProfileKernels, "bytes", "a buffer of ", device::kNumProfileKernels,
                  " kernels, got ", h.num_kernels);
  TDIST_CHECK_ARG(h.max_blocks >= 1 && h.max_blocks <= kMaxBlocks && h.num_tracks >= 1 && h.num_tracks <= kMaxTracks &&
                      h.capacity >= 1 && h.capacity <= kMaxRecordsPerTrack,
                  "bytes", "max_blocks in [1, ", kMaxBlocks, "], num_tracks in [1, ", kMaxTracks, "], capacity in [1, ",
                  kMaxRecordsPerTrack, "], got ", h.max_blocks, ", ", h.num_tracks, ", ", h.capacity);
  const uint64_t need = device::profile_buffer_bytes(h.max_blocks, h.num_tracks, h.capacity);
  TDIST_CHECK_ARG(size >= need, "bytes", "a profile buffer of ", need, " bytes for its geometry, got ", size);

  ProfileSnapshot s;
  s.rank = rank;
  s.max_blocks = h.max_blocks;
  s.num_tracks = h.num_tracks;
  s.capacity = h.capacity;
  s.lost_records = h.lost_records;
  const char* slots = static_cast<const char*>(bytes) + sizeof(ProfileHeader);
  const uint64_t slot_bytes = device::profile_slot_bytes(h.capacity);
  for (uint32_t k = 0; k < device::kNumProfileKernels; ++k)
    for (uint32_t b = 0; b < h.max_blocks; ++b)
      for (uint32_t t = 0; t < h.num_tracks; ++t) {
        const char* slot = slots + ((uint64_t{k} * h.max_blocks + b) * h.num_tracks + t) * slot_bytes;
        ProfileSlotHeader sh;
        std::memcpy(&sh, slot, sizeof sh);
        if (sh.count == 0) continue;
        ProfileTrack tr;
        tr.kernel = static_cast<ProfileKernel>(k);
        tr.block = b;
        tr.track = t;
        tr.claimed = sh.count;
        tr.records.resize(std::min(sh.count, h.capacity));
        std::memcpy(tr.records.data(), slot + sizeof(ProfileSlotHeader), tr.records.size() * sizeof(ProfileRecord));
        s.tracks.push_back(std::move(tr));
      }
  return s;
}

std::string ProfileSnapshot::serialize() const {
  std::string out;
  append(out, CompactHeader{kCompactMagic, rank, max_blocks, num_tracks, capacity, static_cast<uint32_t>(tracks.size()),
                            lost_records});
  for (const ProfileTrack& t : tracks) {
    append(out, CompactTrack{static_cast<uint32_t>(t.kernel), t.block, t.track, t.claimed,
                             static_cast<uint32_t>(t.records.size())});
    out.append(reinterpret_cast<const char*>(t.records.data()), t.records.size() * sizeof(ProfileRecord));
  }
  return out;
}

ProfileSnapshot ProfileSnapshot::deserialize(const std::string& bytes) {
  size_t at = 0;
  const auto h = take<CompactHeader>(bytes, at, "header");
  TDIST_CHECK_ARG(h.magic == kCompactMagic, "bytes", "a serialized profile snapshot (magic ", kCompactMagic,
                  "), got magic ", h.magic);
  ProfileSnapshot s;
  s.rank = h.rank;
  s.max_blocks = h.max_blocks;
  s.num_tracks = h.num_tracks;
  s.capacity = h.capacity;
  s.lost_records = h.lost_records;
  for (uint32_t i = 0; i < h.num_track_entries; ++i) {
    const auto ct = take<CompactTrack>(bytes, at, "track list");
    TDIST_CHECK_ARG(ct.kernel < device::kNumProfileKernels && ct.stored <= ct.claimed && ct.stored <= h.capacity,
                    "bytes", "a track of kernel < ", device::kNumProfileKernels,
                    " with stored <= claimed and stored <= capacity, got kernel ", ct.kernel, ", stored ", ct.stored,
                    ", claimed ", ct.claimed);
    ProfileTrack t;
    t.kernel = static_cast<ProfileKernel>(ct.kernel);
    t.block = ct.block;
    t.track = ct.track;
    t.claimed = ct.claimed;
    t.records.resize(ct.stored);
    const size_t n = ct.stored * sizeof(ProfileRecord);
    TDIST_CHECK_ARG(bytes.size() - at >= n, "bytes", "a profile snapshot cut short in its records");
    std::memcpy(t.records.data(), bytes.data() + at, n);
    at += n;
    s.tracks.push_back(std::move(t));
  }
  TDIST_CHECK_ARG(at == bytes.size(), "bytes", "a profile snapshot of ", at, " bytes, got ", bytes.size());
  return s;
}

void KernelProfiler::enable(const KernelProfilerOptions& o) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  TDIST_CHECK(st.buffer == nullptr, "KernelProfiler::enable: the profiler is already enabled (disable() first)");
  const int dev = current_device();
  int max_blocks = o.max_blocks;
  if (max_blocks == 0) {
    max_blocks = 2 * sm_count(dev);
  }
  const int records = o.records_per_track == 0 ? kernel_profile_records_from_env() : o.records_per_track;
  TDIST_CHECK_ARG(max_blocks >= 1 && max_blocks <= kMaxBlocks, "options.max_blocks",
                  "expected 0 (twice the SMs) or 1 to ", kMaxBlocks, ", got ", o.max_blocks);
  TDIST_CHECK_ARG(o.num_tracks >= 1 && o.num_tracks <= kMaxTracks, "options.num_tracks", "expected 1 to ", kMaxTracks,
                  ", got ", o.num_tracks);
  TDIST_CHECK_ARG(records >= 16 && records <= kMaxRecordsPerTrack, "options.records_per_track",
                  "expected 0 (the environment's) or 16 to ", kMaxRecordsPerTrack, ", got ", records);
  ProfileConfig c{};
  c.max_blocks = static_cast<uint32_t>(max_blocks);
  c.num_tracks = static_cast<uint32_t>(o.num_tracks);
  c.capacity = static_cast<uint32_t>(records);
  const uint64_t bytes = device::profile_buffer_bytes(c.max_blocks, c.num_tracks, c.capacity);
  TDIST_CHECK_ARG(bytes <= kMaxBufferBytes, "options", "a buffer of at most ", kMaxBufferBytes,
                  " bytes (max_blocks x num_tracks x records_per_track x 64), got ", bytes);
  void* p = nullptr;
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  TDIST_CUDA_CHECK(cudaMalloc(&p, bytes));
  const ProfileHeader h = make_header(c);
  // Synchronised: the kernels that will record run on other (non-blocking) streams.
  if (cudaMemset(p, 0, bytes) != cudaSuccess || cudaMemcpy(p, &h, sizeof h, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    cudaFree(p);
    TDIST_FAIL("KernelProfiler::enable: cannot initialise the ", bytes, "-byte buffer");
  }
  c.buffer = static_cast<ProfileHeader*>(p);
  st.buffer = p;
  st.config = c;
  st.bytes = bytes;
  st.device = dev;
  st.generation.fetch_add(1);
}

void KernelProfiler::disable() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.buffer == nullptr) return;
  cudaDeviceSynchronize();  // no kernel may still write into it
  cudaFree(st.buffer);
  st.buffer = nullptr;
  st.config = ProfileConfig{};
  st.bytes = 0;
  st.generation.fetch_add(1);
}

bool KernelProfiler::enabled() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.buffer != nullptr;
}

void KernelProfiler::reset() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  TDIST_CHECK(st.buffer != nullptr, "KernelProfiler::reset: the profiler is not enabled");
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  const ProfileHeader h = make_header(st.config);
  TDIST_CUDA_CHECK(cudaMemset(st.buffer, 0, st.bytes));
  TDIST_CUDA_CHECK(cudaMemcpy(st.buffer, &h, sizeof h, cudaMemcpyHostToDevice));
  // The memset and the copy may still be in flight on the legacy stream, which the recording
  // kernels' non-blocking streams do not wait for.
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
}

ProfileSnapshot KernelProfiler::read(int rank) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  TDIST_CHECK(st.buffer != nullptr, "KernelProfiler::read: the profiler is not enabled");
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<char> host(st.bytes);
  TDIST_CUDA_CHECK(cudaMemcpy(host.data(), st.buffer, st.bytes, cudaMemcpyDeviceToHost));
  return ProfileSnapshot::from_buffer(host.data(), host.size(), rank);
}

ProfileConfig KernelProfiler::config() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.config;
}

uint64_t KernelProfiler::generation() { return state().generation.load(std::memory_order_acquire); }

bool KernelProfiler::jit_define() {
#if defined(TDIST_KERNEL_PROFILE)
  return true;
#else
  return enabled();
#endif
}

std::vector<std::vector<std::vector<ProfileRecord>>> blocks_by_launch(const ProfileSnapshot& s, ProfileKernel kernel) {
  std::vector<std::vector<std::vector<ProfileRecord>>> launches;
  for (const ProfileTrack& t : s.tracks) {
    if (t.kernel != kernel) continue;
    struct Open {
      int depth = 0;
      std::vector<ProfileRecord> records;
    };
    std::map<unsigned, Open> open;  // by SM
    std::vector<std::vector<ProfileRecord>> done;
    for (const ProfileRecord& r : t.records) {
      const auto e = static_cast<ProfileEvent>(r.event);
      Open& o = open[r.sm];
      if (o.depth == 0 && e != ProfileEvent::kUserBegin) continue;  // outside a block's span
      o.records.push_back(r);
      if (e == ProfileEvent::kUserBegin) ++o.depth;
      if (e == ProfileEvent::kUserEnd && --o.depth == 0) {
        done.push_back(std::move(o.records));
        open.erase(r.sm);
      }
    }
    std::stable_sort(done.begin(), done.end(),
                     [](const auto& a, const auto& b) { return a.front().time_ns < b.front().time_ns; });
    if (launches.size() < done.size()) launches.resize(done.size());
    for (size_t k = 0; k < done.size(); ++k) launches[k].push_back(std::move(done[k]));
  }
  return launches;
}

const char* profile_kernel_name(ProfileKernel kernel) {
  switch (kernel) {
    case ProfileKernel::kAllGatherGemm: return "ag_gemm";
    case ProfileKernel::kAllGatherPush: return "ag_push";
    case ProfileKernel::kUser0: return "user0";
    case ProfileKernel::kUser1: return "user1";
    case ProfileKernel::kFlashDecodeSplit: return "decode_split";
    case ProfileKernel::kFlashDecodeCombine: return "decode_combine";
  }
  return "unknown";
}

const char* profile_event_name(ProfileEvent event) {
  switch (event) {
    case ProfileEvent::kTileBegin:
    case ProfileEvent::kTileEnd: return "tile";
    case ProfileEvent::kWaitBegin:
    case ProfileEvent::kWaitEnd: return "wait";
    case ProfileEvent::kCopyIssue:
    case ProfileEvent::kCopyLand: return "copy";
    case ProfileEvent::kUserBegin:
    case ProfileEvent::kUserEnd: return "user";
    case ProfileEvent::kMark: return "mark";
  }
  return "unknown";
}

json::Value chrome_trace(const std::vector<ProfileSnapshot>& ranks, TraceStats* stats_out) {
  TraceStats stats;
  uint64_t origin = std::numeric_limits<uint64_t>::max();
  for (const ProfileSnapshot& s : ranks)
    for (const ProfileTrack& t : s.tracks)
      for (const ProfileRecord& r : t.records) origin = std::min<uint64_t>(origin, r.time_ns);
  auto us = [&](uint64_t ns) { return static_cast<double>(ns - origin) * 1e-3; };

  json::Value events = json::Array{};
  for (const ProfileSnapshot& s : ranks) {
    stats.dropped += s.dropped_records();
    stats.lost += s.lost_records;
    events.push_back(json::Object{{"name", "process_name"},
                                  {"ph", "M"},
                                  {"pid", s.rank},
                                  {"tid", 0},
                                  {"args", json::Object{{"name", "rank " + std::to_string(s.rank)}}}});
    events.push_back(json::Object{{"name", "process_sort_index"},
                                  {"ph", "M"},
                                  {"pid", s.rank},
                                  {"tid", 0},
                                  {"args", json::Object{{"sort_index", s.rank}}}});
    for (const ProfileTrack& t : s.tracks) {
      // One tid per slot: kernel-major, then block, then track (the slot index).
      const uint64_t tid = (static_cast<uint64_t>(t.kernel) * s.max_blocks + t.block) * s.num_tracks + t.track;
      const char* kernel = profile_kernel_name(t.kernel);
      events.push_back(
          json::Object{{"name", "thread_name"},
                       {"ph", "M"},
                       {"pid", s.rank},
                       {"tid", tid},
                       {"args", json::Object{{"name", std::string(kernel) + " block " + std::to_string(t.block) + " " +
                                                          track_name(t.kernel, t.track)}}}});
      events.push_back(json::Object{{"name", "thread_sort_index"},
                                    {"ph", "M"},
                                    {"pid", s.rank},
                                    {"tid", tid},
                                    {"args", json::Object{{"sort_index", tid}}}});
      if (t.records.empty()) continue;
      auto event = [&](const ProfileRecord& r, const char* ph) {
        const auto e = static_cast<ProfileEvent>(r.event);
        json::Value v = json::Object{{"name", profile_event_name(e)}, {"cat", kernel}, {"ph", ph},
                                     {"ts", us(r.time_ns)},           {"pid", s.rank}, {"tid", tid}};
        ++stats.events;
        return v;
      };
      // Begin kinds open on a stack; an end closes the top when it matches, else it is skipped.
      std::vector<ProfileEvent> open;
      for (const ProfileRecord& r : t.records) {
        if (r.event >= device::kNumProfileEvents) {
          ++stats.unmatched;  // not an event kind: garbage, not written
          continue;
        }
        const auto e = static_cast<ProfileEvent>(r.event);
        if (e == ProfileEvent::kMark) {
          json::Value v = event(r, "i");
          v["s"] = "t";
          v["args"] = json::Object{{"payload", r.payload}, {"sm", r.sm}};
          events.push_back(std::move(v));
        } else if (is_begin(e)) {
          json::Value v = event(r, "B");
          v["args"] = json::Object{{payload_name(t.kernel, e), r.payload}, {"sm", r.sm}};
          events.push_back(std::move(v));
          open.push_back(e);
        } else if (!open.empty() && static_cast<unsigned>(open.back()) + 1 == static_cast<unsigned>(e)) {
          events.push_back(event(r, "E"));
          open.pop_back();
        } else {
          ++stats.unmatched;
        }
      }
      // Begins whose end was dropped (capacity) or never recorded: closed at the track's last record.
      const uint64_t last = t.records.back().time_ns;
      while (!open.empty()) {
        ProfileRecord r{};
        r.time_ns = last;
        r.event = static_cast<unsigned short>(static_cast<unsigned>(open.back()) + 1);
        json::Value v = event(r, "E");
        v["args"] = json::Object{{"truncated", true}};
        events.push_back(std::move(v));
        open.pop_back();
        ++stats.truncated;
      }
    }
  }
  json::Value doc = json::Object{};
  doc["traceEvents"] = std::move(events);
  doc["displayTimeUnit"] = "ns";
  doc["otherData"] = json::Object{{"clock", "globaltimer"},
                                  {"origin_ns", origin == std::numeric_limits<uint64_t>::max() ? 0 : origin},
                                  {"dropped_records", stats.dropped},
                                  {"lost_records", stats.lost},
                                  {"unmatched_records", stats.unmatched},
                                  {"truncated_begins", stats.truncated}};
  if (stats_out) *stats_out = stats;
  return doc;
}

TraceStats write_chrome_trace(const std::string& path, const std::vector<ProfileSnapshot>& ranks) {
  TDIST_CHECK_ARG(!path.empty(), "path", "a file name for the trace");
  TraceStats stats;
  const json::Value doc = chrome_trace(ranks, &stats);
  try {
    json::write_file(path, doc);
  } catch (const std::exception& e) {
    TDIST_FAIL("write_chrome_trace: ", e.what());
  }
  return stats;
}

}  // namespace tdist
