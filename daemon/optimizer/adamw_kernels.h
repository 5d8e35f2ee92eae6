// The optimizer kernels: one fused pass over a range of one parameter that sums the ranks' gradients,
// scales them, applies Adam/AdamW to the fp32 master weights and moments, and writes the new weights in
// the GPU's dtype into upload staging. The update reads the state where StateIn says and writes it where
// it is told: the same memory (in place) or the other half of a double-buffered state (out of place). Plus the cheap
// passes around it: squared norm (for clipping), accumulation (for gradient accumulation) and master -> upload
// conversion.
//
// Semantics are torch.optim.AdamW / Adam (foreach=False), element by element:
//   g  = scale * (accum + sum_r grad_r)            (fp32)
//   AdamW: p *= 1 - lr*wd          Adam: g += wd*p
// (every scalar computed in double and rounded to fp32 once, as torch applies Python floats)
//   m  = lerp(m, g, 1-beta1);  v = beta2*v + (1-beta2)*g*g
//   p -= step_size * m / (sqrt(v)/bias_correction2_sqrt + eps)
// with step_size and bias_correction2_sqrt computed in double per parameter (AdamWStep::For).
// bf16 moments are stored with stochastic rounding driven by a counter-based hash of
// (seed, element index): the same job, step and element always round the same way.
//
// Every function handles any n (tails) and any alignment. The implementation is chosen once at
// start-up for the CPU (see ActiveKernelName).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "shm/dtype.h"

namespace trainstream::optimizer {

struct GradSources {
  std::span<const void* const> slots;  // one pointer per rank that has this gradient, at the range start
  DType dtype = DType::kFloat32;       // of every slot
  const float* accum = nullptr;        // optional fp32 accumulator at the range start, added first
  float scale = 1.0f;                  // multiplies the sum (1/ranks, clip coefficient)
};

struct AdamWStep {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = true;            // AdamW (true) or Adam with L2 weight decay (false)
  float step_size = 0;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt = 0;  // sqrt(1 - beta2^step)
  // Computed in double and rounded once, as torch does with its Python-float scalars: 1 - float(0.999)
  // would be 1.3e-5 off 0.001 and bias every exp_avg_sq. Construct with For(), which sets them.
  float one_minus_beta1 = 0;  // the lerp weight
  float one_minus_beta2 = 0;
  float decay = 1;  // AdamW: 1 - lr * weight_decay

  // Scalars for a parameter's `step`-th update (step >= 1), computed as torch does, in double.
  static AdamWStep For(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                       uint64_t step);
};

struct MomentBuffers {
  void* exp_avg = nullptr;  // at the range start
  void* exp_avg_sq = nullptr;
  DType dtype = DType::kFloat32;  // kFloat32 or kBFloat16
  uint64_t sr_seed = 0;           // stochastic rounding: seed for this job and step
  uint64_t element_base = 0;      // global index of the range's first element, so rounding is per element
};

struct Upload {
  void* data = nullptr;  // at the range start; nullptr: no upload copy
  DType dtype = DType::kFloat32;
};

// Where an update reads the state of its range (each pointer at the range start). It writes the new
// state to the master weights and MomentBuffers it is given: in place when this names that same memory,
// out of place when it names the committed half of a double-buffered state and they the other half.
// Out of place, the main loop writes the new state with non-temporal stores: ordinary stores would first
// read the other half's cache lines (12 bytes per element more with fp32 moments), where in place the
// lines are in cache from the loads.
struct StateIn {
  const float* master = nullptr;
  const void* exp_avg = nullptr;
  const void* exp_avg_sq = nullptr;
  static StateIn InPlace(const float* master, const MomentBuffers& moments) {
    return {master, moments.exp_avg, moments.exp_avg_sq};
  }
};

// The fused update of n elements. Returns whether any new master weight is inf or NaN: a non-finite
// gradient always leaves one (inf / inf in the update), so this detects it in the update pass, in
// registers, without reading the gradients or the weights again.
bool AdamWUpdate(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                 const MomentBuffers& moments, const Upload& upload, size_t n);

// sum(g^2) of g = scale * (accum + sum_r grad_r), in double; sets *nonfinite if any g is inf/NaN.
double SumOfSquares(const GradSources& grads, size_t n, bool* nonfinite);

// AdamWUpdate, and the SumOfSquares of the gradients it read (*sum_of_squares, *nonfinite as SumOfSquares
// sets it), equal to SumOfSquares's bit for bit. Speculative clipping needs both; a norm pass of its own
// before each 64Ki-element block's update made the update 1.18-1.54x slower on the dev box, the fused sum
// 1.04-1.25x (benchmarks/adamw, "norm first" / "norm fused"): arithmetic on gradients already in registers.
bool AdamWUpdateWithNorm(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                         const MomentBuffers& moments, const Upload& upload, size_t n, double* sum_of_squares,
                         bool* nonfinite);

// accum = (overwrite ? 0 : accum) + scale * sum_r grad_r   (accum's own value is not scaled)
void Accumulate(const GradSources& grads, float* accum, bool overwrite, size_t n);

// upload = master rounded to nearest even in the upload dtype.
void ConvertMaster(const float* master, const Upload& upload, size_t n);

// Which implementation runs on this CPU ("scalar", "avx2", "avx512", ...), for logs and benchmarks.
const char* ActiveKernelName();

}  // namespace trainstream::optimizer
