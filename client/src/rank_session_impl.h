// The state behind a RankSession: the gRPC Session stream (the rank's lifetime and the daemon's
// liveness), the mapped segments, the rings, and what the completions have told us per bucket.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "shm/segment.h"
#include "trainstream/client.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream {

struct RankSession::Impl {
  static std::unique_ptr<Impl> Open(const std::shared_ptr<grpc::Channel>& channel, const std::string& job,
                                    uint32_t rank, const shm::LayoutSpec& spec, uint64_t seed,
                                    const RankTransport& transport, int64_t daemon_pid, WaitPolicy waits);
  ~Impl();

  void ReadEvents();  // the reader thread
  void Drain();       // requires mutex
  void Fail(const std::string& message);
  void NoticeDaemonGone();  // fails the session if the daemon's pid is gone
  void CheckHealthy();
  // params_ready, and its mirror in ready_words (both require mutex).
  void SetParamsReady(uint32_t bucket, int64_t step);
  void ForgetParamsReady();  // attach, registration, load: nothing published since
  // The GPU waits' watcher (MirrorParamsReady): drains the completions as they come, so that the
  // words follow PARAMS_READY while the trainer's thread is elsewhere (in a CUDA synchronize, say);
  // on failure, close or a wait past the timeout it releases the words and leaves.
  void WatchGpuWaits();
  [[nodiscard]] std::optional<std::string> OverdueGpuWait();  // requires mutex; forgets the met ones
  void ReleaseWords();                                        // requires mutex
  void StopWatcher();
  void Push(const shm::Message& message);
  // Waits until `ready()` (called under `mutex`, after draining the completions); `what()` names what
  // is awaited, for the progress and timeout messages.
  template <typename Ready, typename What>
  void WaitUntil(Ready ready, What what);
  // Who is missing, as the daemon sees the job: its ranks not attached, or a daemon that does not answer.
  std::string DescribeMissing();
  // The attach: maps the segments the daemon named.
  void Map(const v1::AttachReply& reply);

  std::string job;
  std::string job_key;
  WaitPolicy waits;
  std::unique_ptr<v1::Control::Stub> stub;
  shm::LayoutSpec spec;
  shm::JobLayout layout;
  uint32_t rank = 0;
  bool created = false, initialized = false;
  uint64_t completed_step = 0;
  int64_t daemon_pid = 0;

  shm::Segment state_segment, rank_segment;
  shm::StateView state{};
  shm::RankView view{};
  std::atomic<shm::Doorbell*> completion_doorbell{nullptr};  // once mapped: the reader thread rings it

  std::mutex mutex;  // guards the rings and the per-bucket bookkeeping
  shm::RingProducer requests;
  shm::RingConsumer completions;
  std::vector<int64_t> params_ready;                 // per bucket: last published step, -1 before the first
  std::vector<uint8_t> outstanding;                  // per bucket: grads sent, not yet released
  std::vector<uint8_t> staging_busy;                 // cuda-ipc, per staging slot: sent, not yet copied out
  std::map<uint64_t, RankSession::Norm> step_norms;  // kStepNorm, by step (the last few)
  std::pair<uint64_t, uint32_t> discarded{0, 0};     // the last kDiscarded: (step, how many times)
  std::shared_ptr<uint32_t> ready_words;             // per bucket: params_ready + 1 for the GPU; null: not mirrored
  bool words_released = false;                       // every word at kWordsReleased for good
  std::vector<int64_t> awaited_on_gpu;               // per bucket: the step a GPU stream waits for; -1: none
  std::vector<std::chrono::steady_clock::time_point> awaited_since;  // when that wait began
  std::thread watcher;

  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream;
  std::thread reader;
  std::atomic<bool> failed{false};
  std::atomic<bool> closing{false};
  std::mutex event_mutex;                   // guards the fields below
  std::optional<v1::AttachReply> attached;  // the daemon's answer to attach
  std::optional<grpc::Status> ended;        // the session's final status, once the stream ended
  std::condition_variable attach_answered;
  std::optional<std::string> failure;
  std::vector<std::string> warnings;
  std::optional<std::string> cuda_ipc_reply;  // the daemon's answer to RegisterCudaIpc
  std::condition_variable cuda_ipc_answered;
};

}  // namespace trainstream
