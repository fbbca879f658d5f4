// Manifest of kernels to compile ahead of time (tdist-compile). Text, one section per kernel:
//
//   # comment
//   [kernel]
//   source = kernels/my_kernel.cu        # relative to the manifest's folder
//   name = my_kernel<128, __nv_bfloat16> # repeatable: name expressions
//   define = USE_FAST=1                  # repeatable: -D
//   const = int kBlockM = 128            # repeatable: `static constexpr int kBlockM = 128;`
//   flag = -maxrregcount=128             # repeatable
//   include = third_party/include        # repeatable, relative to the manifest's folder
//   compiler = nvrtc                     # nvrtc | nvcc | auto (default)
//
// Keys and values are trimmed; a value runs to the end of the line ('#' starts a comment only
// at the beginning of a line, since name expressions may contain it).
#pragma once

#include <string>
#include <vector>

#include "tdist/jit/compiler.hpp"

namespace tdist::jit {

// Parses manifest text; `base_dir` resolves relative paths. Reads each source file. Throws
// tdist::Error naming the manifest line on a malformed entry.
std::vector<CompileRequest> parse_manifest(const std::string& text, const std::string& base_dir,
                                           const std::string& manifest_name = "manifest");
std::vector<CompileRequest> load_manifest(const std::string& path);

}  // namespace tdist::jit
