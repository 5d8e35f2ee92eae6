#include "daemon/control/job.h"

#include <spdlog/spdlog.h>

#include <unistd.h>

#include <random>

#include "daemon/gpu/pinned_host.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
std::string RandomKey() {
  std::random_device device;
  const uint64_t value = (static_cast<uint64_t>(device()) << 32) ^ device();
  return fmt::format("{:016x}", value);
}

// A job with one state half whose daemon died while it updated buckets in place holds them torn (part
// of each at its old step, part at the new one): refused, never resumed silently. Two halves keep
// every bucket's committed half intact, whatever the daemon was doing.
void RefuseTornState(const std::string& name, const shm::StateView& state, const shm::JobLayout& layout) {
  std::vector<uint32_t> torn;
  uint64_t step = 0;
  for (uint32_t b = 0; b < layout.buckets.size(); ++b) {
    const shm::BucketCommit commit = state.bucket_state[b].Load();
    if (!commit.updating) continue;
    torn.push_back(b);
    step = commit.step + 1;
  }
  if (torn.empty()) return;
  Throw(Code::kFailedPrecondition,
        "job '{}' cannot resume: the trainstreamd that held it was killed while it updated bucket(s) [{}] (of {}) "
        "in place, so their weights and moments are partly of step {} and partly of step {} (the job keeps one "
        "copy of its optimizer state, state_halves=1). Drop the job (Client.drop_job('{}')) and restart from your "
        "last checkpoint: model.load_state_dict() and optimizer.load_state_dict(). With state_halves=2 a job "
        "resumes exactly after its daemon is killed",
        name, fmt::join(torn, ", "), layout.buckets.size(), step - 1, step, name);
}

// An orphan whose owner truncated its state (while no daemon held it, or while this one read it) can
// never resume: its segments are removed, so that neither the job nor its memory lingers until the TTL.
[[noreturn]] void RefuseTruncated(const std::string& name, const std::string& key, const ClientSegment& state,
                                  const std::string& why) {
  RemoveJobSegments(state.owner(), key);
  Throw(Code::kFailedPrecondition,
        "job '{}' cannot resume: {}, so its optimizer state is gone. Its segments were removed: attach again to start "
        "the job anew, from your last checkpoint (model.load_state_dict() and optimizer.load_state_dict())",
        name, why);
}
}  // namespace

