#include "client/src/bounded_wait.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>

namespace trainstream {

BoundedWait::BoundedWait(const WaitPolicy& policy, std::function<std::string()> what,
                         std::function<std::string()> situation)
    : policy_(policy),
      what_(std::move(what)),
      situation_(std::move(situation)),
      start_(std::chrono::steady_clock::now()),
      next_check_(start_ + kWaitSlice),
      next_progress_(start_ + ProgressInterval()) {}

std::chrono::milliseconds BoundedWait::ProgressInterval() const {
  return std::clamp(policy_.timeout / 10, std::chrono::milliseconds(1000), std::chrono::milliseconds(30000));
}

void BoundedWait::Between() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_check_) return;
  next_check_ = now + kWaitSlice;
  if (policy_.interrupt) policy_.interrupt();
  const auto waited = now - start_;
  if (waited >= policy_.timeout) {
    Throw(Code::kDeadlineExceeded, "gave up waiting for {} (wait timeout {} s)", Describe(waited),
          std::chrono::duration_cast<std::chrono::seconds>(policy_.timeout).count());
  }
  if (policy_.progress && now >= next_progress_) {
    next_progress_ = now + ProgressInterval();
    policy_.progress("still waiting for " + Describe(waited));
  }
}

std::string BoundedWait::Describe(std::chrono::steady_clock::duration waited) const {
  const double seconds = std::chrono::duration<double>(waited).count();
  std::string message = fmt::format("{} after {:.0f} s", what_(), seconds);
  if (situation_) message += ": " + situation_();
  return message;
}

grpc::Status WaitForCall(grpc::ClientContext& context, const std::function<void()>& interrupt,
                         const std::function<void(std::function<void(grpc::Status)>)>& start) {
  struct State {
    std::mutex mutex;
    std::condition_variable ended;
    std::optional<grpc::Status> status;
  };
  auto state = std::make_shared<State>();  // the callback may outlive an abandoned wait's frame
  start([state](grpc::Status status) {
    std::lock_guard lock(state->mutex);
    state->status = std::move(status);
    state->ended.notify_all();
  });
  std::unique_lock lock(state->mutex);
  while (!state->ended.wait_for(lock, kWaitSlice, [&] { return state->status.has_value(); })) {
    if (!interrupt) continue;
    lock.unlock();
    try {
      interrupt();
    } catch (...) {
      context.TryCancel();
      lock.lock();
      state->ended.wait(lock, [&] { return state->status.has_value(); });
      throw;
    }
    lock.lock();
  }
  return *state->status;
}

}  // namespace trainstream
