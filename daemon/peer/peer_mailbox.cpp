#include "daemon/peer/peer_mailbox.h"

namespace trainstream::daemon {

void PeerMailbox::Put(FragmentKey key, PeerPayload data) {
  std::unique_lock lock(mutex_);
  const auto registered = sinks_.find(BucketKey{key.job, key.step, key.bucket});
  if (registered != sinks_.end()) {
    Registration& registration = registered->second;  // stays in the map until delivering is 0
    ++registration.delivering;
    lock.unlock();
    registration.sink->Arrived(key, std::move(data));
    lock.lock();
    if (--registration.delivering == 0) {
      lock.unlock();
      delivered_.notify_all();
    }
    return;
  }
  fragments_.insert_or_assign(std::move(key), Waiting{std::move(data), std::chrono::steady_clock::now()});
}

std::vector<std::pair<FragmentKey, PeerPayload>> PeerMailbox::Register(const std::string& job, uint64_t step,
                                                                       uint32_t bucket, PeerSink* sink) {
  std::vector<std::pair<FragmentKey, PeerPayload>> waiting;
  std::lock_guard lock(mutex_);
  sinks_.insert_or_assign(BucketKey{job, step, bucket}, Registration{sink});
  const FragmentKey first{job, step, bucket, 0, 0, 0};
  auto it = fragments_.lower_bound(first);
  while (it != fragments_.end() && it->first.job == job && it->first.step == step && it->first.bucket == bucket) {
    waiting.emplace_back(it->first, std::move(it->second.data));
    it = fragments_.erase(it);
  }
  return waiting;
}

void PeerMailbox::Unregister(const std::string& job, uint64_t step, uint32_t bucket) {
  std::unique_lock lock(mutex_);
  const auto registered = sinks_.find(BucketKey{job, step, bucket});
  if (registered == sinks_.end()) return;
  delivered_.wait(lock, [&] { return registered->second.delivering == 0; });
  sinks_.erase(registered);
}

void PeerMailbox::Drop(const std::string& job) {
  std::lock_guard lock(mutex_);
  std::erase_if(fragments_, [&](const auto& entry) { return entry.first.job == job; });
}

size_t PeerMailbox::Expire(std::chrono::steady_clock::duration age) {
  const auto before = std::chrono::steady_clock::now() - age;
  std::lock_guard lock(mutex_);
  return std::erase_if(fragments_, [&](const auto& entry) { return entry.second.arrived < before; });
}

}  // namespace trainstream::daemon
