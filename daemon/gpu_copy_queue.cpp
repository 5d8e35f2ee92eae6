#include "daemon/gpu_copy_queue.h"

#include <spdlog/spdlog.h>

#include "shm/error.h"

namespace trainstream::daemon {

CopyQueue::CopyQueue(const cuda::CudaDriver& driver, cuda::CUcontext context, std::string name)
    : driver_(driver), context_(context), name_(std::move(name)) {
  cuda::ScopedContext scope(driver_, context_);
  driver_.Check(driver_.cuStreamCreate(&stream_, cuda::kStreamNonBlocking), "cuStreamCreate");
  for (size_t i = 0; i < kWindow; ++i) {
    cuda::CUevent event = nullptr;
    // Blocking sync: the queue thread sleeps on a copy instead of spinning a core the update needs.
    driver_.Check(driver_.cuEventCreate(&event, cuda::kEventBlockingSync | cuda::kEventDisableTiming),
                  "cuEventCreate");
    idle_events_.push_back(event);
  }
  thread_ = std::thread([this] { Loop(); });
}

CopyQueue::~CopyQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
  cuda::ScopedContext scope(driver_, context_);
  for (cuda::CUevent event : idle_events_) driver_.cuEventDestroy(event);
  driver_.cuStreamDestroy(stream_);
}

void CopyQueue::Submit(Issue issue, Done done) {
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(Item{std::move(issue), std::move(done)});
  }
  wake_.notify_one();
}

void CopyQueue::Loop() {
  driver_.cuCtxSetCurrent(context_);
  for (;;) {
    std::optional<Item> next;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !pending_.empty() || !in_flight_.empty(); });
      if (!pending_.empty() && in_flight_.size() < kWindow) {
        next = std::move(pending_.front());
        pending_.pop_front();
      } else if (in_flight_.empty()) {
        return;  // stopping, nothing left
      }
    }
    if (next) {
      Start(std::move(*next));
    } else {
      FinishOldest();
    }
  }
}

void CopyQueue::Start(Item item) {
  try {
    item.issue(stream_);
    cuda::CUevent finished = idle_events_.back();
    driver_.Check(driver_.cuEventRecord(finished, stream_), "cuEventRecord");
    idle_events_.pop_back();
    in_flight_.push_back(InFlight{finished, std::move(item.done)});
  } catch (const Error& e) {
    spdlog::warn("{}: {}", name_, e.what());
    if (item.done) item.done(std::string(e.what()));
  }
}

void CopyQueue::FinishOldest() {
  InFlight oldest = std::move(in_flight_.front());
  in_flight_.pop_front();
  std::optional<std::string> error;
  try {
    driver_.Check(driver_.cuEventSynchronize(oldest.finished), "a GPU copy");
  } catch (const Error& e) {
    spdlog::warn("{}: {}", name_, e.what());
    error = e.what();
  }
  idle_events_.push_back(oldest.finished);
  if (oldest.done) oldest.done(std::move(error));
}

}  // namespace trainstream::daemon