Job::Job(std::string name, uint32_t uid, const shm::LayoutSpec& spec, uint64_t seed, WorkerPool& pool,
         const PeerConfig& peer_config, const OrphanedJob* adopted, const SnapshotFile* restored,
         SnapshotSchedule snapshots, const std::string& trace_dir)
    : name_(std::move(name)),
      uid_(uid),
      spec_(spec),
      layout_(shm::ComputeLayout(spec_)),
      key_(adopted != nullptr ? adopted->key : RandomKey()),
      fresh_(adopted == nullptr && restored == nullptr),
      idle_since_(std::chrono::steady_clock::now()) {
  TS_CHECK(geteuid() == 0 || geteuid() == uid_, Code::kPermissionDenied,
           "trainstreamd runs as uid {}; a job of uid {} needs a daemon running as root or as that uid", geteuid(),
           uid_);
  if (adopted != nullptr) {
    state_ = ClientSegment::Open(adopted->state_segment, uid_);
    if (state_.size() < layout_.state_bytes) {
      RefuseTruncated(name_, key_, state_,
                      fmt::format("its state segment {} holds {} bytes of the {} its layout needs (its owner, uid {}, "
                                  "truncated it)",
                                  state_.name(), state_.size(), layout_.state_bytes, uid_));
    }
    shm::CheckStateSegment(state_.data(), state_.size(), layout_);
    RefuseTornState(name_, ViewState(), layout_);
    if (state_.lost()) RefuseTruncated(name_, key_, state_, state_.LostMessage());
    state_.RemoveOnDestroy();
  } else {
    const auto creating = std::chrono::steady_clock::now();
    state_ = ClientSegment::Create(shm::SegmentName(uid_, key_, "state"), layout_.state_bytes, uid_,
                                   LeftToFirstTouch(pool.nodes()));
    state_.RemoveOnDestroy();  // now, also when this constructor throws: a failed restore leaves nothing
    backed_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - creating).count();
    shm::InitStateSegment(state_.data(), layout_);
    auto* header = static_cast<shm::StateHeader*>(state_.data());
    header->owner = SelfAsOwner();
    name_.copy(header->job_name, shm::kMaxJobName);
    if (restored != nullptr) restored->RestoreInto(CommittedState(ViewState(), layout_, spec_));
  }
  if (spec_.nodes() > 1) {
    TS_CHECK(peer_config.mailbox != nullptr, Code::kFailedPrecondition,
             "job '{}' spans {} nodes, but this trainstreamd was started without --peer-listen", name_, spec_.nodes());
    peers_ = std::make_unique<PeerAllReduce>(name_, spec_.peers, spec_.node_rank,
                                             static_cast<uint32_t>(layout_.buckets.size()), peer_config);
  }
  snapshots_ = std::make_unique<JobSnapshots>(
      SnapshotMeta{.job = name_, .uid = uid_, .seed = seed, .step = 0, .hparams = {}, .spec = spec_}, ViewState(),
      layout_, std::move(snapshots));
  engine_ = std::make_unique<StepEngine>(
      name_, spec_, layout_, ViewState(), seed, pool, peers_.get(),
      /*adopted=*/adopted != nullptr, [this](const Commit& commit) { OnCommit(commit); },
      TraceInDir(trace_dir, key_, uid_), &state_);
  snapshots_->Connect(SnapshotHooks{.attached_ranks = [this] { return attached_ranks(); },
                                    .announce = [this] { engine_->AnnounceCommitted(); }});
  spdlog::info(
      "job '{}' {}: {} parameters in {} buckets, {} state bytes ({} state {}{}{}), key {}", name_,
      adopted != nullptr    ? fmt::format("re-adopted at step {}", adopted->completed_step)
      : restored != nullptr ? fmt::format("restored from {} at step {}", restored->path(), restored->meta().step)
                            : "created",
      spec_.params.size(), layout_.buckets.size(), layout_.state_bytes, spec_.state_halves,
      spec_.state_halves == 2 ? "halves" : "half", layout_.speculative_clipping ? ", speculative clipping" : "",
      adopted != nullptr ? "" : fmt::format("; backed in {:.2f} s", backed_seconds_), key_);
}

void Job::StampSocket(uint64_t socket_hash) {
  static_cast<shm::StateHeader*>(state_.data())->daemon_socket = socket_hash;
}

Job::~Job() {
  snapshots_->Stop();  // its writer may still ask the engine for announcements
  if (peers_) peers_->Stop(fmt::format("job '{}' was removed", name_));  // no all-reduce left to wait for
  engine_.reset();  // waits for in-flight work (updates, GPU copies) before the segments go away
  PinnedHost::Instance().Release(state_.data(), state_.size());
  for (uint32_t rank = 0; rank < spec_.world_size; ++rank) shm::Segment::Remove(RankSegmentName(rank));
  spdlog::info("job '{}' removed", name_);
}

std::string Job::RankSegmentName(uint32_t rank) const {
  return shm::SegmentName(uid_, key_, fmt::format("rank{}", rank));
}

