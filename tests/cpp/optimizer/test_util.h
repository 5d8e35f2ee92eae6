// Helpers for the optimizer kernel tests: buffers of any dtype at a chosen misalignment, deterministic
// random contents, and the list of kernel variants this CPU runs (for parameterized tests).
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "daemon/optimizer/float_convert.h"
#include "daemon/optimizer/kernel_table.h"
#include "shm/dtype.h"

namespace trainstream::optimizer::testing {

// n elements of dtype starting `misalign` elements past a 64-byte boundary.
class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, size_t n, size_t misalign) : dtype_(dtype), n_(n) {
    storage_.assign(n * SizeOf(dtype) + 128 + misalign * SizeOf(dtype), 0);
    const auto base = reinterpret_cast<uintptr_t>(storage_.data());
    offset_ = (64 - base % 64) % 64 + misalign * SizeOf(dtype);
  }
  void* data() { return storage_.data() + offset_; }
  [[nodiscard]] const void* data() const { return storage_.data() + offset_; }
  float* f32() { return static_cast<float*>(data()); }
  [[nodiscard]] size_t bytes() const { return n_ * SizeOf(dtype_); }
  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] size_t size() const { return n_; }
  [[nodiscard]] float Get(size_t i) const {
    switch (dtype_) {
      case DType::kFloat32: return static_cast<const float*>(data())[i];
      case DType::kBFloat16: return BF16ToFloat(static_cast<const uint16_t*>(data())[i]);
      case DType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(data())[i]);
    }
    return 0;
  }
  void Set(size_t i, float value) {
    switch (dtype_) {
      case DType::kFloat32: static_cast<float*>(data())[i] = value; break;
      case DType::kBFloat16: static_cast<uint16_t*>(data())[i] = FloatToBF16(value); break;
      case DType::kFloat16: static_cast<uint16_t*>(data())[i] = FloatToHalf(value); break;
    }
  }
  // Same dtype, size and contents, at another misalignment.
  [[nodiscard]] Buffer CopyAt(size_t misalign) const {
    Buffer copy(dtype_, n_, misalign);
    if (n_ != 0) std::memcpy(copy.data(), data(), bytes());
    return copy;
  }
  [[nodiscard]] bool SameBytes(const Buffer& other) const {
    return bytes() == other.bytes() && (n_ == 0 || std::memcmp(data(), other.data(), bytes()) == 0);
  }

 private:
  DType dtype_ = DType::kFloat32;
  size_t n_ = 0, offset_ = 0;
  std::vector<uint8_t> storage_;
};

inline void FillUniform(Buffer& buffer, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  for (size_t i = 0; i < buffer.size(); ++i) buffer.Set(i, dist(rng));
}

// The kernel's update in place: it reads the state where it writes it (StateIn::InPlace).
inline bool UpdateInPlace(const KernelTable& kernel, const GradSources& grads, const AdamWStep& step, float* master,
                          const MomentBuffers& moments, const Upload& upload, size_t n) {
  return kernel.update(grads, step, StateIn::InPlace(master, moments), master, moments, upload, n);
}

// Names of the variants this CPU runs, best first ("avx512", "avx2", "portable").
inline std::vector<std::string> SupportedKernelNames() {
  std::vector<std::string> names;
  for (const KernelTable* kernel : SupportedKernels()) names.emplace_back(kernel->name);
  return names;
}

}  // namespace trainstream::optimizer::testing
