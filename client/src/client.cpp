// Client: the control-plane calls (handshake, stats, drop) over gRPC on the Unix socket.
#include "trainstream/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include "client/src/grpc_status.h"
#include "client/src/rank_session_impl.h"
#include "shm/identity_proof.h"
#include "shm/version.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream {

namespace {
constexpr auto kRpcTimeout = std::chrono::seconds(30);

void SetDeadline(grpc::ClientContext& context, std::chrono::milliseconds timeout) {
  context.set_deadline(std::chrono::system_clock::now() + timeout);
}
}  // namespace

struct Client::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
};

Client::Client(std::string socket_path, std::unique_ptr<Impl> impl)
    : socket_path_(std::move(socket_path)), impl_(std::move(impl)) {}

Client::~Client() = default;

namespace {
// The version handshake, which is also the ping.
DaemonInfo Handshake(v1::Control::Stub& stub, std::chrono::milliseconds timeout, const std::string& what) {
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  v1::HandshakeRequest request;
  request.set_protocol_version(kProtocolVersion);
  request.set_client_version(std::string(kVersion));
  v1::HandshakeReply reply;
  ThrowIfFailed(stub.Handshake(&context, request, &reply), what);
  return DaemonInfo{reply.daemon_version(), reply.protocol_version(), reply.pid(), reply.kernel(),
                    reply.peer_address()};
}

// Proves this process's uid for the next uid-bound request (shm/identity_proof.h); the returned
// guard removes the proof file if the daemon did not consume it.
class IdentityProof {
 public:
  explicit IdentityProof(v1::Control::Stub& stub) {
    grpc::ClientContext context;
    SetDeadline(context, kRpcTimeout);
    v1::ChallengeReply reply;
    ThrowIfFailed(stub.Challenge(&context, v1::ChallengeRequest(), &reply), "identity challenge");
    nonce_ = reply.nonce();
    shm::CreateProof(nonce_);
  }
  ~IdentityProof() { unlink(shm::ProofPath(nonce_).c_str()); }
  IdentityProof(const IdentityProof&) = delete;
  IdentityProof& operator=(const IdentityProof&) = delete;
  [[nodiscard]] const std::string& nonce() const { return nonce_; }

 private:
  std::string nonce_;
};
// A request that needs the caller's uid (drop, snapshot, restore): proves it, names the proof in the
// request, and returns the reply or throws.
template <typename Reply, typename Request, typename Method>
Reply CallAsCaller(v1::Control::Stub& stub, Method method, Request request, std::chrono::milliseconds timeout,
                   const std::string& what) {
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  const IdentityProof proof(stub);
  request.set_nonce(proof.nonce());
  Reply reply;
  ThrowIfFailed((stub.*method)(&context, request, &reply), what);
  return reply;
}
}  // namespace

std::shared_ptr<Client> Client::Connect(const std::string& socket_path, std::chrono::milliseconds timeout) {
  auto impl = std::make_unique<Impl>();
  impl->channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
  impl->stub = v1::Control::NewStub(impl->channel);
  std::shared_ptr<Client> client(new Client(socket_path, std::move(impl)));
  client->info_ = Handshake(*client->impl_->stub, timeout, fmt::format("cannot reach trainstreamd at {}", socket_path));
  return client;
}

DaemonInfo Client::Ping() {
  return Handshake(*impl_->stub, std::chrono::seconds(5), "ping");
}

StatsReport Client::Stats() {
  grpc::ClientContext context;
  SetDeadline(context, kRpcTimeout);
  v1::StatsReply reply;
  ThrowIfFailed(impl_->stub->Stats(&context, v1::StatsRequest(), &reply), "stats");
  StatsReport report{.jobs = {},
                     .host_bytes = reply.host_bytes(),
                     .rss_bytes = reply.rss_bytes(),
                     .worker_threads = reply.worker_threads(),
                     .kernel = reply.kernel(),
                     .daemon_version = reply.daemon_version(),
                     .pid = reply.pid(),
                     .uptime_seconds = reply.uptime_seconds(),
                     .pinned_bytes = reply.pinned_bytes(),
                     .max_host_bytes = reply.max_host_bytes(),
                     .max_jobs = reply.max_jobs(),
                     .gpus = {}};
  for (const v1::GpuStats& gpu : reply.gpus()) {
    report.gpus.push_back(GpuReport{gpu.gpu(), gpu.to_host_bytes(), gpu.to_device_bytes()});
  }
  for (const v1::JobStats& job : reply.jobs()) {
    report.jobs.push_back(JobReport{
        .name = job.name(),
        .job_key = job.job_key(),
        .uid = job.uid(),
        .buckets = job.buckets(),
        .world_size = job.world_size(),
        .state_halves = job.state_halves(),
        .params = job.params(),
        .elements = job.elements(),
        .completed_step = job.completed_step(),
        .state_bytes = job.state_bytes(),
        .rank_bytes = job.rank_bytes(),
        .updates = job.updates(),
        .nonfinite_steps = job.nonfinite_steps(),
        .speculative_steps = job.speculative_steps(),
        .redone_steps = job.redone_steps(),
        .speculative_clipping = job.speculative_clipping(),
        .attached_ranks = {job.attached_ranks().begin(), job.attached_ranks().end()},
        .transports = {job.transports().begin(), job.transports().end()},
        .orphaned = job.orphaned(),
        .steps = job.steps(),
        .update_seconds = job.update_seconds(),
        .last_update_unix_ms = job.last_update_unix_ms(),
        .last_step_unix_ms = job.last_step_unix_ms(),
        .host_bytes = job.host_bytes(),
        .pinned_bytes = job.pinned_bytes(),
        .last_snapshot = job.last_snapshot(),
        .last_snapshot_step = job.last_snapshot_step(),
    });
  }
  return report;
}

void Client::DropJob(const std::string& job, bool force) {
  v1::DropJobRequest request;
  request.set_job(job);
  request.set_force(force);
  CallAsCaller<v1::DropJobReply>(*impl_->stub, &v1::Control::Stub::DropJob, request, kRpcTimeout,
                                 fmt::format("drop job '{}'", job));
}

SnapshotReport Client::Snapshot(const std::string& job, const std::string& path, std::chrono::milliseconds timeout) {
  v1::SnapshotRequest request;
  request.set_job(job);
  request.set_path(path);
  const auto reply = CallAsCaller<v1::SnapshotReply>(*impl_->stub, &v1::Control::Stub::Snapshot, request, timeout,
                                                     fmt::format("snapshot of job '{}'", job));
  return SnapshotReport{reply.path(), reply.step(), reply.bytes()};
}

RestoreReport Client::Restore(const std::string& path, const std::string& job) {
  v1::RestoreRequest request;
  request.set_path(path);
  request.set_job(job);
  const auto reply = CallAsCaller<v1::RestoreReply>(*impl_->stub, &v1::Control::Stub::Restore, request,
                                                    std::chrono::minutes(10),  // a large state takes a while
                                                    fmt::format("restore from '{}'", path));
  return RestoreReport{reply.job(), reply.step()};
}

std::unique_ptr<RankSession> Client::Attach(const std::string& job, uint32_t rank, const shm::LayoutSpec& spec,
                                            uint64_t seed, const RankTransport& transport) {
  const IdentityProof proof(*impl_->stub);
  return std::make_unique<RankSession>(
      RankSession::Impl::Open(*impl_->stub, job, rank, spec, seed, transport, proof.nonce(), info_.pid));
}

}  // namespace trainstream
