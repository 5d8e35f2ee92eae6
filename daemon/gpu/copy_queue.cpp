#include "daemon/gpu/copy_queue.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "shm/error.h"

namespace trainstream::daemon {

CopyQueue::CopyQueue(const cuda::CudaDriver& driver, cuda::CUcontext context, std::string name)
    : driver_(driver), context_(context), name_(std::move(name)) {
  cuda::ScopedContext scope(driver_, context_);
  driver_.Check(driver_.cuStreamCreate(&stream_, cuda::kStreamNonBlocking), "cuStreamCreate");
  issuer_ = std::thread([this] { IssueLoop(); });
  completer_ = std::thread([this] { CompleteLoop(); });
}

CopyQueue::~CopyQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  submitted_.notify_all();
  issued_.notify_all();
  issuer_.join();
  completer_.join();
  // At process exit the driver may already be unloading (a daemon stopped by SIGTERM after its last
  // job: cuCtxPushCurrent failed there and the throw out of this destructor aborted the daemon).
  cuda::ReleaseInContext(driver_, context_, [&] {
    for (cuda::CUevent event : all_events_) driver_.cuEventDestroy(event);
    driver_.cuStreamDestroy(stream_);
  });
}

void CopyQueue::Submit(Issue issue, Done done, Gate gate) {
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(Item{std::move(issue), std::move(done), std::move(gate)});
  }
  submitted_.notify_one();
}

void CopyQueue::IssueLoop() {
  driver_.cuCtxSetCurrent(context_);
  for (;;) {
    Item item;
    {
      std::unique_lock lock(mutex_);
      submitted_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) {  // stopping, nothing left to issue
        issuer_done_ = true;
        issued_.notify_one();
        return;
      }
      item = std::move(pending_.front());
      pending_.pop_front();
    }
    InFlight started = Start(std::move(item));
    {
      std::lock_guard lock(mutex_);
      in_flight_.push_back(std::move(started));
    }
    issued_.notify_one();
  }
}

CopyQueue::InFlight CopyQueue::Start(Item item) {
  // Short enough to keep the copy engine fed (a 32 MiB copy takes ~600 us at PCIe Gen5 speed).
  constexpr auto kGatePoll = std::chrono::microseconds(20);
  try {
    while (item.gate && !item.gate()) std::this_thread::sleep_for(kGatePoll);
    item.issue(stream_);
    cuda::CUevent finished = nullptr;
    {
      std::lock_guard lock(mutex_);
      finished = TakeEvent();
    }
    driver_.Check(driver_.cuEventRecord(finished, stream_), "cuEventRecord");
    return InFlight{finished, std::move(item.done), std::nullopt};
  } catch (const Error& e) {
    spdlog::warn("{}: {}", name_, e.what());
    return InFlight{nullptr, std::move(item.done), e};
  }
}

// Blocking sync: the completing thread sleeps on a copy instead of spinning a core the update needs.
cuda::CUevent CopyQueue::TakeEvent() {
  if (idle_events_.empty()) {
    cuda::CUevent event = nullptr;
    driver_.Check(driver_.cuEventCreate(&event, cuda::kEventBlockingSync | cuda::kEventDisableTiming), "cuEventCreate");
    all_events_.push_back(event);
    return event;
  }
  cuda::CUevent event = idle_events_.back();
  idle_events_.pop_back();
  return event;
}

void CopyQueue::CompleteLoop() {
  driver_.cuCtxSetCurrent(context_);
  for (;;) {
    InFlight oldest;
    {
      std::unique_lock lock(mutex_);
      issued_.wait(lock, [&] { return !in_flight_.empty() || issuer_done_; });
      if (in_flight_.empty()) return;  // stopping, everything issued has finished
      oldest = std::move(in_flight_.front());
      in_flight_.pop_front();
    }
    if (oldest.finished != nullptr) {
      try {
        driver_.Check(driver_.cuEventSynchronize(oldest.finished), "a GPU copy");
      } catch (const Error& e) {
        spdlog::warn("{}: {}", name_, e.what());
        oldest.error = e;
      }
      std::lock_guard lock(mutex_);
      idle_events_.push_back(oldest.finished);
    }
    if (oldest.done) oldest.done(std::move(oldest.error));
  }
}

}  // namespace trainstream::daemon
