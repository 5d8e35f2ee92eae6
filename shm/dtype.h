// Element types that cross the client/daemon boundary, and their sizes.
// The numeric values are part of the wire and segment format: never renumber.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace trainstream {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr size_t SizeOf(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

constexpr std::string_view NameOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

constexpr bool IsValidDType(uint32_t raw) {
  return raw <= static_cast<uint32_t>(DType::kFloat16);
}

}  // namespace trainstream
