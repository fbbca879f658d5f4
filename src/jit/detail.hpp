// Internals of tdist::jit shared between its source files; not installed.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tdist/jit/hash.hpp"

namespace tdist::jit::detail {

// ---- environment
std::string env(const char* name);  // "" when unset
bool env_flag(const char* name);    // tdist::env::flag: unset/empty false; else 1/0/true/... strictly

// ---- files
bool file_exists(const std::string& path);
bool is_dir(const std::string& path);
std::string dirname(const std::string& path);  // "." for a bare name
std::string basename(const std::string& path);
std::string join(const std::string& a, const std::string& b);
void make_dirs(const std::string& path);  // mkdir -p, new folders 0700; throws tdist::Error

// ---- trust: the cache loads only what this user wrote
enum class Trust { ok, missing, untrusted };
// ok when `st` belongs to this effective user and no other user can write it (no group/other
// write bit); else untrusted, with `why` naming the owner or the mode.
Trust trust_of(const struct ::stat& st, const std::string& path, std::string& why);
// The same for a path: `follow` follows a final symlink (the cache root may be one); without it
// a symlink is untrusted. missing when the path does not exist.
Trust trust_path(const std::string& path, bool follow, std::string& why);
// "ignoring <what>: <why>" as a stderr warning, once per `what` (a folder, or the entries of one
// folder); later calls with the same `what` stay silent.
void warn_untrusted_once(const std::string& what, const std::string& why);
// A fresh private folder under $TMPDIR (or /tmp); removed by remove_tree.
std::string make_temp_dir(const std::string& prefix);
void remove_tree(const std::string& path);
// Content digest of a file, memoised by (device, inode, size, mtime, ctime); false if unreadable.
bool file_digest(const std::string& path, Digest& out);

// ---- processes
struct ProcessResult {
  int exit_code = -1;  // -1: could not start; 128+N: killed by signal N
  std::string output;  // stdout and stderr together
};
// Runs argv[0] (searched on PATH when it has no '/') without a shell.
ProcessResult run_process(const std::vector<std::string>& argv);
// Finds an executable: next to nvcc, in CUDA's bin, then on PATH. "" if absent.
std::string find_tool(const std::string& name);

// ---- include scanning (include_scan.cpp)
struct ScannedInclude {
  std::string spelled;   // as written: "tdist/device.cuh", or "<computed: MACRO>"
  std::string resolved;  // absolute path; empty when not found on the search path
  Digest digest{};       // content digest when resolved
};
struct ScanResult {
  std::vector<ScannedInclude> headers;  // every header reached, in first-visit (DFS) order
  bool needs_nccl = false;              // includes nccl.h, nccl_device.h or nccl_device/...
  bool has_computed_include = false;
};
// Follows every #include of `source` transitively (ignoring #if: a superset of what the compiler
// reads). Quoted includes search the including file's folder first (`source_dir` for the source).
ScanResult scan_includes(const std::string& source, const std::string& source_dir,
                         const std::vector<std::string>& include_dirs);

// ---- cubin (ELF) helpers (cubin_elf.cpp)
// For nvcc: the symbol each `__tdist_name_expr_<i>` device variable was initialised with.
bool lowered_names_from_cubin(const std::string& cubin, std::size_t count, std::vector<std::string>& names,
                              std::string& error);
bool looks_like_elf(const std::string& bytes);

// ---- verbose log
void verbose(const std::string& line);  // to stderr when TDIST_JIT_VERBOSE is set

}  // namespace tdist::jit::detail

// ---- NVRTC, loaded on first use with dlopen (nvrtc.cpp)
#include <nvrtc.h>

namespace tdist::jit::detail {

struct NvrtcApi {
  decltype(&::nvrtcVersion) Version = nullptr;
  decltype(&::nvrtcGetErrorString) GetErrorString = nullptr;
  decltype(&::nvrtcCreateProgram) CreateProgram = nullptr;
  decltype(&::nvrtcDestroyProgram) DestroyProgram = nullptr;
  decltype(&::nvrtcCompileProgram) CompileProgram = nullptr;
  decltype(&::nvrtcAddNameExpression) AddNameExpression = nullptr;
  decltype(&::nvrtcGetLoweredName) GetLoweredName = nullptr;
  decltype(&::nvrtcGetProgramLogSize) GetProgramLogSize = nullptr;
  decltype(&::nvrtcGetProgramLog) GetProgramLog = nullptr;
  decltype(&::nvrtcGetCUBINSize) GetCUBINSize = nullptr;
  decltype(&::nvrtcGetCUBIN) GetCUBIN = nullptr;
  decltype(&::nvrtcGetPTXSize) GetPTXSize = nullptr;
  decltype(&::nvrtcGetPTX) GetPTX = nullptr;
  std::string path;  // the loaded library file
  int major = 0, minor = 0;
};
// Loads libnvrtc (TDIST_NVRTC_LIBRARY, the soname, CUDA's lib dirs); throws tdist::Error if absent.
const NvrtcApi& nvrtc();
// Path of libnvrtc if it can be loaded, else "" (never throws).
std::string nvrtc_library_path();

}  // namespace tdist::jit::detail
