// RankSession: one attached rank's data plane. Waits never block forever: they wake at least every
// kWaitSlice to check that the session is alive (the Session stream, and the daemon's pid) and run
// the wait policy (interrupts, progress, the timeout: client/src/bounded_wait.h).
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <fstream>

#include "client/src/bounded_wait.h"
#include "client/src/grpc_status.h"
#include "client/src/rank_session_impl.h"
#include "proto/layout_spec_proto.h"

namespace trainstream {

namespace {
constexpr auto kStatsTimeout = std::chrono::seconds(2);  // a daemon slower than this counts as not answering
constexpr auto kCloseGrace = std::chrono::seconds(2);    // for the daemon to detach a closing rank
const v1::StatsRequest request_stats;

// The daemon's pid is a liveness signal only if it names the daemon in our pid namespace.
bool IsOurDaemon(int64_t pid) {
  std::ifstream comm(fmt::format("/proc/{}/comm", pid));
  std::string name;
  return std::getline(comm, name) && name == "trainstreamd";
}

}  // namespace

std::unique_ptr<RankSession::Impl> RankSession::Impl::Open(const std::shared_ptr<grpc::Channel>& channel,
                                                           const std::string& job, uint32_t rank,
                                                           const shm::LayoutSpec& spec, uint64_t seed,
                                                           const RankTransport& transport, int64_t daemon_pid,
                                                           WaitPolicy waits) {
  auto impl = std::make_unique<Impl>();
  impl->job = job;
  impl->waits = std::move(waits);
  impl->stub = v1::Control::NewStub(channel);
  shm::ValidateRequest(spec);  // locally first: clearer errors, no round trip
  impl->spec = spec;           // Map completes it with what the daemon decided
  impl->rank = rank;
  impl->daemon_pid = IsOurDaemon(daemon_pid) ? daemon_pid : 0;

  impl->stream = impl->stub->Session(&impl->context);
  v1::SessionRequest request;
  v1::AttachRequest* attach = request.mutable_attach();
  attach->set_job(job);
  attach->set_rank(rank);
  *attach->mutable_layout() = ToProto(spec);
  attach->set_seed(seed);
  attach->set_transport(transport.name);
  attach->set_device(transport.device);
  const bool sent = impl->stream->Write(request);
  impl->reader = std::thread([raw = impl.get()] { raw->ReadEvents(); });
  const std::string what = fmt::format("attach rank {} of job '{}'", rank, job);
  // The answer may take long (a large job's segments are backed page by page): wait in slices.
  BoundedWait wait(
      impl->waits, [&] { return fmt::format("trainstreamd's answer to the {}", what); },
      [raw = impl.get()] { return raw->DescribeMissing(); });
  std::unique_lock lock(impl->event_mutex);
  while (!impl->attach_answered.wait_for(lock, kWaitSlice, [&] { return impl->attached || impl->ended; })) {
    lock.unlock();
    wait.Between();  // on an exception ~Impl cancels the stream and joins the reader
    lock.lock();
  }
  if (!impl->attached) {
    const grpc::Status status = *impl->ended;
    lock.unlock();
    ThrowIfFailed(status, what);
    Throw(Code::kUnavailable, "{}: trainstreamd closed the session{}", what, sent ? "" : " before the request");
  }
  const v1::AttachReply reply = *impl->attached;
  lock.unlock();
  impl->Map(reply);
  return impl;
}

void RankSession::Impl::Map(const v1::AttachReply& reply) {
  // The layout with what the daemon decided (or the job had) for what the request left open.
  spec.state_halves = reply.state_halves();
  spec.speculative_clipping = reply.speculative_clipping() ? shm::Speculation::kOn : shm::Speculation::kOff;
  layout = shm::ComputeLayout(spec);
  TS_CHECK(reply.layout_hash() == layout.hash, Code::kInternal,
           "attach: the daemon computed layout hash {:#x}, this client {:#x} (version skew?)", reply.layout_hash(),
           layout.hash);
  job_key = reply.job_key();
  created = reply.created();
  initialized = reply.initialized();
  completed_step = reply.completed_step();

  state_segment = shm::Segment::Open(reply.state_segment());
  rank_segment = shm::Segment::Open(reply.rank_segment());
  shm::CheckStateSegment(state_segment.data(), state_segment.size(), layout);
  shm::CheckRankSegment(rank_segment.data(), rank_segment.size(), layout, rank);
  state = shm::ViewState(state_segment.data(), layout, spec);
  view = shm::ViewRank(rank_segment.data(), layout);
  requests = shm::RingProducer(view.request_ring, &state.header->doorbell);
  completions = shm::RingConsumer(view.completion_ring);

  const size_t buckets = layout.buckets.size();
  outstanding.assign(buckets, 0);
  params_ready.assign(buckets, -1);
  awaited_on_gpu.assign(buckets, -1);
  awaited_since.assign(buckets, {});
  if (initialized) {
    for (size_t b = 0; b < buckets; ++b) {
      params_ready[b] = static_cast<int64_t>(state.bucket_state[b].Load().step);
    }
  }
  completion_doorbell = &view.header->completion_doorbell;
  if (failed) completion_doorbell.load()->Ring();  // a failure that came before the mapping
}

std::string RankSession::Impl::DescribeMissing() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kStatsTimeout);
  v1::StatsReply reply;
  const grpc::Status status = WaitForCall(context, waits.interrupt, [&](std::function<void(grpc::Status)> done) {
    stub->async()->Stats(&context, &request_stats, &reply, std::move(done));
  });
  const std::string daemon = daemon_pid > 0 ? fmt::format("trainstreamd (pid {})", daemon_pid) : "trainstreamd";
  if (!status.ok()) {
    return fmt::format(
        "{} does not answer ({}: {}): is it stopped (SIGSTOP) or hung?", daemon,
        status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? "a Stats call timed out" : "Stats failed",
        status.error_message());
  }
  for (const v1::JobStats& stats : reply.jobs()) {
    if (stats.job_key() != job_key || job_key.empty()) continue;
    std::vector<uint32_t> missing;
    for (uint32_t r = 0; r < stats.world_size(); ++r) {
      if (std::find(stats.attached_ranks().begin(), stats.attached_ranks().end(), r) == stats.attached_ranks().end()) {
        missing.push_back(r);
      }
    }
    const std::string nodes =
        spec.nodes() > 1
            ? fmt::format(" (the job spans {} nodes: ranks of the other nodes are not shown here)", spec.nodes())
            : "";
    if (missing.empty()) {
      return fmt::format(
          "all {} ranks of job '{}' are attached to {}; one of them has not delivered what this "
          "step needs (is it stuck, or doing something else?){}",
          stats.world_size(), job, daemon, nodes);
    }
    return fmt::format("rank{} {} of job '{}' (world_size {}) {} not attached to {}{}", missing.size() > 1 ? "s" : "",
                       fmt::join(missing, ", "), job, stats.world_size(), missing.size() > 1 ? "are" : "is", daemon,
                       nodes);
  }
  return fmt::format("{} answers, but does not list job '{}'{}", daemon, job,
                     job_key.empty() ? " yet (its attach is not answered)" : "");
}

