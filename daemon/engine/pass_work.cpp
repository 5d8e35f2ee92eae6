#include "daemon/engine/pass_work.h"

#include <algorithm>
#include <utility>

namespace trainstream::daemon {

namespace {
constexpr uint64_t kBlockElements = 1 << 16;  // elements of one Block (the unit of work on the pool)
}  // namespace

std::shared_ptr<std::vector<Block>> BlocksOf(const shm::JobLayout& layout, uint32_t bucket,
                                             const std::function<bool(uint32_t)>& include) {
  auto blocks = std::make_shared<std::vector<Block>>();
  for (uint32_t p : layout.buckets[bucket].params) {
    if (!include(p)) continue;
    const uint64_t numel = layout.params[p].numel;
    for (uint64_t begin = 0; begin < numel; begin += kBlockElements) {
      blocks->push_back(Block{p, begin, std::min(kBlockElements, numel - begin)});
    }
  }
  return blocks;
}

WorkerPool::Home HomesOf(const shm::JobLayout& layout, uint32_t nodes, std::shared_ptr<std::vector<Block>> blocks) {
  if (nodes == 1) return {};
  return [&layout, blocks = std::move(blocks), nodes](size_t i) {
    const Block& block = (*blocks)[i];
    const shm::ParamLayout& p = layout.params[block.param];
    const uint64_t numel = std::max<uint64_t>(layout.buckets[p.bucket].numel, 1);
    return static_cast<uint32_t>((p.offset_in_bucket + block.begin) * nodes / numel);
  };
}

double Total(const std::vector<double>& partial) {
  double sum = 0;
  for (const double value : partial) sum += value;
  return sum;
}

BlockWork Traced(StepTrace* trace, SpanKind kind, uint32_t bucket, uint64_t step, BlockWork work) {
  if (trace == nullptr) return work;
  return [trace, kind, bucket, step, work = std::move(work)](size_t i, const Block& block) {
    const int64_t began = StepTrace::Now();
    work(i, block);
    trace->Record({kind, bucket, step, StepTrace::ThreadId(), began, StepTrace::Now()});
  };
}

BlockWork AccumulateWork(const BucketPasses* passes, float* accum, bool overwrite, Sources sources) {
  return [passes, accum, overwrite, sources = std::move(sources)](size_t, const Block& block) {
    passes->Accumulate(block, sources, accum, overwrite);
  };
}

BlockWork NormWork(const BucketPasses* passes, float scale, const float* accum, Sources sources,
                   std::shared_ptr<PassResults> results) {
  return
      [passes, scale, accum, sources = std::move(sources), results = std::move(results)](size_t i, const Block& block) {
        bool bad = false;
        results->partial[i] = passes->SumOfSquares(block, sources, accum, scale, &bad);
        if (bad) results->nonfinite.store(true);
      };
}

BlockWork UpdateWork(const BucketPasses* passes, float scale, uint64_t sr_seed, std::shared_ptr<const UpdatePlan> plan,
                     const shm::StateHalf* from, const shm::StateHalf* to, const float* accum, Sources sources,
                     std::shared_ptr<PassResults> results) {
  return [passes, scale, sr_seed, plan = std::move(plan), from, to, accum, sources = std::move(sources),
          results = std::move(results)](size_t i, const Block& block) {
    if (plan->updated[block.param] == 0) return passes->Carry(block, *from, *to);
    bool bad_weights = false;
    if (results->partial.empty()) {
      bad_weights = passes->Update(block, sources, accum, scale, plan->scalars[block.param], sr_seed, *from, *to);
    } else {  // the norm of the update's own g (scale included)
      bool bad_gradients = false;
      bad_weights = passes->UpdateWithNorm(block, sources, accum, scale, plan->scalars[block.param], sr_seed, *from,
                                           *to, &results->partial[i], &bad_gradients);
      if (bad_gradients) results->norm_nonfinite.store(true);
    }
    if (bad_weights) results->nonfinite.store(true);
  };
}

BlockWork UploadWork(const BucketPasses* passes, const shm::StateHalf* half) {
  return [passes, half](size_t, const Block& block) { passes->UploadMaster(block, *half); };
}

}  // namespace trainstream::daemon
