#include "daemon/control/control_service.h"

#include <malloc.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <fstream>
#include <mutex>
#include <set>

#include "daemon/counters/counters.h"
#include "daemon/gpu/pinned_host.h"
#include "daemon/grpc_status.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/snapshot/file_identity.h"
#include "daemon/snapshot/snapshot_format.h"
#include "proto/layout_spec_proto.h"
#include "shm/error.h"
#include "shm/version.h"

namespace trainstream::daemon {

namespace {

// Runs a handler body; the one place where errors become statuses.
template <typename Body>
grpc::Status Guarded(const char* what, Body body) {
  try {
    body();
    return grpc::Status::OK;
  } catch (const Error& e) {
    spdlog::debug("{} refused: {}", what, e.what());
    ProcessCounters::Instance().CountError(ErrorKind::kRefusedRequest);
    return StatusOf(e);
  } catch (const std::exception& e) {
    spdlog::error("{} failed: {}", what, e.what());
    ProcessCounters::Instance().CountError(ErrorKind::kRefusedRequest);
    return StatusOf(Code::kInternal, fmt::format("{} failed inside the daemon: {}", what, e.what()));
  }
}

uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// The daemon's side of one Session stream: serializes writes from the engine and gRPC threads.
class StreamSink final : public SessionSink {
 public:
  StreamSink(grpc::ServerContext* context, grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream)
      : context_(context), stream_(stream) {}

  void Warn(const std::string& message) override {
    v1::SessionEvent event;
    event.set_warning(message);
    Write(event);
  }
  void Fail(const std::string& message) override {
    std::lock_guard lock(mutex_);  // held through TryCancel: once closed_, the context may be gone
    if (closed_ || failure_) return;
    failure_ = message;
    ProcessCounters::Instance().CountError(ErrorKind::kSessionFailed);
    v1::SessionEvent event;
    event.set_error(message);
    stream_->Write(event);
    context_->TryCancel();  // unblocks the handler's Read
  }
  bool Write(const v1::SessionEvent& event) {
    std::lock_guard lock(mutex_);
    return !closed_ && stream_->Write(event);
  }
  // After Close no more writes reach the stream (its handler is about to return).
  std::optional<std::string> Close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    return failure_;
  }

 private:
  std::mutex mutex_;
  grpc::ServerContext* context_;
  grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream_;
  bool closed_ = false;
  std::optional<std::string> failure_;
};

// "cuda-client-copy on cuda:0 (...)"; an unknown transport is refused before anything is created. A
// client that names none predates the field and moves its data itself.
std::string DescribeTransport(const v1::AttachRequest& attach) {
  static const std::set<std::string> kKnown = {"host", "cuda-ipc", "cuda-client-copy"};
  const std::string& name = attach.transport().empty() ? "unnamed" : attach.transport();
  TS_CHECK(attach.transport().empty() || kKnown.contains(name), Code::kInvalidArgument,
           "unknown transport '{}' (this daemon knows host, cuda-ipc, cuda-client-copy)", name);
  return attach.device().empty() ? name : fmt::format("{} on {}", name, attach.device());
}

shm::CudaIpcExport CudaIpcFromProto(const v1::CudaIpcRegistration& proto) {
  return shm::CudaIpcExport{
      .device_uuid = proto.device_uuid(),
      .params_handle = proto.params_handle(),
      .params_bytes = proto.params_bytes(),
      .staging_handle = proto.staging_handle(),
      .slot_bytes = proto.slot_bytes(),
      .grad_ready_events = {proto.grad_ready_events().begin(), proto.grad_ready_events().end()},
      .weights_wanted_events = {proto.weights_wanted_events().begin(), proto.weights_wanted_events().end()},
      .param_offsets = {proto.param_offsets().begin(), proto.param_offsets().end()},
  };
}

// When a long request must give up: a second before the caller's deadline, at most an hour away.
std::chrono::steady_clock::time_point DeadlineOf(const grpc::ServerContext& context) {
  const auto left = std::min<std::chrono::system_clock::duration>(
      context.deadline() - std::chrono::system_clock::now() - std::chrono::seconds(1), std::chrono::hours(1));
  return std::chrono::steady_clock::now() + left;
}

void FillJobCounters(const JobInfo& info, v1::JobStats* stats) {
  stats->set_steps(info.steps);
  stats->set_update_seconds(info.update_seconds.sum);
  stats->set_last_update_unix_ms(info.last_update_unix_ms);
  stats->set_last_step_unix_ms(info.last_step_unix_ms);
  stats->set_host_bytes(info.host_bytes);
  stats->set_pinned_bytes(info.pinned_bytes);
  if (info.last_snapshot) {
    stats->set_last_snapshot(info.last_snapshot->path);
    stats->set_last_snapshot_step(info.last_snapshot->step);
  }
}

// The owner of the job a request names: the caller, or the uid root names (`has_owner`, `owner`).
uint32_t OwnerNamed(uint32_t caller, bool has_owner, uint32_t owner, const char* what) {
  if (!has_owner) return caller;
  TS_CHECK(caller == 0 || owner == caller, Code::kPermissionDenied,
           "uid {} may {} only its own jobs, not uid {}'s (only root may name another owner_uid)", caller, what, owner);
  return owner;
}

}  // namespace