RankSession::Impl::~Impl() {
  closing = true;
  StopWatcher();
  context.TryCancel();
  if (reader.joinable()) reader.join();
}

void RankSession::Impl::ReadEvents() {
  v1::SessionEvent event;
  while (stream->Read(&event)) {
    std::lock_guard lock(event_mutex);
    if (event.has_attached() && !attached) {
      attached = event.attached();
      attach_answered.notify_all();
    }
    if (event.has_warning()) warnings.push_back(event.warning());
    if (event.has_error() && !failure) failure = "trainstreamd: " + event.error();
    if (event.has_shutdown() && !failure) failure = "trainstreamd: " + event.shutdown();
    if (event.has_cuda_ipc()) {
      cuda_ipc_reply = event.cuda_ipc().error();
      cuda_ipc_answered.notify_all();
    }
  }
  const grpc::Status status = stream->Finish();
  {
    std::lock_guard lock(event_mutex);
    ended = status;
    attach_answered.notify_all();
  }
  Fail(closing ? std::string("the session was closed")
               : fmt::format("lost the session with trainstreamd: {}", status.error_message()));
}

void RankSession::Impl::Fail(const std::string& message) {
  {
    std::lock_guard lock(event_mutex);
    if (!failure) failure = message;
  }
  failed = true;
  cuda_ipc_answered.notify_all();
  if (shm::Doorbell* doorbell = completion_doorbell.load()) doorbell->Ring();  // wake our own waiters
}

