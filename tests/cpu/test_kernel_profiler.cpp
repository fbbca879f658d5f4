// The intra-kernel profiler without a GPU (runtime/kernel_profiler.hpp, device/profile.cuh):
//   * buffers as the device writes them, built here from random tracks: parsed back with every
//     record, overflow (records past a track's capacity, blocks without a slot) reported;
//   * the Chrome trace of two ranks parses as JSON (Python's json, when python3 is here) and holds
//     the expected events: B/E balanced and properly nested per tid, ts monotonic per tid and
//     relative to the earliest record, names and args as recorded, truncated begins closed;
//   * snapshots survive their compact byte form; malformed buffers and snapshots are refused with
//     an error naming the argument; blocks of launches that interleave in a slot are told apart;
//   * compiled out by default: the instrumented kernels (the AllGather-GEMM's hooked GEMM, the
//     AllGather push, decode attention's split and combine kernels) compiled for sm_90a without the
//     define carry no recorder (no tdist_profile_config symbol, which every record reads first),
//     with it they do, under another cache key, and the profiled GEMM still compiles without
//     spills, stack or wgmma serialisation, the decode split kernel without spills.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/errors.hpp"
#include "cpu/temp_dir.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/runtime/kernel_profiler.hpp"

using namespace tdist;
using device::ProfileEvent;
using device::ProfileKernel;
using device::ProfileRecord;

