// Element types of the tensors tdist's ops take, shared by every layer (runtime, ops, bindings).
#pragma once

#include <cstddef>
#include <string>

namespace tdist {

enum class DType { kFloat32, kFloat16, kBFloat16 };

size_t dtype_size(DType dtype);
// "f32", "f16", "bf16".
const char* to_string(DType dtype);
// "f32"/"fp32"/"float32"/"float", "f16"/"fp16"/"float16"/"half", "bf16"/"bfloat16"; throws tdist::Error
// naming `what` otherwise.
DType parse_dtype(const std::string& s, const char* what = "dtype");
// C++ type spelled for the kernels' template instances ("float", "__half", "__nv_bfloat16").
const char* kernel_type_name(DType dtype);

}  // namespace tdist
