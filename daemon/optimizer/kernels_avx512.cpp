// The AVX-512 variant (F, DQ, BW, VL; 16 lanes). Compiled with -mavx512f -mavx512dq -mavx512bw -mavx512vl
// on x86-64 only; chosen at run time only where the CPU (and OS) support it (adamw_kernels.cpp).
#include "daemon/optimizer/kernel_table.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "daemon/optimizer/simd_kernels-inl.h"
#include "daemon/optimizer/simd_ops_avx512.h"

namespace trainstream::optimizer {
const KernelTable* Avx512Kernels() {
  return &SimdKernelTable<Avx512Ops>("avx512");
}
}  // namespace trainstream::optimizer
#else
namespace trainstream::optimizer {
const KernelTable* Avx512Kernels() {
  return nullptr;
}
}  // namespace trainstream::optimizer
#endif