namespace {

// `expr` throws a tdist::Error whose message holds `text`.
#define EXPECT_ERROR_HOLDS(expr, text)                                                                \
  do {                                                                                                \
    const std::string tdist_msg_ = tdist::test::error_of([&] { (void)(expr); });                      \
    EXPECT_NE(tdist_msg_.find(text), std::string::npos) << #expr << " threw: '" << tdist_msg_ << "'"; \
  } while (0)

// A device-layout buffer of the given geometry with `tracks` written into their slots.
struct FakeBuffer {
  device::ProfileConfig c{};
  std::vector<char> bytes;
  FakeBuffer(uint32_t max_blocks, uint32_t num_tracks, uint32_t capacity) {
    c.max_blocks = max_blocks;
    c.num_tracks = num_tracks;
    c.capacity = capacity;
    bytes.assign(device::profile_buffer_bytes(max_blocks, num_tracks, capacity), 0);
    device::ProfileHeader h{};
    h.magic = device::kProfileMagic;
    h.version = device::kProfileVersion;
    h.num_kernels = device::kNumProfileKernels;
    h.max_blocks = max_blocks;
    h.num_tracks = num_tracks;
    h.capacity = capacity;
    std::memcpy(bytes.data(), &h, sizeof h);
  }
  char* slot(ProfileKernel k, uint32_t block, uint32_t track) {
    const uint64_t i = (static_cast<uint64_t>(k) * c.max_blocks + block) * c.num_tracks + track;
    return bytes.data() + sizeof(device::ProfileHeader) + i * device::profile_slot_bytes(c.capacity);
  }
  // Writes records as the device does: the count goes on past the capacity, the records do not.
  void put(ProfileKernel k, uint32_t block, uint32_t track, const std::vector<ProfileRecord>& records) {
    char* s = slot(k, block, track);
    const uint32_t count = static_cast<uint32_t>(records.size());
    std::memcpy(s, &count, sizeof count);
    for (uint32_t i = 0; i < count && i < c.capacity; ++i)
      std::memcpy(s + sizeof(device::ProfileSlotHeader) + i * sizeof(ProfileRecord), &records[i],
                  sizeof(ProfileRecord));
  }
  void set_lost(uint32_t lost) {
    std::memcpy(bytes.data() + offsetof(device::ProfileHeader, lost_records), &lost, sizeof lost);
  }
};

ProfileRecord rec(uint64_t t, ProfileEvent e, uint32_t payload, uint32_t sm = 7) {
  ProfileRecord r{};
  r.time_ns = t;
  r.event = static_cast<unsigned short>(e);
  r.sm = static_cast<unsigned short>(sm);
  r.payload = payload;
  return r;
}

// A producer-like track: tiles, each holding 0..2 waits, at increasing random times from `t0`.
std::vector<ProfileRecord> gemm_track(std::mt19937_64& rng, uint64_t t0, int tiles, int first_tile, int stride,
                                      bool waits) {
  std::vector<ProfileRecord> v;
  uint64_t t = t0;
  auto step = [&] { return t += 1 + rng() % 5000; };
  for (int i = 0; i < tiles; ++i) {
    const uint32_t tile = static_cast<uint32_t>(first_tile + i * stride);
    v.push_back(rec(step(), ProfileEvent::kTileBegin, tile));
    const int nw = waits ? static_cast<int>(rng() % 3) : 0;
    for (int w = 0; w < nw; ++w) {
      const uint32_t chunk = static_cast<uint32_t>(rng() % 8);
      v.push_back(rec(step(), ProfileEvent::kWaitBegin, chunk));
      v.push_back(rec(step(), ProfileEvent::kWaitEnd, chunk));
    }
    v.push_back(rec(step(), ProfileEvent::kTileEnd, tile));
  }
  return v;
}

bool have_python() { return std::system("python3 -c 'import json' >/dev/null 2>&1") == 0; }

// Checks a trace file with Python's json: returns the checker's output ("ok ..." on success).
std::string python_check(const std::string& trace, const std::string& dir, bool origin_written = true) {
  const std::string script = dir + "/check.py", out = dir + "/check.out";
  std::ofstream(script) << R"PY(
import json, sys
doc = json.load(open(sys.argv[1]))
ev = doc["traceEvents"]
stacks, last, names, counts = {}, {}, {}, {}
for e in ev:
    key = (e["pid"], e["tid"])
    if e["ph"] == "M":
        if e["name"] == "thread_name":
            names[key] = e["args"]["name"]
        continue
    assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
    assert e["ts"] >= last.get(key, 0), ("ts not monotonic", e)
    last[key] = e["ts"]
    counts[e["ph"]] = counts.get(e["ph"], 0) + 1
    st = stacks.setdefault(key, [])
    if e["ph"] == "B":
        st.append(e["name"])
    elif e["ph"] == "E":
        assert st and st[-1] == e["name"], ("unbalanced E", e, st)
        st.pop()
    else:
        assert e["ph"] == "i", e
for key, st in stacks.items():
    assert not st, ("unclosed B", key, st)
    assert key in names, ("no thread_name", key)
if sys.argv[2] == "1":  # the earliest record was written (not a skipped one)
    assert min(e["ts"] for e in ev if e["ph"] != "M") == 0
print("ok", counts.get("B", 0), counts.get("E", 0), counts.get("i", 0), len(names))
)PY";
  const std::string cmd = "python3 " + script + " " + trace + (origin_written ? " 1" : " 0") + " >" + out + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return (rc == 0 ? "" : "rc!=0: ") + ss.str();
}

}  // namespace

