// The public entry points of adamw_kernels.h: the step scalars, and forwarding to the kernel variant
// chosen once for this CPU (kernel_table.h). The variants themselves live in kernels_*.cpp.
#include "daemon/optimizer/adamw_kernels.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "daemon/optimizer/kernel_table.h"
#include "shm/error.h"

namespace trainstream::optimizer {

AdamWStep AdamWStep::For(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                         uint64_t step) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return AdamWStep{
      .lr = static_cast<float>(lr),
      .beta1 = static_cast<float>(beta1),
      .beta2 = static_cast<float>(beta2),
      .eps = static_cast<float>(eps),
      .weight_decay = static_cast<float>(weight_decay),
      .decoupled = decoupled,
      .step_size = static_cast<float>(lr / bias_correction1),
      .bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2)),
      .one_minus_beta1 = static_cast<float>(1.0 - beta1),
      .one_minus_beta2 = static_cast<float>(1.0 - beta2),
      .decay = static_cast<float>(1.0 - lr * weight_decay),
  };
}

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

namespace {
bool CpuHasF16c() {  // CPUID.1:ECX.F16C[bit 29]; not every compiler's __builtin_cpu_supports knows "f16c"
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && CpuHasF16c();
}
bool CpuHasAvx512() {
  __builtin_cpu_init();
  // libgcc also checks that the OS saves the AVX-512 state (XGETBV).
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
bool CpuHasAvx512Bf16() {
  __builtin_cpu_init();
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
}
}  // namespace
#endif

std::vector<const KernelTable*> SupportedKernels() {
  std::vector<const KernelTable*> kernels;
#if defined(__x86_64__) || defined(__i386__)
  if (Avx512Bf16Kernels() != nullptr && CpuHasAvx512Bf16()) kernels.push_back(Avx512Bf16Kernels());
  if (Avx512Kernels() != nullptr && CpuHasAvx512()) kernels.push_back(Avx512Kernels());
  if (Avx2Kernels() != nullptr && CpuHasAvx2()) kernels.push_back(Avx2Kernels());
#endif
  kernels.push_back(&PortableKernels());
  return kernels;
}

const KernelTable& KernelByName(std::string_view name) {
  if (name == "scalar") name = "portable";
  for (const KernelTable* kernel : SupportedKernels()) {
    if (name == kernel->name) return *kernel;
  }
  std::string supported;
  for (const KernelTable* kernel : SupportedKernels())
    supported += std::string(supported.empty() ? "" : ", ") + kernel->name;
  Throw(Code::kFailedPrecondition, "optimizer kernel '{}' is unknown or not supported by this CPU (supported: {})",
        name, supported);
}

const KernelTable& ActiveKernels() {
  static const KernelTable& active = [&]() -> const KernelTable& {
    const char* forced = std::getenv("TRAINSTREAM_KERNEL");
    if (forced != nullptr && *forced != '\0') return KernelByName(forced);
    return *SupportedKernels().front();
  }();
  return active;
}

bool AdamWUpdate(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                 const MomentBuffers& moments, const Upload& upload, size_t n) {
  return ActiveKernels().update(grads, step, in, master, moments, upload, n);
}

double SumOfSquares(const GradSources& grads, size_t n, bool* nonfinite) {
  return ActiveKernels().sum_of_squares(grads, n, nonfinite);
}

bool AdamWUpdateWithNorm(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                         const MomentBuffers& moments, const Upload& upload, size_t n, double* sum_of_squares,
                         bool* nonfinite) {
  return ActiveKernels().update_with_norm(grads, step, in, master, moments, upload, n, sum_of_squares, nonfinite);
}

void Accumulate(const GradSources& grads, float* accum, bool overwrite, size_t n) {
  ActiveKernels().accumulate(grads, accum, overwrite, n);
}

void ConvertMaster(const float* master, const Upload& upload, size_t n) {
  ActiveKernels().convert_master(master, upload, n);
}

const char* ActiveKernelName() {
  return ActiveKernels().name;
}

}  // namespace trainstream::optimizer
