// tdist::jit: run-time compilation (NVRTC / nvcc), two-level cache, launch and autotuning.
// See docs/jit.md.
#pragma once

#include "tdist/jit/autotune.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/hash.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/manifest.hpp"
#include "tdist/jit/paths.hpp"
#include "tdist/jit/registry.hpp"
