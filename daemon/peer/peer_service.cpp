#include "daemon/peer/peer_service.h"

#include <malloc.h>
#include <spdlog/spdlog.h>

#include "daemon/counters/counters.h"
#include "daemon/grpc_status.h"
#include "shm/error.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

void KeepPeerBuffersMapped() {
  mallopt(M_MMAP_THRESHOLD, 4 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

bool SecretsEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;  // reveals the length only
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

grpc::ServerUnaryReactor* PeerService::Deliver(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  const grpc::Slice empty;  // a serialized PeerAck
  *response = grpc::ByteBuffer(&empty, 1);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(Store(*context, *request));
  return reactor;
}

grpc::Status PeerService::Store(grpc::CallbackServerContext& context, const grpc::ByteBuffer& request) {
  const std::string sender = connections_.NameOf(context);
  const auto& metadata = context.client_metadata();
  const auto secret = metadata.find(kSecretHeader);
  if (secret == metadata.end() || !SecretsEqual(std::string(secret->second.data(), secret->second.size()), secret_)) {
    spdlog::warn("peer call from {} refused: wrong or missing secret", sender);
    ProcessCounters::Instance().CountError(ErrorKind::kPeerFragment);
    return {grpc::StatusCode::UNAUTHENTICATED, "wrong or missing peer secret"};
  }
  connections_.Trust(context);
  try {
    v1::PeerChunk chunk;
    PeerPayload data = DecodeFragment(request, chunk);
    TS_CHECK(PayloadBytes(data) % sizeof(float) == 0, Code::kInvalidArgument,
             "peer chunk holds {} bytes, not a whole number of floats", PayloadBytes(data));
    TS_CHECK(chunk.phase() <= 1, Code::kInvalidArgument, "peer chunk of phase {} (0 or 1)", chunk.phase());
    TS_CHECK(!chunk.job().empty() && chunk.job().size() <= shm::kMaxJobName, Code::kInvalidArgument,
             "peer chunk's job name has {} characters (1 to {})", chunk.job().size(), shm::kMaxJobName);
    mailbox_.Put(Delivered{
        FragmentKey{chunk.job(), chunk.step(), chunk.bucket(), chunk.phase(), chunk.round(), chunk.fragment()},
        std::move(data), sender, chunk.from_node()});
  } catch (const Error& e) {
    spdlog::warn("peer fragment from {} refused: {}", sender, e.what());
    ProcessCounters::Instance().CountError(ErrorKind::kPeerFragment);
    return StatusOf(e);
  }
  return grpc::Status::OK;
}

}  // namespace trainstream::daemon
