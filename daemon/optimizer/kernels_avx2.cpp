// The AVX2 variant (with F16C; 8 lanes). Compiled with -mavx2 -mf16c on x86-64 only; chosen at run time
// only where the CPU supports it (adamw_kernels.cpp).
#include "daemon/optimizer/kernel_table.h"

#if defined(__AVX2__) && defined(__F16C__)
#include "daemon/optimizer/simd_kernels-inl.h"
#include "daemon/optimizer/simd_ops_avx2.h"

namespace trainstream::optimizer {
const KernelTable* Avx2Kernels() {
  return &SimdKernelTable<Avx2Ops>("avx2");
}
}  // namespace trainstream::optimizer
#else
namespace trainstream::optimizer {
const KernelTable* Avx2Kernels() {
  return nullptr;
}
}  // namespace trainstream::optimizer
#endif
