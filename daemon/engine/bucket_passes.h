// The element passes the step engine runs over a bucket, one block of a parameter at a time on the
// worker pool: sum the ranks' gradient slots into the accumulator, the gradients' sum of squares (for
// clipping), the fused AdamW update from one half of the state into the other (shm/job_layout.h; the
// same half with one), the carry of a parameter without a gradient into the other half, the upload copy
// of master weights, and the first touch of a new job's state. The engine decides which blocks run when
// (daemon/engine/step_protocol.h); this file says what one block does to the job's memory.
//
// Invariants: a pass reads and writes only the elements of its block, so the blocks of one pass run
// concurrently on any threads; a rank contributes a block's gradients only where its presence flag
// for the parameter is set (it had a gradient in this micro-batch).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "daemon/engine/rank_channel.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

// Elements [begin, begin + count) of one parameter: the unit of work the engine hands the pool.
struct Block {
  uint32_t param;
  uint64_t begin;
  uint64_t count;
};

// The ranks whose gradient slots a pass reads, indexed by rank (nullptr: not attached). Worker tasks
// hold the channels, so a rank that detaches keeps its mapping until they have finished.
using Sources = std::vector<std::shared_ptr<RankChannel>>;

// The passes over one job's memory: its state segment (master weights, moments, upload staging) and,
// given per call, its ranks' gradient slots and the accumulator.
class BucketPasses {
 public:
  BucketPasses(const shm::JobLayout& layout, const shm::StateView& state, DType moment_dtype)
      : layout_(layout), state_(state), moment_dtype_(moment_dtype) {}

  // `accum` is the job's fp32 accumulator (its element 0): the earlier micro-batches of the step, summed;
  // nullptr where the block's bucket has none in this step.
  // accum = (overwrite ? 0 : accum) + the sum of the sources' slots. Without a slot to add and
  // without `overwrite` the accumulator is left as it is.
  void Accumulate(const Block& block, const Sources& sources, float* accum, bool overwrite) const;
  // sum(g^2) of g = scale * (accum + the sources' slots); sets *nonfinite if any g is inf or NaN.
  double SumOfSquares(const Block& block, const Sources& sources, const float* accum, float scale,
                      bool* nonfinite) const;
  // AdamW (or Adam) from the master weights and moments in `from` to those in `to` (in place when they
  // are the same half), from g = scale * (accum + the sources' slots), and the new weights of 16-bit
  // buckets into the upload region. Returns whether the new master weights hold inf or NaN.
  bool Update(const Block& block, const Sources& sources, const float* accum, float scale,
              const optimizer::AdamWStep& step, uint64_t sr_seed, const shm::StateHalf& from,
              const shm::StateHalf& to) const;
  // Update, and SumOfSquares of the same g (scale included) into *sum_of_squares, from the update's own
  // reads (speculative clipping: optimizer::AdamWUpdateWithNorm says why).
  bool UpdateWithNorm(const Block& block, const Sources& sources, const float* accum, float scale,
                      const optimizer::AdamWStep& step, uint64_t sr_seed, const shm::StateHalf& from,
                      const shm::StateHalf& to, double* sum_of_squares, bool* nonfinite) const;
  // The master weights and moments from `from` into `to`, unchanged: a parameter without a gradient in
  // a step keeps its state in the half that step commits.
  void Carry(const Block& block, const shm::StateHalf& from, const shm::StateHalf& to) const;
  // The master weights of `half` (loaded by a client, committed, or rolled back to) into the upload
  // region, rounded to the bucket's dtype; nothing for fp32 buckets, whose clients read the master
  // weights in place.
  void UploadMaster(const Block& block, const shm::StateHalf& half) const;
  // Zeroes every state region of the block, in both halves: the first touch, which places its pages on
  // the NUMA node of the thread that runs it.
  void Touch(const Block& block) const;

 private:
  [[nodiscard]] const shm::BucketLayout& BucketOf(const Block& block) const;
  [[nodiscard]] uint64_t Element(const Block& block) const;  // in master, moments and accumulator
  [[nodiscard]] uint64_t ByteInBucket(const Block& block) const;
  [[nodiscard]] optimizer::Upload Upload(const Block& block) const;
  [[nodiscard]] std::byte* Moment(void* region, const Block& block) const;

  const shm::JobLayout& layout_;
  const shm::StateView& state_;
  const DType moment_dtype_;
};

}  // namespace trainstream::daemon