TEST(KernelProfiler, BufferParsesBackWithOverflowCounted) {
  std::mt19937_64 rng(std::random_device{}());
  FakeBuffer buf(5, 2, 64);
  const auto a = gemm_track(rng, 1000, 7, 3, 5, true);   // fits
  const auto b = gemm_track(rng, 2000, 40, 1, 5, true);  // > 64 records: overflows
  buf.put(ProfileKernel::kAllGatherGemm, 3, 0, a);
  buf.put(ProfileKernel::kAllGatherGemm, 1, 1, b);
  buf.put(ProfileKernel::kAllGatherPush, 4, 0, {rec(5, ProfileEvent::kMark, 9)});
  buf.set_lost(11);
  const ProfileSnapshot s = ProfileSnapshot::from_buffer(buf.bytes.data(), buf.bytes.size(), 3);
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.lost_records, 11u);
  ASSERT_EQ(s.tracks.size(), 3u);  // empty slots left out, kernel-major order
  EXPECT_EQ(s.tracks[0].block, 1u);
  EXPECT_EQ(s.tracks[0].track, 1u);
  EXPECT_EQ(s.tracks[0].claimed, b.size());
  ASSERT_EQ(s.tracks[0].records.size(), 64u);
  EXPECT_EQ(s.tracks[1].block, 3u);
  ASSERT_EQ(s.tracks[1].records.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(s.tracks[1].records[i].time_ns, a[i].time_ns);
    EXPECT_EQ(s.tracks[1].records[i].event, a[i].event);
    EXPECT_EQ(s.tracks[1].records[i].payload, a[i].payload);
  }
  EXPECT_EQ(s.tracks[2].kernel, ProfileKernel::kAllGatherPush);
  EXPECT_EQ(s.dropped_records(), b.size() - 64);

  const ProfileSnapshot back = ProfileSnapshot::deserialize(s.serialize());
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.lost_records, 11u);
  ASSERT_EQ(back.tracks.size(), s.tracks.size());
  for (size_t i = 0; i < s.tracks.size(); ++i) {
    EXPECT_EQ(back.tracks[i].claimed, s.tracks[i].claimed);
    ASSERT_EQ(back.tracks[i].records.size(), s.tracks[i].records.size());
    for (size_t j = 0; j < s.tracks[i].records.size(); ++j)
      EXPECT_EQ(std::memcmp(&back.tracks[i].records[j], &s.tracks[i].records[j], sizeof(ProfileRecord)), 0);
  }
}

TEST(KernelProfiler, MalformedInputIsRefusedByName) {
  FakeBuffer buf(2, 2, 16);
  EXPECT_ERROR_HOLDS(ProfileSnapshot::from_buffer(buf.bytes.data(), 10, 0), "bytes");
  std::vector<char> bad = buf.bytes;
  bad[0] ^= 1;
  EXPECT_ERROR_HOLDS(ProfileSnapshot::from_buffer(bad.data(), bad.size(), 0), "magic");
  EXPECT_ERROR_HOLDS(ProfileSnapshot::from_buffer(buf.bytes.data(), buf.bytes.size() - 16, 0), "bytes");
  FakeBuffer ok(2, 2, 16);
  ok.put(ProfileKernel::kUser0, 1, 1, {rec(1, ProfileEvent::kUserBegin, 1), rec(2, ProfileEvent::kUserEnd, 1)});
  const std::string ser = ProfileSnapshot::from_buffer(ok.bytes.data(), ok.bytes.size(), 0).serialize();
  EXPECT_ERROR_HOLDS(ProfileSnapshot::deserialize(ser.substr(0, ser.size() - 1)), "bytes");
  EXPECT_ERROR_HOLDS(ProfileSnapshot::deserialize(ser + "x"), "bytes");
  EXPECT_ERROR_HOLDS(ProfileSnapshot::deserialize("abc"), "bytes");
}