void RankSession::Impl::NoticeDaemonGone() {
  if (!failed && daemon_pid > 0 && kill(static_cast<pid_t>(daemon_pid), 0) != 0 && errno == ESRCH) {
    Fail(fmt::format("trainstreamd (pid {}) is gone", daemon_pid));
  }
}

void RankSession::Impl::CheckHealthy() {
  NoticeDaemonGone();
  if (!failed) return;
  std::lock_guard lock(event_mutex);
  Throw(Code::kUnavailable, "{}", failure.value_or("the session failed"));
}

void RankSession::Impl::Drain() {
  shm::Message message;
  while (completions.TryPop(&message)) {
    TS_CHECK(message.bucket < params_ready.size(), Code::kInternal, "completion for unknown bucket {}", message.bucket);
    switch (message.kind) {
      case shm::MessageKind::kParamsReady:
        SetParamsReady(message.bucket, std::max(params_ready[message.bucket], static_cast<int64_t>(message.step)));
        outstanding[message.bucket] = 0;
        break;
      case shm::MessageKind::kSlotFree: outstanding[message.bucket] = 0; break;
      case shm::MessageKind::kStepNorm:
        step_norms[message.step] = {message.value, (message.flags & shm::kNonFinite) != 0};
        while (step_norms.size() > 4) step_norms.erase(step_norms.begin());
        break;
      case shm::MessageKind::kDiscarded:
        std::fill(outstanding.begin(), outstanding.end(), 0);
        discarded = std::max(discarded, std::make_pair(message.step, message.micro));
        step_norms.erase(message.step);  // the dropped gradients': the step's next norm is another
        break;
      case shm::MessageKind::kStagingFree:
        TS_CHECK(message.slot < staging_busy.size(), Code::kInternal, "STAGING_FREE for unknown slot {}", message.slot);
        staging_busy[message.slot] = 0;
        break;
      default: Throw(Code::kInternal, "unexpected completion kind {}", static_cast<int>(message.kind));
    }
  }
}

template <typename Ready, typename What>
void RankSession::Impl::WaitUntil(Ready ready, What what) {
  shm::Doorbell& doorbell = view.header->completion_doorbell;
  std::optional<BoundedWait> wait;  // made only once the condition was false: most waits end at once
  for (;;) {
    const uint32_t seen = doorbell.Seq();
    {
      std::lock_guard lock(mutex);
      Drain();
      if (ready()) return;
    }
    CheckHealthy();
    if (wait) {
      wait->Between();
    } else {
      wait.emplace(waits, what, [this] { return DescribeMissing(); });
    }
    doorbell.Wait(seen, kWaitSlice);
  }
}

void RankSession::Impl::SetParamsReady(uint32_t bucket, int64_t step) {
  params_ready[bucket] = step;
  if (ready_words && !words_released) {
    std::atomic_ref<uint32_t>(ready_words.get()[bucket]).store(static_cast<uint32_t>(step + 1));
  }
}

void RankSession::Impl::ForgetParamsReady() {
  for (uint32_t b = 0; b < params_ready.size(); ++b) SetParamsReady(b, -1);
}

void RankSession::Impl::WatchGpuWaits() {
  shm::Doorbell& doorbell = view.header->completion_doorbell;
  while (!closing && !failed) {
    const uint32_t seen = doorbell.Seq();
    std::optional<std::string> failure_found;
    {
      std::lock_guard lock(mutex);
      try {
        Drain();
        failure_found = OverdueGpuWait();
      } catch (const Error& e) {
        failure_found = e.what();
      }
    }
    if (failure_found) Fail(*failure_found);
    NoticeDaemonGone();
    if (!closing && !failed) doorbell.Wait(seen, kWaitSlice);
  }
  std::lock_guard lock(mutex);
  ReleaseWords();
}