grpc::Status ControlService::Handshake(grpc::ServerContext*, const v1::HandshakeRequest* request,
                                       v1::HandshakeReply* reply) {
  return Guarded("Handshake", [&] {
    TS_CHECK(request->protocol_version() == kProtocolVersion, Code::kFailedPrecondition,
             "protocol version mismatch: client speaks {} (trainstream {}), daemon speaks {} (trainstreamd {})",
             request->protocol_version(), request->client_version(), kProtocolVersion, kVersion);
    reply->set_protocol_version(kProtocolVersion);
    reply->set_daemon_version(std::string(kVersion));
    reply->set_pid(getpid());
    reply->set_kernel(optimizer::ActiveKernelName());
    reply->set_peer_address(peer_address_);
  });
}

uint32_t ControlService::Caller(const grpc::ServerContext& context) const {
  const std::optional<uint32_t> uid = caller_uid_(context);
  TS_CHECK(uid.has_value(), Code::kPermissionDenied,
           "the caller's uid is unknown: connect through trainstreamd's Unix socket");
  return *uid;
}

grpc::Status ControlService::Session(grpc::ServerContext* context,
                                     grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) {
  uint32_t uid = 0;
  std::optional<UnattachedSessions::Entry> unattached;
  grpc::Status admitted = Guarded("Session", [&] {
    uid = Caller(*context);
    unattached.emplace(unattached_, uid);
  });
  if (!admitted.ok()) return admitted;
  return RunSession(context, stream, uid, *unattached);
}

