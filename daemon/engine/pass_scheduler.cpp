#include "daemon/engine/pass_scheduler.h"

#include <latch>
#include <utility>

namespace trainstream::daemon {

void PassScheduler::Schedule(uint32_t bucket, int64_t priority, const std::function<bool(uint32_t)>& include,
                             BlockWork work, std::function<void()> done) {
  const auto blocks = BlocksOf(layout_, bucket, include);
  ScheduleBlocks(blocks, 0, blocks->size(), priority, std::move(work), std::move(done));
}

void PassScheduler::ScheduleBlocks(const std::shared_ptr<std::vector<Block>>& blocks, size_t begin, size_t end,
                                   int64_t priority, BlockWork work, std::function<void()> done) {
  WorkerPool::Home home = HomesOf(layout_, pool_.nodes(), blocks);
  if (home) home = [home = std::move(home), begin](size_t i) { return home(begin + i); };
  mailbox_.Begin();
  pool_.Submit(
      end - begin, [blocks, begin, work = std::move(work)](size_t i) { work(begin + i, (*blocks)[begin + i]); },
      [this, done = std::move(done)] { mailbox_.Continue(done); }, priority, home);
}

void PassScheduler::Touch(const BucketPasses& passes) {
  if (pool_.nodes() == 1) return;
  std::latch touched(static_cast<std::ptrdiff_t>(layout_.buckets.size()));
  for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
    auto blocks = BlocksOf(layout_, b, [](uint32_t) { return true; });
    pool_.Submit(
        blocks->size(), [passes = &passes, blocks](size_t i) { passes->Touch((*blocks)[i]); },
        [&touched] { touched.count_down(); }, /*priority=*/0, HomesOf(layout_, pool_.nodes(), blocks));
  }
  touched.wait();
}

}  // namespace trainstream::daemon