std::optional<std::string> RankSession::Impl::OverdueGpuWait() {
  const auto now = std::chrono::steady_clock::now();
  for (uint32_t b = 0; b < awaited_on_gpu.size(); ++b) {
    if (awaited_on_gpu[b] < 0) continue;
    if (params_ready[b] >= awaited_on_gpu[b]) {
      awaited_on_gpu[b] = -1;
    } else if (now - awaited_since[b] >= waits.timeout) {
      return fmt::format(
          "gave up waiting for bucket {}'s weights of step {} (the GPU waits for them) after {} s (wait timeout {} s); "
          "the GPU went on with the weights it holds",
          b, awaited_on_gpu[b], std::chrono::duration_cast<std::chrono::seconds>(now - awaited_since[b]).count(),
          std::chrono::duration_cast<std::chrono::seconds>(waits.timeout).count());
    }
  }
  return std::nullopt;
}

void RankSession::Impl::ReleaseWords() {
  if (!ready_words || words_released) return;
  for (size_t b = 0; b < params_ready.size(); ++b) {
    std::atomic_ref<uint32_t>(ready_words.get()[b]).store(kWordsReleased);
  }
  words_released = true;
}

void RankSession::Impl::StopWatcher() {
  if (!watcher.joinable()) return;
  if (shm::Doorbell* doorbell = completion_doorbell.load()) doorbell->Ring();
  watcher.join();
}

void RankSession::Impl::Push(const shm::Message& message) {
  std::optional<BoundedWait> wait;
  for (;;) {
    CheckHealthy();
    {
      std::lock_guard lock(mutex);
      if (requests.TryPush(message)) return;
    }
    if (wait) {
      wait->Between();
    } else {
      wait.emplace(
          waits, [] { return std::string("room in the request ring (trainstreamd reads it)"); },
          [this] { return DescribeMissing(); });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));  // ring full: the daemon is behind
  }
}

RankSession::RankSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankSession::~RankSession() = default;

const shm::LayoutSpec& RankSession::spec() const {
  return impl_->spec;
}
const shm::JobLayout& RankSession::layout() const {
  return impl_->layout;
}
uint32_t RankSession::rank() const {
  return impl_->rank;
}
bool RankSession::created() const {
  return impl_->created;
}
bool RankSession::initialized() const {
  return impl_->initialized;
}
uint64_t RankSession::resume_step() const {
  return impl_->completed_step;
}
uint64_t RankSession::completed_step() const {
  return impl_->state.header->completed_step.load();
}
uint64_t RankSession::applied_step(uint32_t bucket) const {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  return impl_->state.bucket_state[bucket].Load().step;
}
uint32_t RankSession::committed_half(uint32_t bucket) const {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  return impl_->state.bucket_state[bucket].Load().half;
}
shm::StateView RankSession::state() const {
  return impl_->state;
}
shm::RankView RankSession::view() const {
  return impl_->view;
}
size_t RankSession::state_bytes() const {
  return impl_->layout.state_bytes;
}
size_t RankSession::rank_bytes() const {
  return impl_->layout.rank_bytes;
}

void RankSession::SendGradReady(uint32_t bucket, uint64_t step, uint32_t micro, Last last, uint32_t slot,
                                uint32_t piece) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  {
    std::lock_guard lock(impl_->mutex);
    impl_->outstanding[bucket] = 1;
    if (!impl_->staging_busy.empty()) {
      TS_CHECK(slot < impl_->staging_busy.size(), Code::kInvalidArgument, "staging slot {} out of range", slot);
      impl_->staging_busy[slot] = 1;
    }
  }
  impl_->Push(shm::Message{.kind = shm::MessageKind::kGradReady,
                           .flags = static_cast<uint16_t>(last == Last::kYes       ? shm::kFinalMicro
                                                          : last == Last::kUnknown ? shm::kUncertainMicro
                                                                                   : 0),
                           .bucket = bucket,
                           .step = step,
                           .micro = micro,
                           .slot = slot,
                           .piece = piece});
}

