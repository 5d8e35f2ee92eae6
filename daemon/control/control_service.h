// The gRPC Control service (proto/trainstream/v1/control.proto): the boundary where trainstream::Error
// becomes grpc::Status. Every request field is validated before it reaches the registry. The caller's
// uid comes from the connection (daemon/control/control_socket.h), never from the request.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "daemon/control/job_registry.h"
#include "daemon/control/restores_in_progress.h"
#include "daemon/control/unattached_sessions.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream::daemon {

// The uid of the process a call came from (ControlSocket::CallerOf); nullopt: unknown.
using CallerUid = std::function<std::optional<uint32_t>(const grpc::ServerContext&)>;

class ControlService final : public v1::Control::Service {
 public:
  // `peer_address`: the advertised peer-plane address reported in Handshake; empty without a peer plane.
  // The limits on unattached sessions come from `config`.
  ControlService(JobRegistry& registry, const WorkerPool& pool, std::string peer_address, CallerUid caller_uid,
                 const Config& config)
      : registry_(registry),
        pool_(pool),
        peer_address_(std::move(peer_address)),
        caller_uid_(std::move(caller_uid)),
        unattached_(config.max_unattached_sessions, config.max_unattached_sessions_per_uid) {}

  grpc::Status Handshake(grpc::ServerContext* context, const v1::HandshakeRequest* request,
                         v1::HandshakeReply* reply) override;
  grpc::Status Session(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) override;
  grpc::Status Stats(grpc::ServerContext* context, const v1::StatsRequest* request, v1::StatsReply* reply) override;
  grpc::Status DropJob(grpc::ServerContext* context, const v1::DropJobRequest* request,
                       v1::DropJobReply* reply) override;
  grpc::Status Snapshot(grpc::ServerContext* context, const v1::SnapshotRequest* request,
                        v1::SnapshotReply* reply) override;
  grpc::Status Restore(grpc::ServerContext* context, const v1::RestoreRequest* request,
                       v1::RestoreReply* reply) override;

 private:
  JobRegistry& registry_;
  const WorkerPool& pool_;
  // kPermissionDenied for a call whose connection this daemon did not accept.
  uint32_t Caller(const grpc::ServerContext& context) const;
  // A session of `uid` from its first message on; `unattached` counts it until the attach is answered.
  grpc::Status RunSession(grpc::ServerContext* context,
                          grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream, uint32_t uid,
                          UnattachedSessions::Entry& unattached);

  const std::string peer_address_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  const CallerUid caller_uid_;
  UnattachedSessions unattached_;
  RestoresInProgress restores_;
};

}  // namespace trainstream::daemon
