// Element types of the tensors tdist's ops take, shared by every layer (runtime, ops, bindings).
#pragma once

#include <cstddef>
#include <string>

namespace tdist {

// kFloat8E4M3 (OCP e4m3, torch.float8_e4m3fn) is an operand type of the FP8 GEMM only.
enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3 };

size_t dtype_size(DType dtype);
// "f32", "f16", "bf16", "e4m3".
const char* to_string(DType dtype);
// "f32"/"fp32"/"float32"/"float", "f16"/"fp16"/"float16"/"half", "bf16"/"bfloat16",
// "e4m3"/"fp8_e4m3"/"float8_e4m3fn"; throws tdist::Error naming `what` otherwise.
DType parse_dtype(const std::string& s, const char* what = "dtype");
// C++ type spelled for the kernels' template instances ("float", "__half", "__nv_bfloat16", "__nv_fp8_e4m3").
const char* kernel_type_name(DType dtype);

}  // namespace tdist
