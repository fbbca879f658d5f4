#include "tdist/common/dtype.hpp"

#include <algorithm>
#include <cctype>

#include "tdist/common/error.hpp"

namespace tdist {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
  }
  TDIST_FAIL("invalid argument 'dtype': ", static_cast<int>(dtype), " is not a DType (float32, float16, bfloat16, float8_e4m3)");
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
  }
  return "invalid";
}

DType parse_dtype(const std::string& text, const char* what) {
  std::string s = text;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (s == "f32" || s == "fp32" || s == "float32" || s == "float") return DType::kFloat32;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return DType::kFloat16;
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  if (s == "e4m3" || s == "fp8_e4m3" || s == "float8_e4m3fn") return DType::kFloat8E4M3;
  TDIST_FAIL("invalid argument '", what, "': '", text, "' (expected bf16, f16, f32 or e4m3)");
}

const char* kernel_type_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float";
    case DType::kFloat16: return "__half";
    case DType::kBFloat16: return "__nv_bfloat16";
    case DType::kFloat8E4M3: return "__nv_fp8_e4m3";
  }
  TDIST_FAIL("invalid argument 'dtype': ", static_cast<int>(dtype), " is not a DType (float32, float16, bfloat16, float8_e4m3)");
}

}  // namespace tdist