Job::Attachment Job::Attach(uint32_t rank, std::shared_ptr<SessionSink> session, const std::string& transport) {
  TS_CHECK(rank < spec_.world_size, Code::kInvalidArgument, "rank {} out of range for job '{}' (world size {})", rank,
           name_, spec_.world_size);
  // Here, not in the constructor: the registry's lock is not held now. Only a new job's state: placing
  // zeroes it.
  if (fresh_) engine_->PlaceState();
  std::lock_guard lock(mutex_);  // one attach/detach at a time: they share the rank's segment name
  TS_CHECK(!closed_, Code::kAborted, "job '{}' went away while rank {} attached ({}); attach again", name_, rank,
           closed_.value_or(""));
  if (auto lost = engine_->Lost()) {
    Throw(Code::kAborted, "job '{}' is being dropped: {}; attach again in a second to start it anew", name_, *lost);
  }
  if (auto diverged = engine_->Diverged()) {
    Throw(Code::kFailedPrecondition,
          "job '{}' cannot resume here: {}, so its nodes may hold different weights; drop it on every node "
          "(drop_job('{}', force=True)) and restart from a checkpoint",
          name_, *diverged, name_);
  }
  TS_CHECK(!engine_->HasRank(rank), Code::kAlreadyExists, "rank {} of job '{}' is already attached by another client",
           rank, name_);
  const uint64_t resume_step = engine_->Resume();
  const std::string name = RankSegmentName(rank);
  shm::Segment::Remove(name);  // left over from a rank that died while its removal raced this attach
  ClientSegment segment = ClientSegment::Create(name, layout_.rank_bytes, uid_);
  shm::InitRankSegment(segment.data(), layout_, rank);
  TS_CHECK(!segment.lost(), Code::kAborted, "rank {} of job '{}' cannot attach: {}", rank, name_,
           segment.LostMessage());
  const std::pair<const void*, size_t> memory{segment.data(), segment.size()};
  engine_->AddRank(std::make_shared<RankChannel>(rank, std::move(segment), layout_, std::move(session)));
  rank_memory_[rank] = memory;
  ++attached_;
  transports_[rank] = transport;
  const auto* header = static_cast<const shm::StateHeader*>(state_.data());
  spdlog::info("job '{}': rank {} attached, transport {}", name_, rank, transport);
  return Attachment{name, header->initialized != 0, resume_step};
}

void Job::Detach(uint32_t rank) {
  std::lock_guard lock(mutex_);
  if (!engine_->HasRank(rank)) return;
  engine_->RemoveRank(rank);
  // Unlinked now, not when the last in-flight task drops its mapping: by then a re-attached rank may
  // own a new segment of the same name.
  shm::Segment::Remove(RankSegmentName(rank));
  transports_.erase(rank);
  rank_memory_.erase(rank);
  if (--attached_ == 0) idle_since_ = std::chrono::steady_clock::now();
  spdlog::info("job '{}': rank {} detached", name_, rank);
}

std::optional<std::string> Job::RegisterCudaIpc(uint32_t rank, const shm::CudaIpcExport& exported) {
  try {
    SetTransfer(rank, CudaRankTransfer::Open(exported, layout_), "cuda-ipc");
    return std::nullopt;
  } catch (const Error& e) {
    spdlog::warn("job '{}': rank {} cannot use cuda-ipc, it copies its data itself: {}", name_, rank, e.what());
    Rename(rank, "cuda-client-copy (cuda-ipc refused)");
    return e.what();
  }
}

void Job::SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer, const std::string& transport) {
  engine_->SetTransfer(rank, std::move(transfer));
  Rename(rank, transport);
}

// Keeps the " on <device>" the rank named at attach.
void Job::Rename(uint32_t rank, const std::string& transport) {
  std::lock_guard lock(mutex_);
  auto found = transports_.find(rank);
  if (found == transports_.end()) return;
  const size_t on = found->second.find(" on ");
  found->second = transport + (on == std::string::npos ? "" : found->second.substr(on));
  spdlog::info("job '{}': rank {} moves its data with {}", name_, rank, found->second);
}

uint64_t Job::host_bytes() {
  return layout_.state_bytes + attached_ranks() * layout_.rank_bytes;
}

size_t Job::attached_ranks() {
  std::lock_guard lock(mutex_);
  return attached_;
}

void Job::Close(const std::string& reason, bool force) {
  std::lock_guard lock(mutex_);
  TS_CHECK(attached_ == 0 || force, Code::kFailedPrecondition,
           "job '{}' has {} attached rank(s); detach them or drop with force", name_, attached_);
  closed_ = reason;
}

bool Job::CloseIfIdle(std::chrono::steady_clock::duration ttl, const std::string& reason) {
  std::lock_guard lock(mutex_);
  if (attached_ != 0 || std::chrono::steady_clock::now() - idle_since_ < ttl) return false;
  closed_ = reason;
  return true;
}

