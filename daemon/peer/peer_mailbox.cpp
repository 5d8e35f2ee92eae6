#include "daemon/peer/peer_mailbox.h"

#include <fmt/format.h>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {
// What a waiting fragment costs against the bound: its floats and at most a header's bytes, so that
// empty fragments cannot pile up for free.
size_t Cost(const PeerPayload& data) {
  return PayloadBytes(data) + kMaxFragmentHeaderBytes;
}
}  // namespace

std::string Describe(const FragmentKey& key) {
  return fmt::format("fragment {} of round {} of phase {} of bucket {} of step {} of job '{}'", key.fragment, key.round,
                     key.phase, key.bucket, key.step, key.job);
}

MailboxJob PeerMailbox::Open(const std::string& name) {
  std::lock_guard lock(mutex_);
  if (!IsOpen(name)) {  // what waits for it no longer counts against the bound
    for (auto it = fragments_.lower_bound(FragmentKey{name}); it != fragments_.end() && it->first.job == name; ++it) {
      unknown_bytes_ -= Cost(it->second.data);
    }
  }
  MailboxJob job{name, ++instances_};
  open_[name].emplace(job.instance, std::nullopt);
  return job;
}

void PeerMailbox::Close(const MailboxJob& job) {
  std::lock_guard lock(mutex_);
  Retire(job);
}

void PeerMailbox::Drop(const MailboxJob& job) {
  std::lock_guard lock(mutex_);
  Retire(job);
  if (IsOpen(job.name)) return;  // what waits is the open instance's
  auto it = fragments_.lower_bound(FragmentKey{job.name});
  while (it != fragments_.end() && it->first.job == job.name) Forget(it++);
}

void PeerMailbox::Retire(const MailboxJob& job) {
  const auto open = open_.find(job.name);
  if (open == open_.end() || open->second.erase(job.instance) == 0 || !open->second.empty()) return;
  open_.erase(open);
  for (auto it = fragments_.lower_bound(FragmentKey{job.name}); it != fragments_.end() && it->first.job == job.name;
       ++it) {
    unknown_bytes_ += Cost(it->second.data);
  }
}

PeerMailbox::Reduced* PeerMailbox::ReducedOf(const MailboxJob& job) {
  const auto open = open_.find(job.name);
  if (open == open_.end()) return nullptr;
  const auto instance = open->second.find(job.instance);
  return instance != open->second.end() ? &instance->second : nullptr;
}

PeerMailbox::Registration* PeerMailbox::SinkOf(const std::string& name, uint64_t step, uint32_t bucket) {
  const auto open = open_.find(name);
  if (open == open_.end()) return nullptr;
  for (const auto& [instance, reduced] : open->second) {
    const auto registered = sinks_.find(SinkKey{name, instance, step, bucket});
    if (registered != sinks_.end()) return &registered->second;
  }
  return nullptr;
}

void PeerMailbox::Put(Delivered fragment) {
  std::unique_lock lock(mutex_);
  const FragmentKey& key = fragment.key;
  if (Registration* registered = SinkOf(key.job, key.step, key.bucket)) {
    return Deliver(lock, *registered, std::move(fragment));
  }
  const auto open = open_.find(key.job);
  if (open != open_.end()) {
    for (const auto& [instance, reduced] : open->second) {
      TS_CHECK(!reduced || std::make_pair(key.step, key.bucket) > *reduced, Code::kFailedPrecondition,
               "{} arrived after this node reduced that bucket (bucket {} of step {} is the last one it did)",
               Describe(key), reduced->second, reduced->first);
    }
  }
  const auto waiting = fragments_.find(key);
  TS_CHECK(waiting == fragments_.end(), Code::kAlreadyExists, "{} arrived twice (first from {})", Describe(key),
           waiting->second.sender);
  if (open == open_.end()) {
    const size_t cost = Cost(fragment.data);
    TS_CHECK(unknown_bytes_ + cost <= max_unknown_bytes_, Code::kResourceExhausted,
             "{} refused: fragments of jobs this node does not have hold {} bytes, and {} more would pass "
             "peer_max_unknown_job_bytes ({}); the job's ranks on this node may not have attached yet",
             Describe(key), unknown_bytes_, cost, max_unknown_bytes_);
    unknown_bytes_ += cost;
  }
  Keep(std::move(fragment));
}

void PeerMailbox::Deliver(std::unique_lock<std::mutex>& lock, Registration& registration, Delivered fragment) {
  ++registration.delivering;  // the registration stays in the map until delivering is 0
  lock.unlock();
  struct Leave {
    PeerMailbox& mailbox;
    Registration& registration;
    std::unique_lock<std::mutex>& lock;
    ~Leave() {
      lock.lock();
      if (--registration.delivering == 0) mailbox.delivered_.notify_all();
    }
  } leave{*this, registration, lock};
  registration.sink->Arrived(std::move(fragment));  // may throw: Leave still counts it out
}

void PeerMailbox::Keep(Delivered fragment) {
  fragments_.emplace(std::move(fragment.key), Waiting{std::move(fragment.data), std::move(fragment.sender),
                                                      fragment.from_node, std::chrono::steady_clock::now()});
}

void PeerMailbox::Forget(std::map<FragmentKey, Waiting>::iterator it) {
  if (!IsOpen(it->first.job)) unknown_bytes_ -= Cost(it->second.data);
  fragments_.erase(it);
}

std::vector<Delivered> PeerMailbox::Register(const MailboxJob& job, uint64_t step, uint32_t bucket, PeerSink* sink) {
  std::vector<Delivered> waiting;
  std::lock_guard lock(mutex_);
  sinks_.insert_or_assign(SinkKey{job.name, job.instance, step, bucket}, Registration{sink});
  Reduced* reduced = ReducedOf(job);
  if (reduced == nullptr) return waiting;                                       // dropped: none is its
  if (*reduced && std::make_pair(step, bucket) <= **reduced) reduced->reset();  // the job goes back (a step again)
  auto it = fragments_.lower_bound(FragmentKey{job.name, step, bucket, 0, 0, 0});
  while (it != fragments_.end() && it->first.job == job.name && it->first.step == step && it->first.bucket == bucket) {
    waiting.push_back(
        Delivered{it->first, std::move(it->second.data), std::move(it->second.sender), it->second.from_node});
    it = fragments_.erase(it);
  }
  return waiting;
}

void PeerMailbox::Unregister(const MailboxJob& job, uint64_t step, uint32_t bucket) {
  std::unique_lock lock(mutex_);
  const auto registered = sinks_.find(SinkKey{job.name, job.instance, step, bucket});
  if (registered == sinks_.end()) return;
  delivered_.wait(lock, [&] { return registered->second.delivering == 0; });
  sinks_.erase(registered);
  if (Reduced* reduced = ReducedOf(job)) *reduced = std::make_pair(step, bucket);
}

bool PeerMailbox::Registered(const std::string& name, uint64_t step, uint32_t bucket) {
  std::lock_guard lock(mutex_);
  return SinkOf(name, step, bucket) != nullptr;
}

size_t PeerMailbox::Expire(std::chrono::steady_clock::duration age) {
  const auto before = std::chrono::steady_clock::now() - age;
  std::lock_guard lock(mutex_);
  size_t expired = 0;
  for (auto it = fragments_.begin(); it != fragments_.end();) {
    if (it->second.arrived < before) {
      Forget(it++);
      ++expired;
    } else {
      ++it;
    }
  }
  return expired;
}

size_t PeerMailbox::unknown_bytes() {
  std::lock_guard lock(mutex_);
  return unknown_bytes_;
}

}  // namespace trainstream::daemon
