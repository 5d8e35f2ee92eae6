#include "daemon/engine/rank_table.h"

#include <spdlog/spdlog.h>

#include "shm/error.h"

namespace trainstream::daemon {

void RankTable::Add(std::shared_ptr<RankChannel> channel) {
  const uint32_t rank = channel->rank;
  TS_CHECK(rank < ranks_.size(), Code::kInvalidArgument, "rank {} out of range (world size {})", rank, ranks_.size());
  TS_CHECK(ranks_[rank] == nullptr, Code::kAlreadyExists, "rank {} of job '{}' is already attached by another client",
           rank, job_name_);
  TS_CHECK(!CheckMemory(), Code::kAborted, "job '{}' is being dropped: {}", job_name_, lost_.value_or(""));
  ranks_[rank] = std::move(channel);
}

bool RankTable::Remove(uint32_t rank) {
  if (!Has(rank)) return false;
  if (ranks_[rank]->transfer) ranks_[rank]->transfer->Abandon();
  ranks_[rank] = nullptr;
  return true;
}

RankChannel& RankTable::SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer) {
  TS_CHECK(Has(rank), Code::kFailedPrecondition, "rank {} is not attached", rank);
  TS_CHECK(ranks_[rank]->transfer == nullptr, Code::kAlreadyExists, "rank {} registered its GPU buffers already", rank);
  ranks_[rank]->transfer = std::move(transfer);
  return *ranks_[rank];
}

bool RankTable::Attached(const std::shared_ptr<RankChannel>& channel) const {
  return channel->rank < ranks_.size() && ranks_[channel->rank] == channel && !channel->failed;
}

std::vector<uint32_t> RankTable::AttachedRanks() const {
  std::vector<uint32_t> attached;
  for (const auto& channel : ranks_) {
    if (channel) attached.push_back(channel->rank);
  }
  return attached;
}

bool RankTable::CheckMemory() {
  if (lost_) return true;
  const ClientSegment* lost = state_segment_ != nullptr && state_segment_->lost() ? state_segment_ : nullptr;
  for (const auto& channel : ranks_) {
    if (lost == nullptr && channel && channel->segment.lost()) lost = &channel->segment;
  }
  if (lost == nullptr) return false;
  lost_ = lost->LostMessage();
  const std::string message = fmt::format(
      "job '{}' was dropped: {}; its optimizer state is gone, restart from a checkpoint", job_name_, *lost_);
  spdlog::error("{}", message);
  if (peers_ != nullptr) peers_->Reset(message);
  for (const auto& channel : ranks_) {
    if (!channel) continue;
    channel->failed = true;
    channel->session->Fail(message);
  }
  return true;
}

void RankTable::FailRank(RankChannel& channel, const std::string& message) {
  if (CheckMemory()) return;  // what went wrong may be the zeros a lost segment holds now: the loss is the news
  channel.failed = true;
  spdlog::warn("job '{}' rank {}: {}", job_name_, channel.rank, message);
  channel.session->Fail(message);
}

void RankTable::FailSessions(const std::string& message) {
  if (CheckMemory()) return;
  for (const auto& channel : ranks_) {
    if (channel) channel->session->Fail(message);
  }
}

void RankTable::PostTo(RankChannel& channel, const shm::Message& message) {
  try {
    channel.Post(message);
  } catch (const Error& e) {
    FailRank(channel, e.what());
  }
}

void RankTable::PostToAll(const shm::Message& message) {
  for (const auto& channel : ranks_) {
    if (channel && !channel->failed) PostTo(*channel, message);
  }
}

}  // namespace trainstream::daemon
