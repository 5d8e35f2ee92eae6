#include "daemon/peer/peer_allreduce.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <algorithm>

#include "daemon/counters/counters.h"
#include "daemon/peer/peer_wire.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
constexpr uint32_t kReduceScatter = 0, kAllGather = 1;
// A chunk travels in fragments, so that sending, receiving and adding overlap: a quarter of the chunk,
// at least 128 KiB and at most 4 MiB (the last one shorter), over PeerConfig::connections to the
// right-hand peer (4 unless --peer-connections says otherwise) with 2 fragments in flight on each.
// Measured on loopback, one process per node, against gloo's bus bandwidth
// (benchmarks/results/allreduce_h200-16core-*.jsonl): on a 16-core machine one connection with
// fragments of at least 512 KiB was the limit below 128 MiB (1-32 MiB: 0.42-0.93x gloo); 4 connections
// with 128 KiB fragments: 8-128 MiB at 0.92-1.66x, 1 MiB at 0.58-0.96x. Fragments of 64 KiB, 2 or 8
// connections, 1 fragment in flight per connection, a 1 MiB HTTP/2 frame, and direct sends between all
// pairs instead of the ring (2 hops instead of 2(M-1), branch exp/conns) were no better overall.
// Every fragment is one call, and a call costs much CPU time in gRPC (2 cores, 128 MiB over 3 nodes:
// 48 ms of user time per node with 512 KiB fragments, 35 ms with 2 MiB, 29 ms with 8 MiB), so large
// chunks use large fragments: 128 MiB over 3 nodes took 180 ms with 4 MiB fragments against 261 ms with
// 512 KiB; beyond 4 MiB it gained nothing. On 2 cores, where the CPU is the limit, 4 connections
// with 128 KiB fragments were within run-to-run noise of one with 512 KiB, except 1 MiB over 3 nodes
// (0.66-0.75x gloo against 0.91-0.96x): more calls for the same bytes.
constexpr size_t kMinFragments = 4;
constexpr size_t kMinFragmentFloats = (size_t{128} << 10) / sizeof(float);
constexpr size_t kMaxFragmentFloats = kMaxFragmentBytes / sizeof(float);
constexpr size_t kInFlightPerConnection = 2;
constexpr std::chrono::milliseconds kPoll{50};  // how often a wait looks for failed sends and Stop

// A send that the right-hand peer did not take (PeerSender's message), if any.
std::optional<Error> SendFailure(std::optional<std::string> message) {
  if (!message) return std::nullopt;
  return Error(Code::kUnavailable, *message);
}

// How every node splits a bucket of n floats: M chunks [n*c/M, n*(c+1)/M), each in fragments of
// `fragment` floats (the last one shorter). Both ends of a fragment compute the same ranges.
struct Split {
  size_t n;
  uint32_t chunks;
  size_t fragment = std::clamp(n / (size_t{chunks} * kMinFragments), kMinFragmentFloats, kMaxFragmentFloats);

  std::pair<size_t, size_t> Chunk(int64_t c) const {
    const auto index = static_cast<size_t>(((c % chunks) + chunks) % chunks);
    return {n * index / chunks, n * (index + 1) / chunks};
  }
  uint32_t Fragments(std::pair<size_t, size_t> chunk) const {
    return static_cast<uint32_t>((chunk.second - chunk.first + fragment - 1) / fragment);
  }
  // Fragment p of `chunk`: its first element and its length.
  std::pair<size_t, size_t> Fragment(std::pair<size_t, size_t> chunk, uint32_t p) const {
    const size_t begin = chunk.first + p * fragment;
    return {begin, std::min(fragment, chunk.second - begin)};
  }
};
}  // namespace

PeerAllReduce::PeerAllReduce(std::string job, std::vector<std::string> peers, uint32_t node_rank, uint32_t buckets,
                             const PeerConfig& config)
    : job_{.name = std::move(job)},
      peers_(std::move(peers)),
      node_rank_(node_rank),
      buckets_(buckets),
      config_(config) {
  TS_CHECK(peers_.size() >= 2 && node_rank_ < peers_.size(), Code::kInvalidArgument,
           "a ring needs at least 2 nodes and this node among them ({} peers, node rank {})", peers_.size(),
           node_rank_);
  const uint32_t right = (node_rank_ + 1) % peers_.size();
  right_ = std::make_unique<PeerSender>(peers_[right], config_.connections,
                                        fmt::format("peer {} (node {})", peers_[right], right), config_.secret,
                                        config_.timeout, kInFlightPerConnection * config_.connections);
  job_ = config_.mailbox->Open(job_.name);
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
    return done(Error(Code::kAborted, reason));
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
  for (auto& [key, request] : queued) request.done(Error(Code::kAborted, reason));
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
  config_.mailbox->Close(job_);
  FailQueued(reason);
}

void PeerAllReduce::Dropped() {
  config_.mailbox->Drop(job_);
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
    const auto started = std::chrono::steady_clock::now();
    std::optional<Error> error = Reduce(key.first, key.second, request.data, request.n);
    Count(request.n, std::chrono::steady_clock::now() - started, error.has_value());
    request.done(std::move(error));
  }
}

// A ring all-reduce over M nodes sends 2(M-1)/M of the bucket from each node.
void PeerAllReduce::Count(size_t n, std::chrono::steady_clock::duration took, bool failed) const {
  PeerCounters& counters = ProcessCounters::Instance().peer();
  if (failed) return ProcessCounters::Instance().CountError(ErrorKind::kPeerAllReduce);
  const uint64_t nodes = peers_.size();
  counters.bytes_sent.fetch_add(2 * (nodes - 1) * n * sizeof(float) / nodes, std::memory_order_relaxed);
  counters.allreduce_seconds.Observe(std::chrono::duration<double>(took).count());
}

// Ring step s (0 <= s < 2(M-1)) sends chunk me-s to the right and receives chunk me-s-1 from the
// left: steps below M-1 are the reduce-scatter (the received values are added: after step s this
// node holds the sum of s+2 nodes' values of chunk me-s-1), the rest the all-gather (complete chunks
// are copied). What arrives in step s leaves in step s+1, fragment by fragment: the gRPC thread that
// received a fragment adds it and posts it on (Bucket::Arrived). A region is overwritten only by the
// all-gather, whose values left this node's sum earlier (the right-hand peer had received them,
// so they were read out of the bucket), so a posted fragment never changes before it was sent.
// Fragments of different steps that cover the same region arrive in ring order for the same reason.
struct PeerAllReduce::Bucket final : PeerSink {
  PeerAllReduce& ring;
  const uint64_t step;
  const uint32_t bucket;
  float* const data;
  const Split split;
  const uint32_t rounds = split.chunks - 1, ring_steps = 2 * rounds;
  std::vector<std::vector<bool>> seen;  // [ring step][fragment]

  std::mutex mutex;
  std::condition_variable changed;
  size_t left = 0;  // fragments still to arrive
  std::chrono::steady_clock::time_point progress = std::chrono::steady_clock::now();
  std::optional<Error> error;          // why this node gave the bucket up; later arrivals are told
  std::optional<std::string> refused;  // the last fragment refused, and why

  Bucket(PeerAllReduce& ring, uint64_t step, uint32_t bucket, float* data, size_t n)
      : ring(ring), step(step), bucket(bucket), data(data), split{n, static_cast<uint32_t>(ring.peers_.size())} {
    for (uint32_t s = 0; s < ring_steps; ++s) {
      seen.emplace_back(split.Fragments(Chunk(s)), false);
      left += seen.back().size();
    }
  }
  std::pair<size_t, size_t> Chunk(uint32_t ring_step) const {
    return split.Chunk(static_cast<int64_t>(ring.node_rank_) - ring_step - 1);
  }

  // A fragment that does not fit this node's bucket (a peer's layout differs, or a sender that is not
  // this job's left-hand node) is refused to its sender, who learns why; the bucket goes on, so one
  // wrong sender fails no reduction it is not part of. The refusal is logged naming the sender and
  // kept for the message of a reduction that then times out.
  void Arrived(Delivered fragment) override {
    try {
      Take(fragment);
    } catch (const Error& e) {
      if (e.code() != Code::kAborted) Refuse(fragment, e.what());
      throw;
    }
  }
  void Take(const Delivered& fragment) {
    const FragmentKey& key = fragment.key;
    const uint32_t sender = ring.Left();
    TS_CHECK(fragment.from_node == sender, Code::kInvalidArgument,
             "{} says it comes from node {}, but node {} ({}) is the one that sends to node {} in this job",
             Describe(key), fragment.from_node, sender, ring.peers_[sender], ring.node_rank_);
    TS_CHECK(key.round < rounds, Code::kInvalidArgument,
             "{} has no place on node {}: a bucket has {} rounds over {} nodes (peer lists differ?)", Describe(key),
             ring.node_rank_, rounds, ring.peers_.size());
    const uint32_t s = key.phase == kReduceScatter ? key.round : rounds + key.round;
    TS_CHECK(key.fragment < seen[s].size(), Code::kInvalidArgument,
             "{} has no place on node {}: that round has {} fragments there (layouts differ?)", Describe(key),
             ring.node_rank_, seen[s].size());
    const auto [begin, count] = split.Fragment(Chunk(s), key.fragment);
    TS_CHECK(PayloadBytes(fragment.data) == count * sizeof(float), Code::kInvalidArgument,
             "{} holds {} bytes; node {} expects {} (layouts differ?)", Describe(key), PayloadBytes(fragment.data),
             ring.node_rank_, count * sizeof(float));
    {
      std::lock_guard lock(mutex);
      if (error)
        Throw(Code::kAborted, "{} came after node {} gave up that bucket: {}", Describe(key), ring.node_rank_,
              error->what());
      TS_CHECK(!seen[s][key.fragment], Code::kAlreadyExists, "{} arrived twice", Describe(key));
      seen[s][key.fragment] = true;
    }
    ApplyPayload(fragment.data, data + begin, key.phase == kReduceScatter);
    if (s + 1 < ring_steps) ring.Post(step, bucket, s + 1, key.fragment, data + begin, count);
    std::lock_guard lock(mutex);
    progress = std::chrono::steady_clock::now();
    if (--left == 0) changed.notify_all();
  }
  void Refuse(const Delivered& fragment, const std::string& why) {  // whoever caught it logs and counts it
    std::lock_guard lock(mutex);
    refused = fmt::format("from {} (node {}): {}", fragment.sender, fragment.from_node, why);
  }
};

