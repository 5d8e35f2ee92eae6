// The table of kernel implementations behind adamw_kernels.h, one per instruction set, and the choice
// among them. The choice is made once, on first use: the best variant this CPU supports, or the one
// named by the environment variable TRAINSTREAM_KERNEL (portable|avx2|avx512|avx512bf16; "scalar" is an alias of
// portable). Tests and benchmarks use the tables directly to run every supported variant side by side.
#pragma once

#include <string_view>
#include <vector>

#include "daemon/optimizer/adamw_kernels.h"

namespace trainstream::optimizer {

struct KernelTable {
  const char* name;
  bool (*update)(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                 const MomentBuffers& moments, const Upload& upload, size_t n);
  double (*sum_of_squares)(const GradSources& grads, size_t n, bool* nonfinite);
  bool (*update_with_norm)(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                           const MomentBuffers& moments, const Upload& upload, size_t n, double* sum_of_squares,
                           bool* nonfinite);
  void (*accumulate)(const GradSources& grads, float* accum, bool overwrite, size_t n);
  void (*convert_master)(const float* master, const Upload& upload, size_t n);
};

// Each variant; nullptr where it is not compiled into this build (e.g. AVX on ARM).
const KernelTable& PortableKernels();
const KernelTable* Avx2Kernels();
const KernelTable* Avx512Kernels();
const KernelTable* Avx512Bf16Kernels();  // AVX-512 + avx512_bf16

// The variants this build has and this CPU can run, best first (portable is always last).
std::vector<const KernelTable*> SupportedKernels();

// A supported variant by name; throws trainstream::Error (kFailedPrecondition) if unknown or unsupported.
const KernelTable& KernelByName(std::string_view name);

// The variant the public functions use (chosen once; see the header comment).
const KernelTable& ActiveKernels();

}  // namespace trainstream::optimizer
