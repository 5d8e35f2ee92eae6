// The C++ client of trainstreamd: connect over the control socket, attach a rank of a job, and drive
// the data plane (rings and the job's shared-memory regions).
//
// This header is free of gRPC, CUDA and torch types: the Python layer (and C++ training programs)
// hand it raw pointers, sizes and dtypes. Errors are thrown as trainstream::Error; a daemon that dies
// or refuses turns every later call (and every wait in progress, within about 100 ms) into an Error.
// No call blocks for good: every wait gives up after its WaitPolicy's timeout, and runs the policy's
// interrupt check at least every kWaitSlice.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shm/cuda_ipc_export.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/message.h"

namespace trainstream {

namespace cuda {
class PrimaryContext;  // shm/cuda_driver.h; only the implementations of the GPU memory classes see it
}  // namespace cuda

// The daemon's replies as the client shows them. Each record lists its fields once, under their names in
// proto/trainstream/v1/control.proto, in VisitFields(record, visit), which calls visit(name, field) for
// each: the client fills them from the reply by those names (client/src/proto_records.h), the Python
// module makes its dicts from them, and tests/cpp/client/proto_records_test.cpp checks that the list
// and the proto name the same fields. A new field: the proto, the daemon's fill, a member here and its
// line in VisitFields.
struct DaemonInfo {
  std::string daemon_version;
  uint32_t protocol_version = 0;
  int64_t pid = 0;
  std::string kernel;
  std::string peer_address;  // the daemon's advertised peer-plane address; empty: no peer plane

  template <typename Self, typename Visit>
  static void VisitFields(Self& r, Visit&& visit) {
    visit("daemon_version", r.daemon_version);
    visit("protocol_version", r.protocol_version);
    visit("pid", r.pid);
    visit("kernel", r.kernel);
    visit("peer_address", r.peer_address);
  }
};

struct JobReport {
  std::string name, job_key;
  uint32_t uid = 0, buckets = 0, world_size = 0, state_halves = 1;
  uint64_t params = 0, elements = 0, completed_step = 0, state_bytes = 0, rank_bytes = 0, updates = 0,
           nonfinite_steps = 0, speculative_steps = 0, redone_steps = 0;
  bool speculative_clipping = false;
  std::vector<uint32_t> attached_ranks;
  std::map<uint32_t, std::string> transports;  // attached rank -> "transport on device"
  bool orphaned = false;                       // left by a daemon that died, not re-adopted yet
  // Counters since the daemon took the job: rates come from two readings.
  uint64_t steps = 0;
  double update_seconds = 0;                               // time in bucket updates, summed
  int64_t last_update_unix_ms = 0, last_step_unix_ms = 0;  // 0: none yet
  uint64_t host_bytes = 0, pinned_bytes = 0;
  std::string last_snapshot;  // empty: none
  uint64_t last_snapshot_step = 0;

  template <typename Self, typename Visit>
  static void VisitFields(Self& r, Visit&& visit) {
    visit("name", r.name);
    visit("job_key", r.job_key);
    visit("uid", r.uid);
    visit("buckets", r.buckets);
    visit("world_size", r.world_size);
    visit("state_halves", r.state_halves);
    visit("params", r.params);
    visit("elements", r.elements);
    visit("completed_step", r.completed_step);
    visit("state_bytes", r.state_bytes);
    visit("rank_bytes", r.rank_bytes);
    visit("updates", r.updates);
    visit("nonfinite_steps", r.nonfinite_steps);
    visit("speculative_steps", r.speculative_steps);
    visit("redone_steps", r.redone_steps);
    visit("speculative_clipping", r.speculative_clipping);
    visit("attached_ranks", r.attached_ranks);
    visit("transports", r.transports);
    visit("orphaned", r.orphaned);
    visit("steps", r.steps);
    visit("update_seconds", r.update_seconds);
    visit("last_update_unix_ms", r.last_update_unix_ms);
    visit("last_step_unix_ms", r.last_step_unix_ms);
    visit("host_bytes", r.host_bytes);
    visit("pinned_bytes", r.pinned_bytes);
    visit("last_snapshot", r.last_snapshot);
    visit("last_snapshot_step", r.last_snapshot_step);
  }
};

// Bytes the daemon copied with one GPU (cuda-ipc) since it started.
struct GpuReport {
  std::string gpu;  // "GPU-<uuid>"
  uint64_t to_host_bytes = 0, to_device_bytes = 0;