std::string RankSession::RegisterCudaIpc(const shm::CudaIpcExport& exported) {
  v1::SessionRequest request;
  v1::CudaIpcRegistration* r = request.mutable_register_cuda_ipc();
  r->set_device_uuid(exported.device_uuid);
  r->set_params_handle(exported.params_handle);
  r->set_params_bytes(exported.params_bytes);
  r->set_staging_handle(exported.staging_handle);
  r->set_slot_bytes(exported.slot_bytes);
  for (const std::string& event : exported.grad_ready_events) r->add_grad_ready_events(event);
  for (const std::string& event : exported.weights_wanted_events) r->add_weights_wanted_events(event);
  for (uint64_t offset : exported.param_offsets) r->add_param_offsets(offset);
  impl_->CheckHealthy();
  {
    std::lock_guard lock(impl_->event_mutex);
    impl_->cuda_ipc_reply.reset();
  }
  TS_CHECK(impl_->stream->Write(request), Code::kUnavailable,
           "registering the GPU buffers: the session with trainstreamd is gone");
  std::string error;
  BoundedWait wait(
      impl_->waits, [] { return std::string("trainstreamd's answer to the cuda-ipc registration"); },
      [this] { return impl_->DescribeMissing(); });
  for (;;) {
    {
      std::unique_lock lock(impl_->event_mutex);
      if (impl_->cuda_ipc_answered.wait_for(lock, kWaitSlice, [&] { return impl_->cuda_ipc_reply.has_value(); })) {
        error = *impl_->cuda_ipc_reply;
        break;
      }
    }
    impl_->CheckHealthy();
    wait.Between();
  }
  if (error.empty()) {  // the GPU holds none of the job's weights until the daemon pushes them
    std::lock_guard lock(impl_->mutex);
    impl_->staging_busy.assign(exported.grad_ready_events.size(), 0);
    impl_->ForgetParamsReady();
  }
  return error;
}

void RankSession::SendWeightsWanted(uint64_t step, uint32_t event, bool weights_on_gpu) {
  impl_->Push(shm::Message{.kind = shm::MessageKind::kWeightsWanted,
                           .flags = static_cast<uint16_t>(weights_on_gpu ? shm::kWeightsOnGpu : 0),
                           .step = step,
                           .slot = event});
}

void RankSession::WaitStagingFree(uint32_t slot) {
  {
    std::lock_guard lock(impl_->mutex);
    TS_CHECK(slot < impl_->staging_busy.size(), Code::kInvalidArgument, "staging slot {} out of range", slot);
  }
  impl_->WaitUntil([&] { return impl_->staging_busy[slot] == 0; },
                   [&] { return fmt::format("GPU staging slot {} to be copied out by trainstreamd", slot); });
}

void RankSession::WaitWeightsWantedWaits(uint64_t count) {
  impl_->WaitUntil([&] { return impl_->view.header->weights_wanted_waits.load() >= count; },
                   [&] { return fmt::format("trainstreamd to pass weights-wanted event {}", count); });
}

void RankSession::SendLoadState(uint64_t step) {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->ForgetParamsReady();
  }
  impl_->Push(shm::Message{.kind = shm::MessageKind::kLoadState, .step = step});
}

void RankSession::SendNormTerms(uint64_t step, uint32_t micro_batches, float norm_factor, double max_norm) {
  impl_->Push(shm::Message{.kind = shm::MessageKind::kStepTerms,
                           .flags = static_cast<uint16_t>(shm::kTermsNorm | (max_norm > 0 ? shm::kTermsClip : 0)),
                           .step = step,
                           .micro = micro_batches,
                           .norm_factor = norm_factor,
                           .value = max_norm});
}

void RankSession::SendCommitTerms(uint64_t step, uint32_t micro_batches, float factor) {
  impl_->Push(shm::Message{.kind = shm::MessageKind::kStepTerms,
                           .flags = shm::kTermsCommit,
                           .step = step,
                           .micro = micro_batches,
                           .factor = factor});
}

void RankSession::SendMoreMicro(uint64_t step, uint32_t micro) {
  impl_->Push(shm::Message{.kind = shm::MessageKind::kMoreMicro, .step = step, .micro = micro});
}

void RankSession::Discard(uint64_t step, uint32_t count) {
  impl_->Push(shm::Message{.kind = shm::MessageKind::kDiscard, .step = step, .micro = count});
  impl_->WaitUntil([&] { return impl_->discarded >= std::make_pair(step, count); },
                   [&] { return fmt::format("trainstreamd to drop step {}'s gradients", step); });
}

