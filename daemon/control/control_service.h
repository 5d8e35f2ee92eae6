// The gRPC Control service (proto/trainstream/v1/control.proto): the boundary where trainstream::Error
// becomes grpc::Status. Every request field is validated before it reaches the registry.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <utility>

#include "daemon/control/identity_verifier.h"
#include "daemon/control/job_registry.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream::daemon {

class ControlService final : public v1::Control::Service {
 public:
  // `peer_address`: the advertised peer-plane address reported in Handshake; empty without a peer plane.
  ControlService(JobRegistry& registry, const WorkerPool& pool, std::string peer_address)
      : registry_(registry), pool_(pool), peer_address_(std::move(peer_address)) {}

  grpc::Status Handshake(grpc::ServerContext* context, const v1::HandshakeRequest* request,
                         v1::HandshakeReply* reply) override;
  grpc::Status Challenge(grpc::ServerContext* context, const v1::ChallengeRequest* request,
                         v1::ChallengeReply* reply) override;
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
  const std::string peer_address_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  IdentityVerifier identity_;
};

// Converts the wire layout into the shared one, validating enum values.
shm::LayoutSpec LayoutFromProto(const v1::LayoutSpec& proto);

}  // namespace trainstream::daemon