  template <typename Self, typename Visit>
  static void VisitFields(Self& r, Visit&& visit) {
    visit("gpu", r.gpu);
    visit("to_host_bytes", r.to_host_bytes);
    visit("to_device_bytes", r.to_device_bytes);
  }
};

struct SnapshotReport {
  std::string path;
  uint64_t step = 0, bytes = 0;
};

struct RestoreReport {
  std::string job;
  uint64_t step = 0;
};

// How a rank moves its data, told to the daemon at attach (which logs it and shows it in Stats).
struct RankTransport {
  std::string name = "host";   // "host", "cuda-ipc" or "cuda-client-copy"
  std::string device = "cpu";  // where the parameters live, e.g. "cuda:0 (NVIDIA H200, GPU-...)"
};

// What a cuda-ipc rank exports to the daemon, under the name python/src/module.cpp knows it by.
using CudaIpcBuffers = shm::CudaIpcExport;

// Device memory allocated with the driver, outside any framework's allocator, so that it can be
// exported by a CUDA IPC handle whatever that allocator's settings (expandable segments included).
class GpuBuffer {
 public:
  GpuBuffer(int device_ordinal, size_t bytes);  // in the device's primary context (torch's)
  ~GpuBuffer();
  GpuBuffer(const GpuBuffer&) = delete;
  GpuBuffer& operator=(const GpuBuffer&) = delete;
  [[nodiscard]] uint64_t address() const { return address_; }
  [[nodiscard]] size_t bytes() const { return bytes_; }
  [[nodiscard]] std::string ipc_handle() const;

 private:
  size_t bytes_;
  std::unique_ptr<cuda::PrimaryContext> context_;  // retained while the buffer lives
  uint64_t address_ = 0;
};

// Host memory of this process page-locked for the GPUs (cuMemHostRegister, portable), so that copies
// between it and device memory run at PCIe speed, until this is destroyed. The range must not be
// registered already, by this or another PinnedHostRange.
class PinnedHostRange {
 public:
  PinnedHostRange(int device_ordinal, uint64_t address, size_t bytes);  // in the device's primary context
  ~PinnedHostRange();
  PinnedHostRange(const PinnedHostRange&) = delete;
  PinnedHostRange& operator=(const PinnedHostRange&) = delete;
  [[nodiscard]] uint64_t address() const { return address_; }
  [[nodiscard]] size_t bytes() const { return bytes_; }

 private:
  uint64_t address_;
  size_t bytes_;
  std::unique_ptr<cuda::PrimaryContext> context_;  // retained while the range is registered
};

// Page-locked host words that a GPU reads (cuMemHostAlloc, mapped into the device's primary context):
// a RankSession mirrors its PARAMS_READY into them (MirrorParamsReady), and torch's streams wait on
// them, so that the forward's kernels are queued while the daemon still updates the weights they read.
class HostMappedWords {
 public:
  HostMappedWords(int device_ordinal, size_t count);  // zeroed
  ~HostMappedWords();
  HostMappedWords(const HostMappedWords&) = delete;
  HostMappedWords& operator=(const HostMappedWords&) = delete;
  [[nodiscard]] uint32_t* words() const { return words_; }
  [[nodiscard]] size_t count() const { return count_; }
  // Queues on `stream` (a CUstream of the device's primary context: torch's) a wait until word `index`
  // reaches `value`, compared as the driver does: (int32_t)(word - value) >= 0.
  void QueueWait(uint64_t stream, size_t index, uint32_t value) const;

 private:
  uint32_t* words_ = nullptr;
  uint64_t device_address_ = 0;
  size_t count_;
  std::unique_ptr<cuda::PrimaryContext> context_;
};

// Every blocking call (a wait for the daemon, an RPC, an attach) waits in slices of at most
// kWaitSlice; between two it calls `interrupt`, which may throw to abandon the wait (the Python module
// raises KeyboardInterrupt through it). A wait whose condition has not come true after `timeout`
// throws kDeadlineExceeded naming what it waited for and who is missing (ranks of the job not
// attached, a daemon that does not answer); every tenth of the timeout before that (at least 1 s, at
// most 30 s), `progress` gets the same description.
inline constexpr std::chrono::milliseconds kWaitSlice{50};
struct WaitPolicy {
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  std::function<void()> interrupt;                   // may throw; none: nothing to check
  std::function<void(const std::string&)> progress;  // none: no progress messages
};

struct StatsReport {
  std::vector<JobReport> jobs;
  uint64_t host_bytes = 0, rss_bytes = 0;
  uint32_t worker_threads = 0;
  std::string kernel;
  std::string daemon_version;
  int64_t pid = 0;
  double uptime_seconds = 0;
  uint64_t pinned_bytes = 0, max_host_bytes = 0;  // max_host_bytes 0: no quota
  uint32_t max_jobs = 0;
  std::vector<GpuReport> gpus;

