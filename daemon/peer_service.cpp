#include "daemon/peer_service.h"

#include <spdlog/spdlog.h>

namespace trainstream::daemon {

bool SecretsEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;  // reveals the length only
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

grpc::Status PeerService::Deliver(grpc::ServerContext* context, const v1::PeerChunk* chunk, v1::PeerAck*) {
  const auto& metadata = context->client_metadata();
  const auto secret = metadata.find(kSecretHeader);
  if (secret == metadata.end() || !SecretsEqual(std::string(secret->second.data(), secret->second.size()), secret_)) {
    spdlog::warn("peer call from {} refused: wrong or missing secret", context->peer());
    return {grpc::StatusCode::UNAUTHENTICATED, "wrong or missing peer secret"};
  }
  if (chunk->data().size() % sizeof(float) != 0 || chunk->phase() > 1) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "malformed peer chunk"};
  }
  mailbox_.Put(ChunkKey{chunk->job(), chunk->step(), chunk->bucket(), chunk->phase(), chunk->round()}, chunk->data());
  return grpc::Status::OK;
}

}  // namespace trainstream::daemon