TEST(KernelProfiler, ChromeTraceOfTwoRanksParsesAndHoldsTheEvents) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<ProfileSnapshot> ranks;
  uint64_t expected_pairs = 0, expected_marks = 0, expected_tracks = 0;
  const uint64_t base = 1'700'000'000'000'000'000ull + rng() % 1000000;  // %globaltimer: ns since the epoch
  uint64_t earliest = ~0ull;
  for (int r = 0; r < 2; ++r) {
    FakeBuffer buf(7, 2, 256);
    const int blocks = 3 + static_cast<int>(rng() % 4);
    for (int b = 0; b < blocks; ++b) {
      const uint64_t t0 = base + rng() % 100000;
      const auto producer = gemm_track(rng, t0, 2 + static_cast<int>(rng() % 5), b, blocks, true);
      const auto math = gemm_track(rng, t0 + 50, static_cast<int>(producer.size() > 0) * 3, b, blocks, false);
      buf.put(ProfileKernel::kAllGatherGemm, static_cast<uint32_t>(b), 0, producer);
      buf.put(ProfileKernel::kAllGatherGemm, static_cast<uint32_t>(b), 1, math);
      expected_pairs += (producer.size() + math.size()) / 2;
      earliest = std::min<uint64_t>({earliest, producer[0].time_ns, math[0].time_ns});
      expected_tracks += 2;
    }
    // The push kernel: an exchange, copies to a peer, a mark, the closing exchange.
    const uint64_t t = base + rng() % 100000;
    buf.put(ProfileKernel::kAllGatherPush, 0, 0,
            {rec(t, ProfileEvent::kWaitBegin, 0), rec(t + 10, ProfileEvent::kWaitEnd, 0),
             rec(t + 20, ProfileEvent::kCopyIssue, 1 - r), rec(t + 900, ProfileEvent::kCopyLand, 1 - r),
             rec(t + 905, ProfileEvent::kMark, 42), rec(t + 910, ProfileEvent::kWaitBegin, 1),
             rec(t + 1000, ProfileEvent::kWaitEnd, 1)});
    earliest = std::min<uint64_t>(earliest, t);
    expected_pairs += 3;
    expected_marks += 1;
    expected_tracks += 1;
    ranks.push_back(ProfileSnapshot::from_buffer(buf.bytes.data(), buf.bytes.size(), r));
  }
  TraceStats stats;
  const json::Value doc = chrome_trace(ranks, &stats);
  EXPECT_EQ(stats.events, 2 * expected_pairs + expected_marks);
  EXPECT_EQ(stats.dropped + stats.lost + stats.unmatched + stats.truncated, 0u);
  const std::string text = doc.dump();
  EXPECT_NE(text.find("\"origin_ns\": " + std::to_string(earliest)), std::string::npos);
  EXPECT_NE(text.find("\"name\": \"ag_gemm block 0 producer\""), std::string::npos);
  EXPECT_NE(text.find("\"name\": \"ag_gemm block 2 math\""), std::string::npos);
  EXPECT_NE(text.find("\"name\": \"ag_push block 0 track\""), std::string::npos);
  EXPECT_NE(text.find("\"name\": \"rank 1\""), std::string::npos);
  EXPECT_NE(text.find("\"phase\": 1"), std::string::npos);
  EXPECT_NE(text.find("\"peer\": 0"), std::string::npos);

  tdist::test::TempDir dir;
  const std::string path = dir.file("trace.json");
  const TraceStats written = write_chrome_trace(path, ranks);
  EXPECT_EQ(written.events, stats.events);
  if (!have_python()) GTEST_SKIP() << "python3 missing: the trace's JSON is not parsed back";
  const std::string out = python_check(path, dir.path);
  EXPECT_EQ(out, "ok " + std::to_string(expected_pairs) + " " + std::to_string(expected_pairs) + " " +
                     std::to_string(expected_marks) + " " + std::to_string(expected_tracks) + "\n");
}

TEST(KernelProfiler, TraceRepairsOverflowAndStrayEnds) {
  FakeBuffer buf(2, 1, 16);
  std::vector<ProfileRecord> v;
  for (uint32_t i = 0; i < 10; ++i) {  // 30 records into 16: the tail's ends are dropped
    v.push_back(rec(100 + 10 * i, ProfileEvent::kTileBegin, i));
    v.push_back(rec(101 + 10 * i, ProfileEvent::kWaitBegin, 1));
    v.push_back(rec(102 + 10 * i, ProfileEvent::kWaitEnd, 1));
    v.push_back(rec(103 + 10 * i, ProfileEvent::kTileEnd, i));
  }
  buf.put(ProfileKernel::kAllGatherGemm, 0, 0, v);
  // A stray end, a crossing pair and an unknown kind on another slot.
  buf.put(ProfileKernel::kUser1, 1, 0,
          {rec(5, ProfileEvent::kWaitEnd, 0), rec(6, ProfileEvent::kTileBegin, 0), rec(7, ProfileEvent::kWaitBegin, 0),
           rec(8, ProfileEvent::kTileEnd, 0), rec(9, ProfileEvent::kWaitEnd, 0),
           rec(10, static_cast<ProfileEvent>(77), 0)});
  buf.set_lost(4);
  const ProfileSnapshot s = ProfileSnapshot::from_buffer(buf.bytes.data(), buf.bytes.size(), 0);
  TraceStats stats;
  const std::string text = chrome_trace({s}, &stats).dump();
  EXPECT_EQ(stats.dropped, 40u - 16u);
  EXPECT_EQ(stats.lost, 4u);
  EXPECT_EQ(stats.unmatched, 3u);  // the stray end, the crossing tile end, the unknown kind
  EXPECT_EQ(stats.truncated, 1u);  // the crossing tile, closed at the track's end
  EXPECT_NE(text.find("\"dropped_records\": 24"), std::string::npos);
  EXPECT_NE(text.find("\"lost_records\": 4"), std::string::npos);
  EXPECT_NE(text.find("\"truncated\": true"), std::string::npos);
  tdist::test::TempDir dir;
  write_chrome_trace(dir.file("t.json"), {s});
  if (!have_python()) GTEST_SKIP() << "python3 missing: the trace's JSON is not parsed back";
  const std::string out = python_check(dir.file("t.json"), dir.path, /*origin_written=*/false);
  EXPECT_EQ(out.substr(0, 3), "ok ") << out;
}

// Blocks of consecutive launches interleave in a slot (the next launch's block resident early on
// another SM): blocks_by_launch separates them by SM, orders each slot's by start, and leaves out
// records outside a block's user span and other kernels' tracks; a nested user span stays inside.
TEST(KernelProfiler, BlocksOfInterleavedLaunchesAreSeparated) {
  using E = ProfileEvent;
  auto track = [](ProfileKernel k, uint32_t block, std::vector<ProfileRecord> r) {
    ProfileTrack t;
    t.kernel = k;
    t.block = block;
    t.claimed = static_cast<uint32_t>(r.size());
    t.records = std::move(r);
    return t;
  };
  ProfileSnapshot s;
  // Slot 3: launch 0 on SM 5, launch 1 on SM 9 entering during it; a stray end and a record outside
  // any span on SM 7.
  s.tracks.push_back(track(ProfileKernel::kFlashDecodeSplit, 3,
                           {rec(5, E::kWaitEnd, 0, 7), rec(10, E::kUserBegin, 0, 5), rec(11, E::kWaitBegin, 0, 5),
                            rec(12, E::kWaitEnd, 0, 5), rec(15, E::kTileBegin, 4, 5), rec(16, E::kUserBegin, 0, 9),
                            rec(17, E::kWaitBegin, 0, 9), rec(30, E::kTileEnd, 4, 5), rec(31, E::kUserEnd, 0, 5),
                            rec(40, E::kWaitEnd, 0, 9), rec(45, E::kTileBegin, 4, 9), rec(60, E::kTileEnd, 4, 9),
                            rec(61, E::kUserEnd, 0, 9)}));
  // Slot 4: both launches on SM 2, one after the other; the second with a nested user span.
  s.tracks.push_back(track(ProfileKernel::kFlashDecodeSplit, 4,
                           {rec(9, E::kUserBegin, 1, 2), rec(29, E::kUserEnd, 1, 2), rec(33, E::kUserBegin, 1, 2),
                            rec(50, E::kUserBegin, 7, 2), rec(52, E::kUserEnd, 7, 2), rec(62, E::kUserEnd, 1, 2)}));
  s.tracks.push_back(track(ProfileKernel::kFlashDecodeCombine, 0,
                           {rec(35, E::kUserBegin, 0, 1), rec(36, E::kUserEnd, 0, 1)}));
  const auto launches = blocks_by_launch(s, ProfileKernel::kFlashDecodeSplit);
  ASSERT_EQ(launches.size(), 2u);
  ASSERT_EQ(launches[0].size(), 2u);
  ASSERT_EQ(launches[1].size(), 2u);
  auto times = [](const std::vector<ProfileRecord>& b) {
    std::vector<uint64_t> t;
    for (const ProfileRecord& r : b) t.push_back(r.time_ns);
    return t;
  };
  EXPECT_EQ(times(launches[0][0]), (std::vector<uint64_t>{10, 11, 12, 15, 30, 31}));
  EXPECT_EQ(times(launches[0][1]), (std::vector<uint64_t>{9, 29}));
  EXPECT_EQ(times(launches[1][0]), (std::vector<uint64_t>{16, 17, 40, 45, 60, 61}));
  EXPECT_EQ(times(launches[1][1]), (std::vector<uint64_t>{33, 50, 52, 62}));
  EXPECT_EQ(blocks_by_launch(s, ProfileKernel::kFlashDecodeCombine).size(), 1u);
  EXPECT_TRUE(blocks_by_launch(s, ProfileKernel::kAllGatherPush).empty());
}

TEST(KernelProfiler, OptionsAndEnvironmentAreChecked) {
  EXPECT_FALSE(KernelProfiler::enabled());
  EXPECT_ERROR_HOLDS(KernelProfiler::reset(), "not enabled");
  EXPECT_ERROR_HOLDS(KernelProfiler::read(0), "not enabled");
  EXPECT_EQ(KernelProfiler::config().buffer, nullptr);
  setenv("TDIST_KERNEL_PROFILE_RECORDS", "12", 1);
  EXPECT_ERROR_HOLDS(kernel_profile_records_from_env(), "TDIST_KERNEL_PROFILE_RECORDS");
  setenv("TDIST_KERNEL_PROFILE_RECORDS", "512", 1);
  EXPECT_EQ(kernel_profile_records_from_env(), 512);
  unsetenv("TDIST_KERNEL_PROFILE_RECORDS");
  EXPECT_EQ(kernel_profile_records_from_env(), 4096);
  EXPECT_ERROR_HOLDS(write_chrome_trace("", {}), "path");
}

// The instrumented programs, as the library registers them, with and without the define.
TEST(KernelProfiler, RecorderIsCompiledOutByDefault) {
#if defined(TDIST_KERNEL_PROFILE)
  GTEST_SKIP() << "built with TDIST_KERNEL_PROFILE: every program carries the recorder";
#endif
  ASSERT_FALSE(KernelProfiler::jit_define());
  tdist::test::TempDir cache;
  jit::KernelCache kernels(cache.path);
  int checked = 0, gemms = 0, pushes = 0, decodes = 0;
  for (const auto& f : jit::registered_kernels()) {
    if (f.name != "gemm_overlap" && f.name != "collectives" && f.name != "flash_decode") continue;
    for (jit::CompileRequest r : f.requests()) {
      const bool gemm = r.file_name.find("AllGatherWaitHooks") != std::string::npos;
      const bool push = r.source.find("all_gather.cuh") != std::string::npos;
      const bool decode = f.name == "flash_decode";
      if (!gemm && !push && !decode) continue;
      if ((gemm && gemms > 0) || (decode && decodes > 0)) continue;  // one GEMM tile, one decode pair
      SCOPED_TRACE(r.file_name);
      r.arch = "sm_90a";
      r.compiler = jit::CompilerKind::kNvrtc;
      const auto plain = jit::compile(r, kernels);
      EXPECT_EQ(plain->cubin.find(device::kProfileConfigSymbol), std::string::npos) << "recorder left in";
      jit::CompileRequest profiled = r;
      profiled.defines.push_back("TDIST_KERNEL_PROFILE=1");
      const auto with = jit::compile(profiled, kernels);
      EXPECT_NE(with->cubin.find(device::kProfileConfigSymbol), std::string::npos) << "no recorder";
      EXPECT_NE(jit::to_hex(plain->key), jit::to_hex(with->key));
      EXPECT_NE(plain->cubin, with->cubin);
      if (decode) {
        // The split kernel (the bandwidth-bound loop) still spills nothing; the combine kernel's few
        // bytes are the registers saved around its wait's timeout diagnostic, with or without.
        const std::regex split(
            R"(Compiling entry function '[^']*flash_decode_split[^']*'[^\n]*\n[^\n]*\n[^\n]*?(\d+) bytes spill stores, (\d+) bytes spill loads)");
        std::smatch m;
        ASSERT_TRUE(std::regex_search(with->log, m, split)) << with->log;
        EXPECT_EQ(m[1].str() + m[2].str(), "00") << with->log;
      } else {
        EXPECT_EQ(with->spill_stores + with->spill_loads, 0) << with->log;
      }
      if (gemm) {
        EXPECT_EQ(with->log.find("Potential Performance Loss"), std::string::npos) << "wgmma serialised:\n"
                                                                                   << with->log;
        const std::regex stack(R"((\d+) bytes stack frame)");
        for (auto it = std::sregex_iterator(with->log.begin(), with->log.end(), stack); it != std::sregex_iterator();
             ++it)
          EXPECT_EQ((*it)[1].str(), "0") << "stack frame (local memory):\n" << with->log;
      }
      ++checked;
      gemms += gemm;
      pushes += push;
      decodes += decode;
    }
  }
  EXPECT_EQ(gemms, 1);
  EXPECT_EQ(pushes, 1);
  EXPECT_EQ(decodes, 1);
}