RankSession::Norm RankSession::WaitStepNorm(uint64_t step) {
  impl_->WaitUntil([&] { return impl_->step_norms.contains(step); },
                   [&] { return fmt::format("the gradient norm of step {}", step); });
  std::lock_guard lock(impl_->mutex);
  return impl_->step_norms.at(step);
}

std::optional<RankSession::Norm> RankSession::StepNorm(uint64_t step) {
  std::lock_guard lock(impl_->mutex);
  impl_->Drain();
  const auto found = impl_->step_norms.find(step);
  if (found == impl_->step_norms.end()) return std::nullopt;
  return found->second;
}

void RankSession::SendRaw(const shm::Message& message) {
  impl_->Push(message);
}

void RankSession::WaitParamsReady(uint32_t bucket, uint64_t step) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  impl_->WaitUntil([&] { return impl_->params_ready[bucket] >= static_cast<int64_t>(step); },
                   [&] { return fmt::format("bucket {}'s weights of step {}", bucket, step); });
}

void RankSession::WaitSlotFree(uint32_t bucket) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  impl_->WaitUntil([&] { return impl_->outstanding[bucket] == 0; },
                   [&] { return fmt::format("bucket {}'s gradient slot to be released", bucket); });
}

bool RankSession::ParamsReady(uint32_t bucket, uint64_t step) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  std::lock_guard lock(impl_->mutex);
  impl_->Drain();
  return impl_->params_ready[bucket] >= static_cast<int64_t>(step);
}

void RankSession::MirrorParamsReady(std::shared_ptr<uint32_t> words, size_t count) {
  TS_CHECK(words != nullptr && count == impl_->layout.buckets.size(), Code::kInvalidArgument,
           "MirrorParamsReady: {} words for {} buckets; one per bucket is needed", words ? count : 0,
           impl_->layout.buckets.size());
  {
    std::lock_guard lock(impl_->mutex);
    TS_CHECK(impl_->ready_words == nullptr, Code::kFailedPrecondition, "this session mirrors PARAMS_READY already");
    impl_->ready_words = std::move(words);
    for (uint32_t b = 0; b < count; ++b) impl_->SetParamsReady(b, impl_->params_ready[b]);
  }
  impl_->watcher = std::thread([raw = impl_.get()] { raw->WatchGpuWaits(); });
}

std::optional<uint32_t> RankSession::ExpectParamsReady(uint32_t bucket, uint64_t step) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  impl_->CheckHealthy();
  std::lock_guard lock(impl_->mutex);
  if (impl_->ready_words == nullptr || step + 1 >= kWordsReleased) return std::nullopt;
  impl_->Drain();
  const auto wanted = static_cast<int64_t>(step);
  if (impl_->params_ready[bucket] >= wanted) return 0;
  if (impl_->awaited_on_gpu[bucket] < 0) impl_->awaited_since[bucket] = std::chrono::steady_clock::now();
  impl_->awaited_on_gpu[bucket] = std::max(impl_->awaited_on_gpu[bucket], wanted);
  return static_cast<uint32_t>(step + 1);
}

void RankSession::CheckHealthy() {
  impl_->CheckHealthy();
}

std::vector<std::string> RankSession::TakeWarnings() {
  std::lock_guard lock(impl_->event_mutex);
  return std::exchange(impl_->warnings, {});
}

// Half-closes the stream and waits for the daemon to end it, so that the daemon has detached the rank
// when Close returns: a DropJob right after unwrap() used to find the rank still attached now and then.
// A daemon that does not end the stream within kCloseGrace (stopped, say) is cancelled instead.
void RankSession::Close() {
  if (impl_->closing.exchange(true)) return;
  impl_->StopWatcher();
  if (impl_->stream->WritesDone()) {
    std::unique_lock lock(impl_->event_mutex);
    impl_->attach_answered.wait_for(lock, kCloseGrace, [&] { return impl_->ended.has_value(); });
  }
  impl_->context.TryCancel();
  if (impl_->reader.joinable()) impl_->reader.join();
}

}  // namespace trainstream
