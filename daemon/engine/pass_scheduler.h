// Hands a pass's blocks (pass_work.h) to the worker pool, each on its NUMA home, and its end back to
// the engine thread through the mailbox. The engine says which pass runs when; this says where.
//
// Invariants: every pass it submits ends with one `done` on the engine thread (EngineMailbox's
// Begin/Continue pair), however many blocks it had; `done` runs after the last block has finished.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "daemon/engine/bucket_passes.h"
#include "daemon/engine/engine_mailbox.h"
#include "daemon/engine/pass_work.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

class PassScheduler {
 public:
  PassScheduler(const shm::JobLayout& layout, WorkerPool& pool, EngineMailbox& mailbox)
      : layout_(layout), pool_(pool), mailbox_(mailbox) {}

  // Runs `work` on the pool for every block of `bucket`'s params selected by `include`; `done` runs on
  // the engine thread afterwards.
  void Schedule(uint32_t bucket, int64_t priority, const std::function<bool(uint32_t)>& include, BlockWork work,
                std::function<void()> done);
  // Runs `work(i, blocks[i])` on the pool for i in [begin, end); `done` runs on the engine thread afterwards.
  void ScheduleBlocks(const std::shared_ptr<std::vector<Block>>& blocks, size_t begin, size_t end, int64_t priority,
                      BlockWork work, std::function<void()> done);
  // Faults every block of the state in from the node that will update it, and waits for it (with one
  // NUMA node: returns at once).
  void Touch(const BucketPasses& passes);

 private:
  const shm::JobLayout& layout_;
  WorkerPool& pool_;
  EngineMailbox& mailbox_;
};

}  // namespace trainstream::daemon
