// The work of a pass over one bucket, block by block: how a bucket is cut into blocks (the unit the
// pool runs), on which NUMA node each block runs, and what one block of each pass does with the
// bucket's memory (daemon/engine/bucket_passes.h) and where it puts its result. The engine decides
// which pass runs when and hands the work to the pool; a block's work runs on any worker thread.
//
// Invariants: a pass's per-block results go into slots of their own (PassResults::partial, indexed by
// block) and are summed in block order (Total), so the result does not depend on which thread ran which
// block when; a block's home depends only on where its elements lie, so every pass runs it on the same
// node, whichever parameters the pass includes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "daemon/engine/bucket_passes.h"
#include "daemon/engine/bucket_update.h"
#include "daemon/engine/step_trace.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

using BlockWork = std::function<void(size_t, const Block&)>;

// What the blocks of a pass found: per-block sums of squares, and whether any gradients (norm) or new
// weights (update) were inf or NaN.
struct PassResults {
  explicit PassResults(size_t blocks) : partial(blocks, 0.0) {}
  std::vector<double> partial;
  std::atomic<bool> nonfinite{false};       // the norm's gradients, or the update's new weights
  std::atomic<bool> norm_nonfinite{false};  // the gradients an update summed the squares of
};

// The blocks of `bucket`'s parameters that `include` selects, of at most kBlockElements elements each.
[[nodiscard]] std::shared_ptr<std::vector<Block>> BlocksOf(const shm::JobLayout& layout, uint32_t bucket,
                                                           const std::function<bool(uint32_t)>& include);
// With several NUMA nodes, each bucket is split into equal element ranges, one per node (`nodes` 1: no
// homes).
[[nodiscard]] WorkerPool::Home HomesOf(const shm::JobLayout& layout, uint32_t nodes,
                                       std::shared_ptr<std::vector<Block>> blocks);
// The sum of per-block partial sums, in block order: deterministic whatever order the blocks ran in.
[[nodiscard]] double Total(const std::vector<double>& partial);
// `work`, recording each block's span of `kind` over bucket's `step` when `trace` is set.
[[nodiscard]] BlockWork Traced(StepTrace* trace, SpanKind kind, uint32_t bucket, uint64_t step, BlockWork work);

// The passes, over `passes`. `sources`: the ranks whose slots are read; `accum`: the accumulator of the
// step (nullptr: none); `scale`: of the summed gradients.
[[nodiscard]] BlockWork AccumulateWork(const BucketPasses* passes, float* accum, bool overwrite, Sources sources);
[[nodiscard]] BlockWork NormWork(const BucketPasses* passes, float scale, const float* accum, Sources sources,
                                 std::shared_ptr<PassResults> results);
// The update `plan` describes, summing the squares of what it reads into `results` where it has a slot
// per block (UpdatePlan::with_norm).
[[nodiscard]] BlockWork UpdateWork(const BucketPasses* passes, float scale, uint64_t sr_seed,
                                   std::shared_ptr<const UpdatePlan> plan, const shm::StateHalf* from,
                                   const shm::StateHalf* to, const float* accum, Sources sources,
                                   std::shared_ptr<PassResults> results);
[[nodiscard]] BlockWork UploadWork(const BucketPasses* passes, const shm::StateHalf* half);

}  // namespace trainstream::daemon
