#include "daemon/peer_mailbox.h"

namespace trainstream::daemon {

void PeerMailbox::Put(ChunkKey key, PeerPayload data) {
  {
    std::lock_guard lock(mutex_);
    chunks_.insert_or_assign(std::move(key), std::move(data));
  }
  arrived_.notify_all();
}

std::optional<PeerPayload> PeerMailbox::Take(const ChunkKey& key, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!arrived_.wait_for(lock, timeout, [&] { return chunks_.contains(key); })) return std::nullopt;
  auto node = chunks_.extract(key);
  return std::move(node.mapped());
}

void PeerMailbox::Drop(const std::string& job) {
  std::lock_guard lock(mutex_);
  std::erase_if(chunks_, [&](const auto& entry) { return entry.first.job == job; });
}

}  // namespace trainstream::daemon
