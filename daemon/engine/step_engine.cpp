#include "daemon/engine/step_engine.h"

#include <spdlog/spdlog.h>

#include <future>
#include <utility>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr uint32_t kMaxMessagesPerRankPerRound = 256;  // fairness between ranks
constexpr auto kIdleWait = std::chrono::milliseconds(100);
constexpr auto kResumeTimeout = std::chrono::minutes(5);  // passes in flight finish in milliseconds

}  // namespace

StepEngine::StepEngine(std::string job_name, const shm::LayoutSpec& spec, const shm::JobLayout& layout,
                       shm::StateView state, uint64_t seed, WorkerPool& pool, AllReduce* peers, bool adopted,
                       CommitObserver on_commit, std::unique_ptr<StepTrace> trace, const ClientSegment* state_segment)
    : job_name_(std::move(job_name)),
      doorbell_(state.header->doorbell),
      ranks_(job_name_, spec.world_size, state_segment, peers),
      mailbox_(doorbell_),
      protocol_(job_name_, spec, layout, state, seed, pool, peers, adopted, std::move(on_commit), std::move(trace),
                ranks_, mailbox_) {
  thread_ = std::thread([this] { Loop(); });
}

StepEngine::~StepEngine() {
  stopping_ = true;
  doorbell_.Ring();
  thread_.join();
  mailbox_.WaitIdle();
}

void StepEngine::PlaceState() {
  std::call_once(placed_, [this] { protocol_.PlaceState(); });
}

void StepEngine::AddRank(std::shared_ptr<RankChannel> channel) {
  std::lock_guard lock(ranks_.mutex());
  ranks_.Add(std::move(channel));
}

void StepEngine::RemoveRank(uint32_t rank) {
  std::lock_guard lock(ranks_.mutex());
  if (ranks_.Remove(rank)) protocol_.ResetCollecting(fmt::format("rank {} detached", rank));
}

void StepEngine::SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer) {
  std::lock_guard lock(ranks_.mutex());
  protocol_.TransferSet(ranks_.SetTransfer(rank, std::move(transfer)));
}

bool StepEngine::HasRank(uint32_t rank) {
  std::lock_guard lock(ranks_.mutex());
  return ranks_.Has(rank);
}

std::optional<std::string> StepEngine::Diverged() {
  std::lock_guard lock(ranks_.mutex());
  return ranks_.diverged();
}

std::optional<std::string> StepEngine::Lost() {
  std::lock_guard lock(ranks_.mutex());
  ranks_.CheckMemory();
  return ranks_.lost();
}

EngineStats StepEngine::Stats() {
  EngineStats stats = protocol_.Counted();
  std::lock_guard lock(ranks_.mutex());
  stats.attached_ranks = ranks_.AttachedRanks();
  return stats;
}

uint64_t StepEngine::Resume() {
  auto resumed = std::make_shared<std::promise<uint64_t>>();
  std::future<uint64_t> step = resumed->get_future();
  mailbox_.Post(
      [this, resumed] { protocol_.WhenSettled([resumed](uint64_t completed) { resumed->set_value(completed); }); });
  TS_CHECK(step.wait_for(kResumeTimeout) == std::future_status::ready, Code::kUnavailable,
           "job '{}': the updates in flight did not finish within {} s; attach again", job_name_,
           std::chrono::duration_cast<std::chrono::seconds>(kResumeTimeout).count());
  return step.get();
}

void StepEngine::FailAll(const std::string& message) {
  std::lock_guard lock(ranks_.mutex());
  ranks_.FailSessions(message);
}

void StepEngine::AnnounceCommitted() {
  mailbox_.Post([this] { protocol_.AnnounceCommitted(); });
}

void StepEngine::Loop() {
  while (!stopping_.load()) {
    const uint32_t seen = doorbell_.Seq();
    bool progress = DrainFinished();
    progress |= DrainRequests();
    if (!progress) doorbell_.Wait(seen, kIdleWait);
  }
}

bool StepEngine::DrainRequests() {
  std::lock_guard lock(ranks_.mutex());
  ranks_.CheckMemory();  // every round: an idle job's too
  bool progress = false;
  for (const auto& channel : ranks_) {
    if (!channel || channel->failed) continue;
    try {
      channel->FlushBacklog();
      shm::Message message;
      for (uint32_t n = 0; n < kMaxMessagesPerRankPerRound && channel->requests.TryPop(&message); ++n) {
        progress = true;
        protocol_.Handle(*channel, message);
      }
    } catch (const Error& e) {
      ranks_.FailRank(*channel, e.what());
    }
  }
  return progress;
}

bool StepEngine::DrainFinished() {
  std::vector<std::function<void()>> finished = mailbox_.Take();
  if (finished.empty()) return false;
  std::lock_guard lock(ranks_.mutex());
  ranks_.CheckMemory();  // a worker that found pages gone did so before it handed its continuation back
  for (auto& continuation : finished) {
    try {
      continuation();
    } catch (const Error& e) {  // e.g. hyperparameters rewritten between validation and use
      spdlog::error("job '{}': {}", job_name_, e.what());
      ranks_.FailSessions(e.what());
    }
  }
  protocol_.RunResumes();
  return true;
}

}  // namespace trainstream::daemon
