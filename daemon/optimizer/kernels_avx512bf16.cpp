// The AVX-512 variant plus avx512_bf16 (VCVTNE2PS2BF16 for the bf16 upload; see Avx512Bf16Ops). Compiled
// with the AVX-512 flags and -mavx512bf16 on x86-64 only; chosen at run time only where the CPU has
// avx512_bf16 too (adamw_kernels.cpp). Bit-identical to every other variant.
#include "daemon/optimizer/kernel_table.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#include "daemon/optimizer/simd_kernels-inl.h"
#include "daemon/optimizer/simd_ops_avx512.h"

namespace trainstream::optimizer {
const KernelTable* Avx512Bf16Kernels() {
  return &SimdKernelTable<Avx512Bf16Ops>("avx512bf16");
}
}  // namespace trainstream::optimizer
#else
namespace trainstream::optimizer {
const KernelTable* Avx512Bf16Kernels() {
  return nullptr;
}
}  // namespace trainstream::optimizer
#endif
