// Registry of the library's own JIT kernels, so that `tdist-compile --all` can fill a cache for
// a GPU architecture ahead of time. A kernel family registers a function that lists the
// requests it will compile at run time (one per specialisation worth shipping):
//
//   TDIST_JIT_REGISTER_KERNELS(ag_gemm, [] {
//     std::vector<tdist::jit::CompileRequest> v;  ... one per tile config ...
//     return v;
//   });
//
// Requests leave `arch` empty; tdist-compile sets it.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tdist/jit/compiler.hpp"

namespace tdist::jit {

struct RegisteredKernels {
  std::string name;
  std::function<std::vector<CompileRequest>()> requests;
};

// Adds a family; returns true so it can initialise a static. Names must be unique.
bool register_kernels(std::string name, std::function<std::vector<CompileRequest>()> requests);
// All families, sorted by name.
std::vector<RegisteredKernels> registered_kernels();

}  // namespace tdist::jit

#define TDIST_JIT_REGISTER_KERNELS(ident, ...) \
  [[maybe_unused]] static const bool tdist_jit_registered_##ident = ::tdist::jit::register_kernels(#ident, __VA_ARGS__)