// bench/plot_trace.py draws a trace the writer made (where python3 has matplotlib).
TEST(KernelProfiler, PlotScriptDrawsATrace) {
  if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with matplotlib missing: bench/plot_trace.py not run";
  std::mt19937_64 rng(std::random_device{}());
  std::vector<ProfileSnapshot> ranks;
  for (int r = 0; r < 2; ++r) {
    FakeBuffer buf(4, 2, 128);
    for (uint32_t b = 0; b < 4; ++b) {
      buf.put(ProfileKernel::kAllGatherGemm, b, 0, gemm_track(rng, 1000 + b, 5, static_cast<int>(b), 4, true));
      buf.put(ProfileKernel::kAllGatherGemm, b, 1, gemm_track(rng, 1500 + b, 5, static_cast<int>(b), 4, false));
    }
    buf.put(ProfileKernel::kAllGatherPush, 0, 0,
            {rec(900, ProfileEvent::kWaitBegin, 0), rec(950, ProfileEvent::kWaitEnd, 0),
             rec(960, ProfileEvent::kCopyIssue, 1), rec(2000, ProfileEvent::kCopyLand, 1),
             rec(2100, ProfileEvent::kMark, 3)});
    ranks.push_back(ProfileSnapshot::from_buffer(buf.bytes.data(), buf.bytes.size(), r));
  }
  tdist::test::TempDir dir;
  write_chrome_trace(dir.file("trace.json"), ranks);
  const std::string cmd = std::string("python3 ") + TDIST_SOURCE_DIR + "/bench/plot_trace.py " +
                          dir.file("trace.json") + " " + dir.file("trace.png") + " >" + dir.file("plot.log") + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir.file("plot.log"));
  std::stringstream ss;
  ss << log.rdbuf();
  ASSERT_EQ(rc, 0) << ss.str();
  EXPECT_NE(ss.str().find("18 tracks"), std::string::npos) << ss.str();  // 2 ranks x (4 blocks x 2 + 1)
  std::ifstream png(dir.file("trace.png"), std::ios::binary);
  char magic[8] = {};
  png.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  // A filter that leaves nothing is an error, not an empty picture.
  const std::string none = std::string("python3 ") + TDIST_SOURCE_DIR + "/bench/plot_trace.py " +
                           dir.file("trace.json") + " " + dir.file("none.png") + " --kernel nothing >/dev/null 2>&1";
  EXPECT_NE(std::system(none.c_str()), 0);
}
