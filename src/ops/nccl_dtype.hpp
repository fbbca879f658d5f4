// NCCL's name for a collective element type (the ops that fall back to or compare with NCCL).
#pragma once

#include <nccl.h>

#include "tdist/ops/detail/collective_select.hpp"

namespace tdist::detail {

inline ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat8E4M3: break;  // not a collective type: check_dtype names it
  }
  check_dtype(t);
  return ncclFloat32;
}

}  // namespace tdist::detail
