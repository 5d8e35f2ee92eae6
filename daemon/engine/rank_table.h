// The ranks attached to a job, by rank, and what reaches them outside the step protocol: a posted
// completion, a failure, the loss of the job's memory (an owner truncated a segment under the daemon),
// the divergence of a multi-node job. The engine thread reads and changes it holding mutex(); attach,
// detach and the questions of gRPC threads take the same mutex.
//
// What a lost segment's pages hold now are zeros private to the daemon (daemon/guard/fault_guard.h):
// nothing computed from them may reach a rank, so every session fails before the next message or
// continuation, and the failed ranks get nothing more (PostTo, WeightPushes::Publish and pushes
// skip them).
//
// Invariants: a slot holds the channel of its rank or nullptr; a failed channel is posted nothing more;
// once lost, always lost, and no rank attaches; the first divergence is the one kept.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine/all_reduce.h"
#include "daemon/engine/rank_channel.h"
#include "shm/message.h"

namespace trainstream::daemon {

class RankTable {
 public:
  // `state_segment`: the guarded mapping of the job's state (nullptr: tests that map it unguarded);
  // `peers`: the other nodes, reset when the job is lost (nullptr: one node).
  RankTable(std::string job_name, uint32_t world_size, const ClientSegment* state_segment, AllReduce* peers)
      : job_name_(std::move(job_name)), ranks_(world_size), state_segment_(state_segment), peers_(peers) {}

  [[nodiscard]] std::mutex& mutex() { return mutex_; }

  // The rest requires mutex().
  // Fails kInvalidArgument out of range, kAlreadyExists if attached, kAborted if the job is lost.
  void Add(std::shared_ptr<RankChannel> channel);
  // Whether the rank was attached; its transfer is abandoned (its GPU may never reach its events).
  bool Remove(uint32_t rank);
  // The rank's data moves through `transfer` from now on; returns its channel.
  RankChannel& SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer);
  [[nodiscard]] bool Has(uint32_t rank) const { return rank < ranks_.size() && ranks_[rank] != nullptr; }
  // Still this rank's channel, and not failed.
  [[nodiscard]] bool Attached(const std::shared_ptr<RankChannel>& channel) const;
  [[nodiscard]] std::vector<uint32_t> AttachedRanks() const;

  // Whether the job's memory is lost; the first time, fails every session saying so.
  bool CheckMemory();
  [[nodiscard]] const std::optional<std::string>& lost() const { return lost_; }
  // The first reason the job's nodes may hold different weights, kept.
  void SetDiverged(const std::string& why) {
    if (!diverged_) diverged_ = why;
  }
  [[nodiscard]] const std::optional<std::string>& diverged() const { return diverged_; }

  // A rank's protocol error: its session fails and its ring is no longer read (unless the job is lost:
  // the loss is the news).
  void FailRank(RankChannel& channel, const std::string& message);
  void FailSessions(const std::string& message);
  void PostTo(RankChannel& channel, const shm::Message& message);
  void PostToAll(const shm::Message& message);

  [[nodiscard]] const std::vector<std::shared_ptr<RankChannel>>& all() const { return ranks_; }
  [[nodiscard]] auto begin() const { return ranks_.begin(); }
  [[nodiscard]] auto end() const { return ranks_.end(); }
  [[nodiscard]] size_t size() const { return ranks_.size(); }
  [[nodiscard]] const std::shared_ptr<RankChannel>& operator[](uint32_t rank) const { return ranks_[rank]; }

 private:
  const std::string job_name_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<RankChannel>> ranks_;  // by rank; nullptr when not attached
  const ClientSegment* const state_segment_;
  AllReduce* const peers_;
  std::optional<std::string> diverged_;
  std::optional<std::string> lost_;
};

}  // namespace trainstream::daemon
