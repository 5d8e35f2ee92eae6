#include "daemon/peer_sender.h"

#include <fmt/format.h>

#include <cstring>
#include <utility>
#include <vector>

#include "daemon/peer_service.h"
#include "daemon/peer_wire.h"

namespace trainstream::daemon {

// Buffers for the outgoing copies of pieces, reused: a fresh allocation per piece would be mapped
// (page faults, zeroing) on every copy. A buffer returns when gRPC releases its slice, which may be
// after the call completed or the sender is gone; each buffer holds the pool alive until then.
class PeerSender::BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  grpc::Slice Copy(const float* data, size_t n) {
    auto* buffer = new Buffer{shared_from_this(), Take(n * sizeof(float))};
    std::memcpy(buffer->bytes.data(), data, n * sizeof(float));
    return {buffer->bytes.data(), n * sizeof(float), &Release, buffer};
  }

 private:
  struct Buffer {
    std::shared_ptr<BufferPool> pool;
    std::vector<uint8_t> bytes;
  };
  std::vector<uint8_t> Take(size_t bytes) {
    std::vector<uint8_t> buffer;
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        buffer = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (buffer.size() < bytes) buffer.resize(bytes);
    return buffer;
  }
  static void Release(void* user_data) {
    std::unique_ptr<Buffer> buffer(static_cast<Buffer*>(user_data));
    const std::shared_ptr<BufferPool> pool = std::move(buffer->pool);
    std::lock_guard lock(pool->mutex_);
    pool->free_.push_back(std::move(buffer->bytes));
  }

  std::mutex mutex_;
  std::vector<std::vector<uint8_t>> free_;
};

struct PeerSender::Call {
  grpc::ClientContext context;
  grpc::ByteBuffer request, response;
  uint64_t step = 0;
  uint32_t bucket = 0;
};

PeerSender::PeerSender(const std::shared_ptr<grpc::Channel>& channel, std::string peer, std::string secret,
                       std::chrono::milliseconds timeout, size_t window)
    : stub_(channel),
      pool_(std::make_shared<BufferPool>()),
      peer_(std::move(peer)),
      secret_(std::move(secret)),
      timeout_(timeout),
      window_(window) {}

PeerSender::~PeerSender() {
  Cancel();
  Finish();
}

void PeerSender::Post(v1::PeerChunk header, const float* data, size_t n) {
  std::unique_lock lock(mutex_);
  if (error_ || cancelled_) return;  // the reduction fails anyway
  queued_.push_back(Piece{std::move(header), data, n});
  StartQueued(lock);
}

void PeerSender::StartQueued(std::unique_lock<std::mutex>& lock) {
  while (!queued_.empty() && in_flight_.size() + starting_ < window_) {
    Piece piece = std::move(queued_.front());
    queued_.pop_front();
    ++starting_;
    lock.unlock();  // the copy into the message happens outside the lock
    Start(piece);
    lock.lock();
  }
}

void PeerSender::Start(const Piece& piece) {
  auto call = std::make_shared<Call>();
  call->request = EncodePiece(piece.header, pool_->Copy(piece.data, piece.n));
  call->step = piece.header.step();
  call->bucket = piece.header.bucket();
  call->context.AddMetadata(kSecretHeader, secret_);
  call->context.set_deadline(std::chrono::system_clock::now() + timeout_);
  bool cancelled = false;
  {
    std::lock_guard lock(mutex_);
    in_flight_.insert(call);
    --starting_;
    cancelled = cancelled_;
  }
  if (cancelled) call->context.TryCancel();  // Cancel ran while this call was starting
  stub_.UnaryCall(&call->context, kDeliverMethod, grpc::StubOptions(), &call->request, &call->response,
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
  if (queued_.empty() && in_flight_.empty() && starting_ == 0) idle_.notify_all();
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
  return idle_.wait_for(lock, timeout, [&] { return queued_.empty() && in_flight_.empty() && starting_ == 0; });
}

std::optional<std::string> PeerSender::Finish() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return queued_.empty() && in_flight_.empty() && starting_ == 0; });
  cancelled_ = false;
  return std::exchange(error_, std::nullopt);
}

}  // namespace trainstream::daemon