  template <typename Self, typename Visit>
  static void VisitFields(Self& r, Visit&& visit) {
    visit("jobs", r.jobs);
    visit("host_bytes", r.host_bytes);
    visit("rss_bytes", r.rss_bytes);
    visit("worker_threads", r.worker_threads);
    visit("kernel", r.kernel);
    visit("daemon_version", r.daemon_version);
    visit("pid", r.pid);
    visit("uptime_seconds", r.uptime_seconds);
    visit("pinned_bytes", r.pinned_bytes);
    visit("max_host_bytes", r.max_host_bytes);
    visit("max_jobs", r.max_jobs);
    visit("gpus", r.gpus);
  }
};

class RankSession;

class Client {
 public:
  // Connects to the daemon on the Unix socket `socket_path` and performs the version handshake.
  // kUnavailable if nothing answers within `timeout`. `waits`: how this client's calls and its
  // sessions wait (a session's timeout may be set at Attach).
  static std::shared_ptr<Client> Connect(const std::string& socket_path,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(5),
                                         WaitPolicy waits = {});
  ~Client();

  [[nodiscard]] const DaemonInfo& info() const { return info_; }
  [[nodiscard]] const std::string& socket_path() const { return socket_path_; }
  DaemonInfo Ping();
  StatsReport Stats();
  // Drops this uid's job `job`; root may name another owner.
  void DropJob(const std::string& job, bool force, std::optional<uint32_t> owner_uid = std::nullopt);
  // Writes this uid's job `job`'s state to `path` as the daemon sees it (empty: its --snapshot-dir), at
  // the job's next step boundary if ranks train it (at once if they are between steps); waits at most
  // `timeout`. Root may name another owner.
  SnapshotReport Snapshot(const std::string& job, const std::string& path,
                          std::chrono::milliseconds timeout = std::chrono::minutes(10),
                          std::optional<uint32_t> owner_uid = std::nullopt);
  // Recreates a job of this uid from a snapshot file (named `job`, or as in the snapshot if empty).
  // `allow_nonfinite`: also if its master weights or moments hold inf or NaN (refused otherwise).
  RestoreReport Restore(const std::string& path, const std::string& job = "", bool allow_nonfinite = false);
  // Creates the job if needed and attaches `rank`; the rank stays attached until the session closes.
  // `wait_timeout` replaces the client's for the session's waits (the attach itself included).
  std::unique_ptr<RankSession> Attach(const std::string& job, uint32_t rank, const shm::LayoutSpec& spec, uint64_t seed,
                                      const RankTransport& transport = {},
                                      std::optional<std::chrono::milliseconds> wait_timeout = std::nullopt);

  struct Impl;

 private:
  Client(std::string socket_path, std::unique_ptr<Impl> impl, WaitPolicy waits);
  std::string socket_path_;
  WaitPolicy waits_;
  std::unique_ptr<Impl> impl_;
  DaemonInfo info_;
};

class RankSession {
 public:
  ~RankSession();  // detaches
  RankSession(const RankSession&) = delete;
  RankSession& operator=(const RankSession&) = delete;

  // The job's layout, with what the daemon decided (state halves, speculation) filled in.
  [[nodiscard]] const shm::LayoutSpec& spec() const;
  [[nodiscard]] const shm::JobLayout& layout() const;
  [[nodiscard]] uint32_t rank() const;
  [[nodiscard]] bool created() const;          // this attach created the job
  [[nodiscard]] bool initialized() const;      // the job held weights when this rank attached
  [[nodiscard]] uint64_t resume_step() const;  // the job's completed step when this rank attached
  [[nodiscard]] uint64_t completed_step() const;
  [[nodiscard]] uint64_t applied_step(uint32_t bucket) const;    // last step committed to a bucket
  [[nodiscard]] uint32_t committed_half(uint32_t bucket) const;  // the state half that holds it
  [[nodiscard]] shm::StateView state() const;
  [[nodiscard]] shm::RankView view() const;
  [[nodiscard]] size_t state_bytes() const;
  [[nodiscard]] size_t rank_bytes() const;