std::optional<Error> PeerAllReduce::Reduce(uint64_t step, uint32_t bucket, float* data, size_t n) {
  Bucket reduction(*this, step, bucket, data, n);
  const auto first = reduction.split.Chunk(node_rank_);
  for (uint32_t p = 0; p < reduction.split.Fragments(first); ++p) {
    const auto [begin, count] = reduction.split.Fragment(first, p);
    Post(step, bucket, 0, p, data + begin, count);
  }
  for (Delivered& fragment : config_.mailbox->Register(job_, step, bucket, &reduction)) {
    const std::string sender = fragment.sender;
    const uint32_t from_node = fragment.from_node;
    try {
      reduction.Arrived(std::move(fragment));
    } catch (const Error& e) {  // its sender was told it was kept; the bucket remembers why it was refused
      spdlog::warn("peer fragment from {} (node {}) refused: {}", sender, from_node, e.what());
      ProcessCounters::Instance().CountError(ErrorKind::kPeerFragment);
    }
  }
  std::optional<Error> error;
  {
    std::unique_lock lock(reduction.mutex);
    while (reduction.left > 0) {
      if (reduction.changed.wait_for(lock, kPoll, [&] { return reduction.left == 0; })) break;
      if (auto send_error = SendFailure(right_->Error())) {
        error = std::move(send_error);
        break;
      }
      if (Stopping()) {
        error = Error(Code::kAborted, "the job is being removed");
        break;
      }
      if (std::chrono::steady_clock::now() - reduction.progress >= config_.timeout) {
        const uint32_t left = Left();
        error = Error(Code::kUnavailable,
                      fmt::format("peer {} (node {}) sent nothing for bucket {} of step {} within {} ms{}",
                                  peers_[left], left, bucket, step, config_.timeout.count(),
                                  reduction.refused ? "; refused meanwhile a fragment " + *reduction.refused : ""));
        break;
      }
    }
    if (error) reduction.error = error;  // later arrivals are told
  }
  config_.mailbox->Unregister(job_, step, bucket);  // no thread posts any more
  if (error) return Fail(std::move(*error));
  // The last fragments may still be on their way to a peer that stopped answering: not past Stop.
  while (!right_->WaitIdle(kPoll)) {
    if (Stopping()) return Fail(Error(Code::kAborted, "the job is being removed"));
  }
  return SendFailure(right_->Finish());
}

// Stops the sends of a failed reduction; a failed send is the better message (it names the cause).
std::optional<Error> PeerAllReduce::Fail(Error error) {
  std::optional<Error> send_error = SendFailure(right_->Error());
  right_->Cancel();
  right_->Finish();
  return send_error ? std::move(send_error) : std::move(error);
}

void PeerAllReduce::Post(uint64_t step, uint32_t bucket, uint32_t ring_step, uint32_t fragment, const float* data,
                         size_t n) {
  const uint32_t rounds = static_cast<uint32_t>(peers_.size()) - 1;
  v1::PeerChunk header;
  header.set_job(job_.name);
  header.set_step(step);
  header.set_bucket(bucket);
  header.set_phase(ring_step < rounds ? kReduceScatter : kAllGather);
  header.set_round(ring_step % rounds);
  header.set_from_node(node_rank_);
  header.set_fragment(fragment);
  right_->Post(std::move(header), data, n);
}

bool PeerAllReduce::Stopping() {
  std::lock_guard lock(mutex_);
  return stopping_;
}

}  // namespace trainstream::daemon
