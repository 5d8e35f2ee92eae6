#include "daemon/peer_allreduce.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <future>

#include "daemon/peer_service.h"

namespace trainstream::daemon {

namespace {
constexpr uint32_t kReduceScatter = 0, kAllGather = 1;

// Chunk c of M over n elements: [begin, end).
std::pair<size_t, size_t> ChunkRange(size_t n, uint32_t chunks, uint32_t c) {
  return {n * c / chunks, n * (c + 1) / chunks};
}
}  // namespace

PeerAllReduce::PeerAllReduce(std::string job, std::vector<std::string> peers, uint32_t node_rank, uint32_t buckets,
                             const PeerConfig& config)
    : job_(std::move(job)), peers_(std::move(peers)), node_rank_(node_rank), buckets_(buckets), config_(config) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  const std::string& right = peers_[(node_rank_ + 1) % peers_.size()];
  right_ = v1::Peer::NewStub(grpc::CreateCustomChannel(right, grpc::InsecureChannelCredentials(), args));
  thread_ = std::thread([this] { Run(); });
}

PeerAllReduce::~PeerAllReduce() {
  Stop("the job was removed");
}

void PeerAllReduce::Submit(uint64_t step, uint32_t bucket, float* data, size_t n, Done done) {
  std::unique_lock lock(mutex_);
  if (stopped_) {  // the job is going away
    const std::string reason = *stopped_;
    lock.unlock();
    return done(reason);
  }
  pending_.emplace(std::make_pair(step, bucket), Request{data, n, std::move(done)});
  if (!next_) next_ = std::make_pair(step, 0u);
  lock.unlock();
  changed_.notify_all();
}

void PeerAllReduce::FailQueued(const std::string& reason) {
  std::map<std::pair<uint64_t, uint32_t>, Request> queued;
  {
    std::lock_guard lock(mutex_);
    queued.swap(pending_);
    next_.reset();
  }
  for (auto& [key, request] : queued) request.done(reason);
}

void PeerAllReduce::Reset(const std::string& reason) {
  FailQueued(reason);
}

void PeerAllReduce::Stop(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (stopped_) return;
    stopped_ = reason;
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
  FailQueued(reason);
}

void PeerAllReduce::Run() {
  for (;;) {
    std::pair<uint64_t, uint32_t> key;
    Request request{};
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || (next_ && pending_.contains(*next_)); });
      if (stopping_) return;
      key = *next_;
      request = std::move(pending_.extract(key).mapped());
      next_ = key.second + 1 < buckets_ ? std::make_pair(key.first, key.second + 1) : std::make_pair(key.first + 1, 0u);
    }
    request.done(Reduce(key.first, key.second, request.data, request.n));
  }
}

std::optional<std::string> PeerAllReduce::Reduce(uint64_t step, uint32_t bucket, float* data, size_t n) {
  const auto nodes = static_cast<uint32_t>(peers_.size());
  auto chunk = [&](int64_t c) { return static_cast<uint32_t>(((c % nodes) + nodes) % nodes); };
  const int64_t me = node_rank_;
  // One round: send chunk `out` to the right while receiving chunk `in` from the left (they differ,
  // so the two may overlap), adding it in (reduce-scatter) or taking it (all-gather).
  auto round_trip = [&](uint32_t phase, uint32_t round, uint32_t out, uint32_t in) -> std::optional<std::string> {
    const auto [send_begin, send_end] = ChunkRange(n, nodes, out);
    auto sent = std::async(std::launch::async, [&, send_begin = send_begin, send_end = send_end] {
      return Send(step, bucket, phase, round, data + send_begin, send_end - send_begin);
    });
    const auto [recv_begin, recv_end] = ChunkRange(n, nodes, in);
    auto received =
        Receive(step, bucket, phase, round, data + recv_begin, recv_end - recv_begin, phase == kReduceScatter);
    auto send_error = sent.get();
    return send_error ? send_error : received;
  };
  // Reduce-scatter: after round r, this node holds the sum of r+2 nodes' values of chunk me-r-1.
  for (uint32_t round = 0; round + 1 < nodes; ++round) {
    if (auto error = round_trip(kReduceScatter, round, chunk(me - round), chunk(me - round - 1))) return error;
  }
  // All-gather: chunk me+1 is complete here; pass complete chunks around the ring.
  for (uint32_t round = 0; round + 1 < nodes; ++round) {
    if (auto error = round_trip(kAllGather, round, chunk(me + 1 - round), chunk(me - round))) return error;
  }
  return std::nullopt;
}

std::optional<std::string> PeerAllReduce::Send(uint64_t step, uint32_t bucket, uint32_t phase, uint32_t round,
                                               const float* data, size_t n) {
  v1::PeerChunk chunk;
  chunk.set_job(job_);
  chunk.set_step(step);
  chunk.set_bucket(bucket);
  chunk.set_phase(phase);
  chunk.set_round(round);
  chunk.set_from_node(node_rank_);
  chunk.set_data(reinterpret_cast<const char*>(data), n * sizeof(float));
  grpc::ClientContext context;
  context.AddMetadata(kSecretHeader, config_.secret);
  context.set_deadline(std::chrono::system_clock::now() + config_.timeout);
  v1::PeerAck ack;
  const grpc::Status status = right_->Deliver(&context, chunk, &ack);
  if (status.ok()) return std::nullopt;
  return fmt::format("peer {} (node {}) did not take bucket {} of step {}: {}",
                     peers_[(node_rank_ + 1) % peers_.size()], (node_rank_ + 1) % peers_.size(), bucket, step,
                     status.error_message());
}

std::optional<std::string> PeerAllReduce::Receive(uint64_t step, uint32_t bucket, uint32_t phase, uint32_t round,
                                                  float* data, size_t n, bool add) {
  const auto payload = config_.mailbox->Take(ChunkKey{job_, step, bucket, phase, round}, config_.timeout);
  const uint32_t left = (node_rank_ + peers_.size() - 1) % peers_.size();
  if (!payload) {
    return fmt::format("peer {} (node {}) sent nothing for bucket {} of step {} within {} ms", peers_[left], left,
                       bucket, step, config_.timeout.count());
  }
  if (payload->size() != n * sizeof(float)) {
    return fmt::format("peer {} (node {}) sent {} bytes for a chunk of {} (layouts differ?)", peers_[left], left,
                       payload->size(), n * sizeof(float));
  }
  const auto* values = reinterpret_cast<const float*>(payload->data());
  if (add) {
    for (size_t i = 0; i < n; ++i) data[i] += values[i];
  } else {
    std::copy(values, values + n, data);
  }
  return std::nullopt;
}

}  // namespace trainstream::daemon
