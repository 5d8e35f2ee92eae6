#include "daemon/peer/peer_sender.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "daemon/peer/peer_service.h"
#include "daemon/peer/peer_wire.h"

namespace trainstream::daemon {

struct PeerSender::Call {
  grpc::ClientContext context;
  grpc::ByteBuffer request, response;
  uint64_t step = 0;
  uint32_t bucket = 0;
};

namespace {
// How long Finish waits for gRPC to release the slices of cancelled calls before it closes the
// connection to make it let go.
constexpr std::chrono::milliseconds kRelease{1000};
}  // namespace

PeerSender::PeerSender(std::string address, size_t connections, std::string peer, std::string secret,
                       std::chrono::milliseconds timeout, size_t window)
    : address_(std::move(address)),
      stubs_(std::max<size_t>(connections, 1)),
      peer_(std::move(peer)),
      secret_(std::move(secret)),
      timeout_(timeout),
      window_(window) {
  Connect();
}

PeerSender::~PeerSender() {
  Cancel();
  Finish();
}

void PeerSender::Connect() {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);       // a connection of its own per channel
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);  // a failed attempt is retried soon (Start)
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  for (auto& stub : stubs_) {
    stub = std::make_unique<grpc::GenericStub>(
        grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args));
  }
}

void PeerSender::Post(v1::PeerChunk header, const float* data, size_t n) {
  std::unique_lock lock(mutex_);
  if (error_ || cancelled_) return;  // the reduction fails anyway
  queued_.push_back(Fragment{std::move(header), data, n});
  StartQueued(lock);
}

void PeerSender::StartQueued(std::unique_lock<std::mutex>& lock) {
  while (!queued_.empty() && in_flight_.size() + starting_ < window_) {
    Fragment fragment = std::move(queued_.front());
    queued_.pop_front();
    ++starting_;
    lock.unlock();  // the copy into the message happens outside the lock
    Start(fragment);
    lock.lock();
  }
}

void PeerSender::Start(const Fragment& fragment) {
  auto call = std::make_shared<Call>();
  {
    std::lock_guard lock(mutex_);
    ++slices_;
  }
  // The bucket's memory itself; Released runs when gRPC (and the call's request) let go of it.
  call->request = EncodeFragment(fragment.header, grpc::Slice(const_cast<float*>(fragment.data),
                                                              fragment.n * sizeof(float), &PeerSender::Released, this));
  call->step = fragment.header.step();
  call->bucket = fragment.header.bucket();
  call->context.AddMetadata(kSecretHeader, secret_);
  call->context.set_deadline(std::chrono::system_clock::now() + timeout_);
  // A connection attempt among several opened at once may fail (seen on loopback): the channel
  // retries it, and the call waits for that until its deadline.
  call->context.set_wait_for_ready(true);
  bool cancelled = false;
  grpc::GenericStub* stub = nullptr;
  {
    std::lock_guard lock(mutex_);
    in_flight_.insert(call);
    --starting_;
    cancelled = cancelled_;
    stub = stubs_[next_stub_++ % stubs_.size()].get();
  }
  if (cancelled) call->context.TryCancel();  // Cancel ran while this call was starting
  stub->UnaryCall(&call->context, kDeliverMethod, grpc::StubOptions(), &call->request, &call->response,
                  [this, call](const grpc::Status& status) { Done(call, status); });
}

void PeerSender::Done(const std::shared_ptr<Call>& call, const grpc::Status& status) {
  std::unique_lock lock(mutex_);
  in_flight_.erase(call);
  if (!status.ok() && !error_) {
    error_ = fmt::format("{} did not take bucket {} of step {}: {}", peer_, call->bucket, call->step,
                         status.error_message());
  }
  if (error_) queued_.clear();
  StartQueued(lock);
  if (Idle()) idle_.notify_all();
}

void PeerSender::Released(void* sender) {
  auto* self = static_cast<PeerSender*>(sender);
  std::lock_guard lock(self->mutex_);
  if (--self->slices_ == 0 && self->Idle()) self->idle_.notify_all();
}

std::optional<std::string> PeerSender::Error() {
  std::lock_guard lock(mutex_);
  return error_;
}

void PeerSender::Cancel() {
  std::vector<std::shared_ptr<Call>> calls;
  {
    std::lock_guard lock(mutex_);
    cancelled_ = true;
    queued_.clear();
    calls.assign(in_flight_.begin(), in_flight_.end());
  }
  for (const auto& call : calls) call->context.TryCancel();  // outside the lock: Done may run inline
}

bool PeerSender::WaitIdle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return idle_.wait_for(lock, timeout, [&] { return Idle(); });
}

std::optional<std::string> PeerSender::Finish() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return queued_.empty() && in_flight_.empty() && starting_ == 0; });
  if (!idle_.wait_for(lock, kRelease, [&] { return slices_ == 0; })) {
    // Bytes of cancelled calls wait in the connection's output (the peer stopped reading): closing
    // the connection drops them. The channel shares no connection (Connect), so dropping the
    // last reference to it closes it.
    lock.unlock();
    for (auto& stub : stubs_) stub.reset();
    lock.lock();
    idle_.wait(lock, [&] { return slices_ == 0; });
    lock.unlock();
    Connect();
    lock.lock();
  }
  cancelled_ = false;
  return std::exchange(error_, std::nullopt);
}

}  // namespace trainstream::daemon
