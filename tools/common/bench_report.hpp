// The result file every tdist benchmark writes (tdist-bench, bench/*.cu, python -m tdist.bench),
// schema "tdist.bench/1", through tdist::json (valid JSON: non-finite numbers become null):
//
//   {"schema": "tdist.bench/1", "bench": "tdist-bench", "tdist_version": "0.1.0",
//    "gpu": "NVIDIA H200", "world_size": 2, "dtype": "bf16", "command": "...", <settings>,
//    "rows": [{"op": "all_gather", "bytes": 4096, "impl": "tdist", "method": "auto:ll", "us": 5.1,
//              "algbw_gbps": ..., "busbw_gbps": ..., "wrong": 0}, ...]}
//
// One row per measured implementation ("impl": tdist, nccl, cublas, nccl+cublas, gemm, ...), so
// that one reader (bench/plot.py) draws every benchmark. GEMM rows carry m, n, k (per rank) instead
// of bytes, and "tflops".
#pragma once

#include <string>

#include "tdist/common/json.hpp"
#include "tdist/version.hpp"

namespace tdist::bench {

inline constexpr const char* kSchema = "tdist.bench/1";

inline std::string command_line(int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  return command;
}

// The document's header; rows are appended to doc["rows"].
inline json::Value document(const std::string& bench, const std::string& gpu, int world_size, const std::string& dtype,
                            int argc, char** argv) {
  json::Value doc;
  doc["schema"] = kSchema;
  doc["bench"] = bench;
  doc["tdist_version"] = tdist::version();
  doc["gpu"] = gpu;
  doc["world_size"] = world_size;
  doc["dtype"] = dtype;
  doc["command"] = command_line(argc, argv);
  doc["rows"] = json::Array{};
  return doc;
}

}  // namespace tdist::bench