grpc::Status ControlService::RunSession(grpc::ServerContext* context,
                                        grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream,
                                        uint32_t uid, UnattachedSessions::Entry& unattached) {
  v1::SessionRequest first;
  if (!stream->Read(&first)) return {grpc::StatusCode::CANCELLED, "session closed before attach"};
  if (!first.has_attach()) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "the first message of a session must be 'attach'"};
  }
  const v1::AttachRequest& attach = first.attach();
  auto sink = std::make_shared<StreamSink>(context, stream);
  std::shared_ptr<Job> job;
  v1::SessionEvent event;
  grpc::Status attached = Guarded("Attach", [&] {
    const shm::LayoutSpec spec = FromProto(attach.layout());
    const std::string transport = DescribeTransport(attach);
    auto found = registry_.FindOrCreate(attach.job(), uid, spec, attach.seed());
    const Job::Attachment attachment = found.job->Attach(attach.rank(), sink, transport);
    job = found.job;
    v1::AttachReply* reply = event.mutable_attached();
    reply->set_job_key(job->key());
    reply->set_state_segment(job->state_segment_name());
    reply->set_rank_segment(attachment.rank_segment);
    reply->set_layout_hash(job->layout().hash);
    reply->set_created(found.created);
    reply->set_initialized(attachment.initialized);
    reply->set_completed_step(attachment.completed_step);
    reply->set_state_halves(job->spec().state_halves);
    reply->set_speculative_clipping(job->layout().speculative_clipping);
  });
  if (!attached.ok()) return attached;
  sink->Write(event);
  unattached.Leave();

  // The rank stays attached while the client keeps the stream open. The only message it may send
  // meanwhile is one cuda-ipc registration; anything else is a protocol error.
  v1::SessionRequest request;
  std::optional<std::string> protocol_error;
  bool registered = false;
  while (stream->Read(&request)) {
    if (request.has_register_cuda_ipc() && !registered) {
      registered = true;
      v1::SessionEvent reply;
      reply.mutable_cuda_ipc()->set_error(
          job->RegisterCudaIpc(attach.rank(), CudaIpcFromProto(request.register_cuda_ipc())).value_or(""));
      sink->Write(reply);
      continue;
    }
    protocol_error = "unexpected message on an attached session";
    break;
  }
  const std::optional<std::string> failure = sink->Close();
  job->Detach(attach.rank());
  if (failure) return StatusOf(Code::kAborted, *failure);
  if (protocol_error) return {grpc::StatusCode::INVALID_ARGUMENT, *protocol_error};
  return grpc::Status::OK;
}

// host_bytes counts every job (max_host_bytes caps them together); the jobs listed are the caller's,
// or all of them for root.
grpc::Status ControlService::Stats(grpc::ServerContext* context, const v1::StatsRequest*, v1::StatsReply* reply) {
  return Guarded("Stats", [&] {
    const uint32_t caller = Caller(*context);
    auto visible = [caller](uint32_t owner) { return caller == 0 || owner == caller; };
    uint64_t host_bytes = 0;
    for (const auto& job : registry_.Jobs()) {
      const JobInfo info = job->Info();
      host_bytes += info.host_bytes;
      if (!visible(info.uid)) continue;
      v1::JobStats* stats = reply->add_jobs();
      stats->set_name(info.name);
      stats->set_job_key(info.key);
      stats->set_uid(info.uid);
      stats->set_params(info.params);
      stats->set_elements(info.elements);
      stats->set_buckets(info.buckets);
      stats->set_world_size(info.world_size);
      for (uint32_t rank : info.engine.attached_ranks) stats->add_attached_ranks(rank);
      stats->set_completed_step(info.completed_step);
      stats->set_state_bytes(info.state_bytes);
      stats->set_rank_bytes(info.rank_bytes);
      stats->set_updates(info.engine.updates);
      stats->set_nonfinite_steps(info.engine.nonfinite_steps);
      stats->set_state_halves(info.state_halves);
      stats->set_speculative_clipping(info.speculative_clipping);
      stats->set_speculative_steps(info.engine.speculative_steps);
      stats->set_redone_steps(info.engine.redone_steps);
      stats->mutable_transports()->insert(info.transports.begin(), info.transports.end());
      FillJobCounters(info, stats);
    }
    for (const OrphanedJob& orphan : registry_.Orphans()) {  // their memory is still in /dev/shm
      host_bytes += orphan.state_bytes;
      if (!visible(orphan.uid)) continue;
      v1::JobStats* stats = reply->add_jobs();
      stats->set_name(orphan.name);
      stats->set_job_key(orphan.key);
      stats->set_uid(orphan.uid);
      stats->set_completed_step(orphan.completed_step);
      stats->set_state_bytes(orphan.state_bytes);
      stats->set_state_halves(orphan.state_halves);
      stats->set_speculative_clipping(orphan.speculative_clipping);
      stats->set_host_bytes(orphan.state_bytes);
      stats->set_orphaned(true);
    }
    reply->set_host_bytes(host_bytes);
    reply->set_rss_bytes(ResidentBytes());
    reply->set_worker_threads(static_cast<uint32_t>(pool_.threads()));
    reply->set_kernel(optimizer::ActiveKernelName());
    reply->set_daemon_version(std::string(kVersion));
    reply->set_pid(getpid());
    reply->set_uptime_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    reply->set_pinned_bytes(PinnedHost::Instance().pinned_bytes());
    reply->set_max_host_bytes(registry_.config().max_host_bytes);
    reply->set_max_jobs(registry_.config().max_jobs);
    for (const auto& [label, counters] : ProcessCounters::Instance().Gpus()) {
      v1::GpuStats* gpu = reply->add_gpus();
      gpu->set_gpu(label);
      gpu->set_to_host_bytes(counters->to_host_bytes.load());
      gpu->set_to_device_bytes(counters->to_device_bytes.load());
    }
  });
}

