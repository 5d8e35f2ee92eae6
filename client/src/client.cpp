// Client: the control-plane calls (handshake, stats, drop) over gRPC on the Unix socket.
#include "trainstream/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include "client/src/bounded_wait.h"
#include "client/src/grpc_status.h"
#include "client/src/proto_records.h"
#include "client/src/rank_session_impl.h"
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

Client::Client(std::string socket_path, std::unique_ptr<Impl> impl, WaitPolicy waits)
    : socket_path_(std::move(socket_path)), waits_(std::move(waits)), impl_(std::move(impl)) {}

Client::~Client() = default;

namespace {
using CallDone = std::function<void(grpc::Status)>;

// A unary call of the Control service, which `start(context, done)` begins: interruptible, bounded by
// `timeout`.
template <typename Start>
void Call(std::chrono::milliseconds timeout, const WaitPolicy& waits, const std::string& what, Start start) {
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  ThrowIfFailed(WaitForCall(context, waits.interrupt, [&](CallDone done) { start(&context, std::move(done)); }), what);
}

// The version handshake, which is also the ping.
DaemonInfo Handshake(v1::Control::Stub& stub, std::chrono::milliseconds timeout, const WaitPolicy& waits,
                     const std::string& what) {
  v1::HandshakeRequest request;
  request.set_protocol_version(kProtocolVersion);
  request.set_client_version(std::string(kVersion));
  v1::HandshakeReply reply;
  Call(timeout, waits, what, [&](grpc::ClientContext* context, CallDone done) {
    stub.async()->Handshake(context, &request, &reply, std::move(done));
  });
  return proto_records::FromProto<DaemonInfo>(reply);
}

}  // namespace

std::shared_ptr<Client> Client::Connect(const std::string& socket_path, std::chrono::milliseconds timeout,
                                        WaitPolicy waits) {
  auto impl = std::make_unique<Impl>();
  impl->channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
  impl->stub = v1::Control::NewStub(impl->channel);
  std::shared_ptr<Client> client(new Client(socket_path, std::move(impl), std::move(waits)));
  client->info_ = Handshake(*client->impl_->stub, timeout, client->waits_,
                            fmt::format("cannot reach trainstreamd at {}", socket_path));
  return client;
}

DaemonInfo Client::Ping() {
  return Handshake(*impl_->stub, std::chrono::seconds(5), waits_, "ping");
}

StatsReport Client::Stats() {
  v1::StatsReply reply;
  const v1::StatsRequest request;
  Call(kRpcTimeout, waits_, "stats", [&](grpc::ClientContext* context, CallDone done) {
    impl_->stub->async()->Stats(context, &request, &reply, std::move(done));
  });
  return proto_records::FromProto<StatsReport>(reply);
}

void Client::DropJob(const std::string& job, bool force, std::optional<uint32_t> owner_uid) {
  v1::DropJobRequest request;
  request.set_job(job);
  request.set_force(force);
  if (owner_uid) request.set_owner_uid(*owner_uid);
  v1::DropJobReply reply;
  Call(kRpcTimeout, waits_, fmt::format("drop job '{}'", job), [&](grpc::ClientContext* context, CallDone done) {
    impl_->stub->async()->DropJob(context, &request, &reply, std::move(done));
  });
}

SnapshotReport Client::Snapshot(const std::string& job, const std::string& path, std::chrono::milliseconds timeout,
                                std::optional<uint32_t> owner_uid) {
  v1::SnapshotRequest request;
  request.set_job(job);
  request.set_path(path);
  if (owner_uid) request.set_owner_uid(*owner_uid);
  v1::SnapshotReply reply;
  Call(timeout, waits_, fmt::format("snapshot of job '{}'", job), [&](grpc::ClientContext* context, CallDone done) {
    impl_->stub->async()->Snapshot(context, &request, &reply, std::move(done));
  });
  return SnapshotReport{reply.path(), reply.step(), reply.bytes()};
}

RestoreReport Client::Restore(const std::string& path, const std::string& job, bool allow_nonfinite) {
  v1::RestoreRequest request;
  request.set_path(path);
  request.set_job(job);
  request.set_allow_nonfinite(allow_nonfinite);
  v1::RestoreReply reply;
  Call(std::chrono::minutes(10),  // a large state takes a while
       waits_, fmt::format("restore from '{}'", path), [&](grpc::ClientContext* context, CallDone done) {
         impl_->stub->async()->Restore(context, &request, &reply, std::move(done));
       });
  return RestoreReport{reply.job(), reply.step()};
}

std::unique_ptr<RankSession> Client::Attach(const std::string& job, uint32_t rank, const shm::LayoutSpec& spec,
                                            uint64_t seed, const RankTransport& transport,
                                            std::optional<std::chrono::milliseconds> wait_timeout) {
  WaitPolicy waits = waits_;
  if (wait_timeout) waits.timeout = *wait_timeout;
  return std::make_unique<RankSession>(
      RankSession::Impl::Open(impl_->channel, job, rank, spec, seed, transport, info_.pid, std::move(waits)));
}

}  // namespace trainstream
