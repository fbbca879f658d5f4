// Run-time compilation of CUDA C++ kernels to CUBIN, through NVRTC (default) or nvcc.
//
//   tdist::jit::CompileRequest req = tdist::jit::CompileRequest::from_file("my_kernel.cu");
//   req.name_expressions = {"my_kernel<128, __nv_bfloat16>"};
//   req.arch = "sm_90a";                       // empty: the current GPU's
//   auto kernel = tdist::jit::compile(req);    // cached in memory and on disk
//   kernel->lowered_name("my_kernel<128, __nv_bfloat16>");  // mangled symbol in the cubin
//
// NVRTC cannot compile NCCL's device headers (docs/jit.md): NVRTC kernels use tdist's own
// device descriptor; a source that includes nccl.h / nccl_device.h goes through nvcc.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tdist/jit/hash.hpp"

namespace tdist::jit {

class KernelCache;

enum class CompilerKind {
  kAuto,  // NVRTC, or nvcc when the source includes NCCL's headers (or TDIST_JIT_COMPILER says so)
  kNvrtc,
  kNvcc,
};
const char* to_string(CompilerKind kind);
// "nvrtc", "nvcc", "auto" (case-insensitive); throws tdist::Error on anything else.
CompilerKind parse_compiler_kind(const std::string& s);

// A compile-time constant prepended to the source: `static constexpr TYPE NAME = VALUE;`.
struct Constant {
  std::string type;   // "int", "bool", "__nv_bfloat16" ...
  std::string name;   // "kBlockM"
  std::string value;  // "128"
};

struct CompileRequest {
  std::string source;                         // CUDA C++ source text
  std::string file_name = "kernel.cu";        // names the source in compiler messages; only its base name is
                                              // given to the compiler and enters the key
  std::vector<std::string> name_expressions;  // kernels to instantiate and look up, e.g. "k<128, float>"
  std::vector<Constant> constants;            // prepended before the source (line numbers kept)
  std::vector<std::string> defines;           // "NAME" or "NAME=VALUE" (-D)
  std::vector<std::string> include_dirs;      // searched before tdist's, CUTLASS's and CUDA's
  std::vector<std::string> flags;             // further compiler options, e.g. "-maxrregcount=128"
  std::string arch;                           // "sm_90a", "90a", ...; empty: the current GPU's
  CompilerKind compiler = CompilerKind::kAuto;

  // Reads `path`; file_name becomes `path`, so diagnostics name it and its folder is searched
  // first for the source's quoted includes.
  static CompileRequest from_file(const std::string& path);
};

struct CompiledKernel {
  Digest key{};                                                    // cache key (docs/jit.md)
  std::string arch;                                                // "sm_90a"
  std::string compiler;                                            // compiler identity, e.g. "nvrtc 13.0 ..."
  std::string file_name;                                           // base name of the source
  std::string cubin;                                               // ELF bytes
  std::vector<std::pair<std::string, std::string>> lowered_names;  // name expression -> symbol
  std::string log;                                                 // compiler and ptxas info (-v) log
  std::int64_t spill_stores = 0;                                   // bytes, summed over the functions in the cubin
  std::int64_t spill_loads = 0;

  // Symbol of a name expression given at compile time; throws tdist::Error if it was not given.
  const std::string& lowered_name(const std::string& name_expression) const;
};

// Compiles `req` or takes it from `cache` (KernelCache::global() by default). Throws tdist::Error
// with the compiler log on a compile error, and on spills when TDIST_JIT_FAIL_ON_SPILLS is set.
std::shared_ptr<const CompiledKernel> compile(const CompileRequest& req);
std::shared_ptr<const CompiledKernel> compile(const CompileRequest& req, KernelCache& cache);

// The cache key of `req` without compiling (scans its headers). Resolves kAuto and the arch.
Digest cache_key(const CompileRequest& req);

// "sm_90a" from "sm_90a", "90a", "sm90a", "compute_90a" is rejected (cubin only).
std::string normalize_arch(const std::string& arch);
// The current GPU's arch ("sm_90a" on Hopper: the 'a' suffix from compute capability 9.0 on);
// throws tdist::Error when no GPU is visible.
std::string current_arch();

// Identity strings that enter the key ("nvrtc 13.0 libnvrtc-size=...", "nvcc ...").
std::string compiler_identity(CompilerKind kind);

// Spill bytes from a ptxas -v log (sums over functions).
void parse_spills(const std::string& log, std::int64_t& stores, std::int64_t& loads);

}  // namespace tdist::jit
