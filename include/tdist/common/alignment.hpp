// Pointer alignment, as the ops' argument checks test it (TMA and vector loads need 16-byte bases,
// typed arrays their element size).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tdist {

inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace tdist