grpc::Status ControlService::DropJob(grpc::ServerContext* context, const v1::DropJobRequest* request,
                                     v1::DropJobReply*) {
  return Guarded("DropJob", [&] {
    const uint32_t owner = OwnerNamed(Caller(*context), request->has_owner_uid(), request->owner_uid(), "drop");
    registry_.Drop(request->job(), owner, request->force());
  });
}

grpc::Status ControlService::Snapshot(grpc::ServerContext* context, const v1::SnapshotRequest* request,
                                      v1::SnapshotReply* reply) {
  return Guarded("Snapshot", [&] {
    const uint32_t uid = Caller(*context);
    const uint32_t owner = OwnerNamed(uid, request->has_owner_uid(), request->owner_uid(), "snapshot");
    const SnapshotWritten written =
        registry_.Get(request->job(), owner)->Snapshot(request->path(), uid, DeadlineOf(*context));
    reply->set_path(written.path);
    reply->set_step(written.step);
    reply->set_bytes(written.bytes);
  });
}

grpc::Status ControlService::Restore(grpc::ServerContext* context, const v1::RestoreRequest* request,
                                     v1::RestoreReply* reply) {
  return Guarded("Restore", [&] {
    const uint32_t uid = Caller(*context);
    const RestoresInProgress::Entry restoring(restores_, uid);
    // glibc keeps what a restore's header took in the arena of the gRPC thread it ran on: given back when
    // the restore ends, however it ends (after four restores of 16 MiB headers the daemon's resident
    // memory stayed at 116 MB, 57 MB with this; 18 MB before them).
    const struct TrimWhenDone {
      TrimWhenDone() = default;
      TrimWhenDone(const TrimWhenDone&) = delete;
      TrimWhenDone& operator=(const TrimWhenDone&) = delete;
      ~TrimWhenDone() { malloc_trim(0); }
    } trim;
    TS_CHECK(!request->path().empty() && request->path().front() == '/', Code::kInvalidArgument,
             "snapshot path '{}' must be an absolute path", request->path());
    std::unique_ptr<SnapshotFile> file;
    {
      const FileIdentity as_caller(uid);  // open only what the caller may read
      file = std::make_unique<SnapshotFile>(request->path(),
                                            RestoreOptions{.allow_nonfinite = request->allow_nonfinite(),
                                                           .cancelled = [context] { return context->IsCancelled(); }});
    }
    const SnapshotMeta& meta = file->meta();
    TS_CHECK(uid == 0 || uid == meta.uid, Code::kPermissionDenied,
             "snapshot '{}' is of a job of uid {}: only that uid or root may restore it (you are uid {})",
             request->path(), meta.uid, uid);
    const std::string name = request->job().empty() ? meta.job : request->job();
    registry_.Restore(name, uid == 0 ? meta.uid : uid, *file);
    reply->set_job(name);
    reply->set_step(meta.step);
  });
}

}  // namespace trainstream::daemon