JobInfo Job::Info() {
  const auto* header = static_cast<const shm::StateHeader*>(state_.data());
  JobInfo info{
      .name = name_,
      .key = key_,
      .uid = uid_,
      .params = spec_.params.size(),
      .elements = layout_.total_elems,
      .state_bytes = layout_.state_bytes,
      .rank_bytes = layout_.rank_bytes,
      .completed_step = header->completed_step.load(),
      .buckets = static_cast<uint32_t>(layout_.buckets.size()),
      .world_size = spec_.world_size,
      .state_halves = spec_.state_halves,
      .speculative_clipping = layout_.speculative_clipping,
      .engine = engine_->Stats(),
      .transports = {},
      .steps = counters_.steps.load(),
      .update_seconds = counters_.update_seconds.Read(),
      .last_update_unix_ms = counters_.last_update_unix_ms.load(),
      .last_step_unix_ms = counters_.last_step_unix_ms.load(),
      .host_bytes = host_bytes(),
      .pinned_bytes = PinnedBytes(),
      .last_snapshot = snapshots_->last(),
  };
  std::lock_guard lock(mutex_);
  info.transports = transports_;
  return info;
}

uint64_t Job::PinnedBytes() {
  uint64_t pinned = PinnedHost::Instance().pinned_bytes(state_.data(), state_.size());
  std::lock_guard lock(mutex_);
  for (const auto& [rank, memory] : rank_memory_)
    pinned += PinnedHost::Instance().pinned_bytes(memory.first, memory.second);
  return pinned;
}

// The state segment's ranges a new job does not back at creation. With several NUMA nodes: all of it,
// which the engine's threads first-touch on their nodes (PlaceState). Otherwise the master weights of
// the paged blocks' buckets (in the committed half) and the frozen region: the first client writes them
// from the CPU as it frees the model's own copy of the weights (at 12 bytes per parameter of state, a
// 10B model built on the CPU in bf16 would not fit beside its whole job on a 125 GiB host). Every other
// page is backed (shm::Segment::Create says why), on several threads: left to the client's copies from
// the GPU, the 1.86B's master weights took 3.5 s to back (page-locking them faults them in on one
// thread), against 1.4 s for all the rest of its 45 GB. A restored job's state, which this daemon writes
// from the snapshot, is backed whole.
std::vector<shm::Segment::Range> Job::LeftToFirstTouch(size_t numa_nodes) const {
  if (!fresh_) return {};
  if (numa_nodes > 1) return {{.offset = 0, .bytes = layout_.state_bytes}};
  std::vector<shm::Segment::Range> ranges;
  for (const shm::BucketLayout& bucket : layout_.buckets) {
    if (bucket.partition == 0) continue;  // resident: seeded from the GPU
    const size_t offset = layout_.master_offset[0] + bucket.elem_offset * sizeof(float);
    const size_t bytes = bucket.numel * sizeof(float);
    if (!ranges.empty() && ranges.back().offset + ranges.back().bytes == offset) {
      ranges.back().bytes += bytes;
    } else {
      ranges.push_back({.offset = offset, .bytes = bytes});
    }
  }
  ranges.push_back({.offset = layout_.frozen_offset, .bytes = layout_.frozen_bytes});
  return ranges;
}

shm::StateView Job::ViewState() const {
  return shm::ViewState(state_.data(), layout_, spec_);
}

void Job::OnCommit(const Commit& commit) {
  if (!commit.loaded && !commit.announced) {
    const int64_t now = UnixMillisNow();
    counters_.update_seconds.Observe(commit.update_seconds);
    counters_.last_update_unix_ms.store(now, std::memory_order_relaxed);
    if (commit.step_completed) {
      counters_.steps.fetch_add(1, std::memory_order_relaxed);
      counters_.last_step_unix_ms.store(now, std::memory_order_relaxed);
    }
  }
  snapshots_->OnCommit(commit);
}

SnapshotWritten Job::Snapshot(const std::string& path, uint32_t caller_uid,
                              std::chrono::steady_clock::time_point deadline) {
  return snapshots_->Take(path, caller_uid, deadline);
}

}  // namespace trainstream::daemon
