// How an op's source file adds its OverlapOpTraits to the catalogue (overlap_ops()):
//
//   const OverlapOpTraits& my_op_traits() { static const OverlapOpTraits t{...}; return t; }
//   TDIST_REGISTER_OVERLAP_OP(my_op, my_op_traits);
//
// The entry is added when libtdist is loaded (a static object of the op's file); a second entry
// of the same name is a programming error and aborts the load with a message.
#pragma once

#include "tdist/ops/overlap_ops.hpp"

namespace tdist::detail {

struct OverlapOpRegistrar {
  explicit OverlapOpRegistrar(const OverlapOpTraits& (*traits)());
};

}  // namespace tdist::detail

#define TDIST_REGISTER_OVERLAP_OP(id, traits_fn) \
  static const ::tdist::detail::OverlapOpRegistrar tdist_overlap_op_registrar_##id { &traits_fn }