  // Whether a micro-batch is its step's last, as the rank sees it when it sends the gradients.
  enum class Last : uint8_t { kNo = 0, kYes = 1, kUnknown = 2 };
  // Tells the daemon that this rank's gradients of `bucket` for (step, micro) are in its grad region
  // (cuda-ipc: piece `piece` of them in staging slot `slot`, after its grad-ready event).
  void SendGradReady(uint32_t bucket, uint64_t step, uint32_t micro, Last last, uint32_t slot = 0, uint32_t piece = 0);
  // Step terms (jobs with LayoutSpec::step_terms, daemon/engine/step_gate.h). The step summed
  // `micro_batches` backward passes; the norm of its gradients (times `norm_factor`) is wanted
  // (WaitStepNorm), and with `max_norm` > 0 they are clipped to it.
  void SendNormTerms(uint64_t step, uint32_t micro_batches, float norm_factor, double max_norm);
  // optimizer.step(): the update applies `factor` (what a GradScaler's unscale_ took off).
  void SendCommitTerms(uint64_t step, uint32_t micro_batches, float factor);
  // Another backward pass of `step` follows micro-batch `micro` (sent before its first gradient).
  void SendMoreMicro(uint64_t step, uint32_t micro);
  // zero_grad() before optimizer.step(), the `count`th time in `step`: drops the step's gradients and
  // blocks until every grad region is free.
  void Discard(uint64_t step, uint32_t count);
  // The norm of `step`'s gradients as SendNormTerms asked, and whether some are inf or NaN: blocks until
  // the daemon sent it; nullopt from StepNorm while it has not.
  struct Norm {
    double value = 0;
    bool nonfinite = false;
  };
  Norm WaitStepNorm(uint64_t step);
  [[nodiscard]] std::optional<Norm> StepNorm(uint64_t step);
  // cuda-ipc: hands the daemon this rank's GPU buffers and events. Returns why the daemon refused
  // (the rank then copies its data itself), or an empty string.
  std::string RegisterCudaIpc(const shm::CudaIpcExport& exported);
  // cuda-ipc: optimizer.step() for `step` was called; `event` was recorded after the kernels that read
  // the weights. `weights_on_gpu`: the GPU already holds the weights of `step` (this rank just loaded
  // them from its parameters), so the daemon need not push them.
  void SendWeightsWanted(uint64_t step, uint32_t event, bool weights_on_gpu = false);
  // cuda-ipc: blocks until the daemon copied staging slot `slot` out.
  void WaitStagingFree(uint32_t slot);
  // cuda-ipc: blocks until the daemon has waited for `count` weights-wanted events.
  void WaitWeightsWantedWaits(uint64_t count);
  // Tells the daemon that the client wrote master weights / moments / step counts: publish as `step`.
  void SendLoadState(uint64_t step);
  // Pushes an arbitrary message (tests use it to send malformed ones).
  void SendRaw(const shm::Message& message);

  // Blocks until the daemon published bucket's weights of `step` (or later).
  void WaitParamsReady(uint32_t bucket, uint64_t step);
  // Blocks until the daemon released bucket's grad region (nothing of it outstanding).
  void WaitSlotFree(uint32_t bucket);
  [[nodiscard]] bool ParamsReady(uint32_t bucket, uint64_t step);
  // Weights waited for on the GPU. From now on `words[b]` holds bucket b's last published step plus one
  // (0: none since the attach or the last load), written as soon as its PARAMS_READY is in, by a thread
  // of this session's that also watches the GPU's waits (ExpectParamsReady). `words` holds one word
  // per bucket (HostMappedWords::words()) and is kept as long as the session may write it.
  void MirrorParamsReady(std::shared_ptr<uint32_t> words, size_t count);
  // What words[bucket] must reach for bucket's weights of `step` (or later), for a GPU stream to wait
  // on: 0 when they are published already. From then on the wait is watched: should the daemon die,
  // the session fail, or the wait outlast the wait timeout, every word becomes kWordsReleased (no
  // stream waits for good, the kernels run on the weights there) and the session fails, so that the
  // next call raises. nullopt: not mirrored, or a step beyond the words' range; use WaitParamsReady.
  [[nodiscard]] std::optional<uint32_t> ExpectParamsReady(uint32_t bucket, uint64_t step);
  // Greater-or-equal, as the driver compares, to every value ExpectParamsReady returns.
  static constexpr uint32_t kWordsReleased = 0x7FFFFFFF;
  // Throws the session's error if it failed (daemon gone, protocol error, shutdown).
  void CheckHealthy();
  // Warnings the daemon sent since the last call.
  std::vector<std::string> TakeWarnings();
  void Close();

  struct Impl;
  explicit RankSession(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream
