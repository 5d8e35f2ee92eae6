// RankSession: one attached rank's data plane. Waits never block forever: they wake at least every
// 100 ms to check that the session is alive (the Session stream, and the daemon's pid).
#include <signal.h>

#include <cerrno>
#include <fstream>

#include "client/src/grpc_status.h"
#include "client/src/rank_session_impl.h"

namespace trainstream {

namespace {
constexpr auto kWakeInterval = std::chrono::milliseconds(100);

// The daemon's pid is a liveness signal only if it names the daemon in our pid namespace.
bool IsOurDaemon(int64_t pid) {
  std::ifstream comm(fmt::format("/proc/{}/comm", pid));
  std::string name;
  return std::getline(comm, name) && name == "trainstreamd";
}

void ToProto(const shm::ParamSpec& p, v1::ParamSpec* param) {
  param->set_name(p.name);
  for (int64_t d : p.shape) param->add_shape(d);
  param->set_dtype(static_cast<v1::DType>(p.dtype));
  param->set_group(p.group);
  param->set_partition(p.partition);
}

v1::LayoutSpec ToProto(const shm::LayoutSpec& spec) {
  v1::LayoutSpec proto;
  for (const shm::ParamSpec& p : spec.params) ToProto(p, proto.add_params());
  for (const shm::ParamSpec& p : spec.frozen) ToProto(p, proto.add_frozen());
  proto.set_num_groups(spec.num_groups);
  proto.set_bucket_bytes(spec.bucket_bytes);
  proto.set_moment_dtype(static_cast<v1::DType>(spec.moment_dtype));
  proto.set_optimizer(spec.optimizer == shm::OptimizerKind::kAdamW ? v1::ADAMW : v1::ADAM);
  proto.set_accumulation_steps(spec.accumulation_steps);
  proto.set_world_size(spec.world_size);
  proto.set_max_grad_norm(spec.max_grad_norm);
  for (const std::string& peer : spec.peers) proto.add_peers(peer);
  proto.set_node_rank(spec.node_rank);
  proto.set_state_halves(spec.state_halves);
  switch (spec.speculative_clipping) {
    case shm::Speculation::kOff: proto.set_speculative_clipping(v1::SPECULATION_OFF); break;
    case shm::Speculation::kOn: proto.set_speculative_clipping(v1::SPECULATION_ON); break;
    case shm::Speculation::kAuto: proto.set_speculative_clipping(v1::SPECULATION_AUTO); break;
  }
  return proto;
}
}  // namespace

std::unique_ptr<RankSession::Impl> RankSession::Impl::Open(v1::Control::Stub& stub, const std::string& job,
                                                           uint32_t rank, const shm::LayoutSpec& spec, uint64_t seed,
                                                           const RankTransport& transport, const std::string& nonce,
                                                           int64_t daemon_pid) {
  auto impl = std::make_unique<Impl>();
  shm::ValidateRequest(spec);  // locally first: clearer errors, no round trip
  impl->rank = rank;
  impl->daemon_pid = IsOurDaemon(daemon_pid) ? daemon_pid : 0;

  impl->stream = stub.Session(&impl->context);
  v1::SessionRequest request;
  v1::AttachRequest* attach = request.mutable_attach();
  attach->set_job(job);
  attach->set_rank(rank);
  *attach->mutable_layout() = ToProto(spec);
  attach->set_seed(seed);
  attach->set_nonce(nonce);
  attach->set_transport(transport.name);
  attach->set_device(transport.device);
  v1::SessionEvent event;
  if (!impl->stream->Write(request) || !impl->stream->Read(&event)) {
    ThrowIfFailed(impl->stream->Finish(), fmt::format("attach rank {} of job '{}'", rank, job));
    Throw(Code::kUnavailable, "attach rank {} of job '{}': trainstreamd closed the session", rank, job);
  }
  TS_CHECK(event.has_attached(), Code::kInternal, "attach rank {} of job '{}': unexpected first session event", rank,
           job);
  const v1::AttachReply& reply = event.attached();
  // The layout with what the daemon decided (or the job had) for what the request left open.
  impl->spec = spec;
  impl->spec.state_halves = reply.state_halves();
  impl->spec.speculative_clipping = reply.speculative_clipping() ? shm::Speculation::kOn : shm::Speculation::kOff;
  impl->layout = shm::ComputeLayout(impl->spec);
  TS_CHECK(reply.layout_hash() == impl->layout.hash, Code::kInternal,
           "attach: the daemon computed layout hash {:#x}, this client {:#x} (version skew?)", reply.layout_hash(),
           impl->layout.hash);
  impl->created = reply.created();
  impl->initialized = reply.initialized();
  impl->completed_step = reply.completed_step();

  impl->state_segment = shm::Segment::Open(reply.state_segment());
  impl->rank_segment = shm::Segment::Open(reply.rank_segment());
  shm::CheckStateSegment(impl->state_segment.data(), impl->state_segment.size(), impl->layout);
  shm::CheckRankSegment(impl->rank_segment.data(), impl->rank_segment.size(), impl->layout, rank);
  impl->state = shm::ViewState(impl->state_segment.data(), impl->layout, impl->spec);
  impl->view = shm::ViewRank(impl->rank_segment.data(), impl->layout);
  impl->requests = shm::RingProducer(impl->view.request_ring, &impl->state.header->doorbell);
  impl->completions = shm::RingConsumer(impl->view.completion_ring);

  const size_t buckets = impl->layout.buckets.size();
  impl->outstanding.assign(buckets, 0);
  impl->params_ready.assign(buckets, -1);
  if (impl->initialized) {
    for (size_t b = 0; b < buckets; ++b) {
      impl->params_ready[b] = static_cast<int64_t>(impl->state.bucket_state[b].Load().step);
    }
  }
  impl->reader = std::thread([raw = impl.get()] { raw->ReadEvents(); });
  return impl;
}

RankSession::Impl::~Impl() {
  closing = true;
  context.TryCancel();
  if (reader.joinable()) reader.join();
}

void RankSession::Impl::ReadEvents() {
  v1::SessionEvent event;
  while (stream->Read(&event)) {
    std::lock_guard lock(event_mutex);
    if (event.has_warning()) warnings.push_back(event.warning());
    if (event.has_error() && !failure) failure = "trainstreamd: " + event.error();
    if (event.has_shutdown() && !failure) failure = "trainstreamd: " + event.shutdown();
    if (event.has_cuda_ipc()) {
      cuda_ipc_reply = event.cuda_ipc().error();
      cuda_ipc_answered.notify_all();
    }
  }
  const grpc::Status status = stream->Finish();
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
  view.header->completion_doorbell.Ring();  // wake our own waiters
}

void RankSession::Impl::CheckHealthy() {
  if (!failed && daemon_pid > 0 && kill(static_cast<pid_t>(daemon_pid), 0) != 0 && errno == ESRCH) {
    Fail(fmt::format("trainstreamd (pid {}) is gone", daemon_pid));
  }
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
        params_ready[message.bucket] = std::max(params_ready[message.bucket], static_cast<int64_t>(message.step));
        outstanding[message.bucket] = 0;
        break;
      case shm::MessageKind::kSlotFree: outstanding[message.bucket] = 0; break;
      case shm::MessageKind::kStagingFree:
        TS_CHECK(message.slot < staging_busy.size(), Code::kInternal, "STAGING_FREE for unknown slot {}", message.slot);
        staging_busy[message.slot] = 0;
        break;
      default: Throw(Code::kInternal, "unexpected completion kind {}", static_cast<int>(message.kind));
    }
  }
}

template <typename Ready>
void RankSession::Impl::WaitUntil(Ready ready) {
  shm::Doorbell& doorbell = view.header->completion_doorbell;
  for (;;) {
    const uint32_t seen = doorbell.Seq();
    {
      std::lock_guard lock(mutex);
      Drain();
      if (ready()) return;
    }
    CheckHealthy();
    doorbell.Wait(seen, kWakeInterval);
  }
}

void RankSession::Impl::Push(const shm::Message& message) {
  for (;;) {
    CheckHealthy();
    {
      std::lock_guard lock(mutex);
      if (requests.TryPush(message)) return;
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

void RankSession::SendGradReady(uint32_t bucket, uint64_t step, uint32_t micro, bool final_micro, uint32_t slot,
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
                           .flags = static_cast<uint16_t>(final_micro ? shm::kFinalMicro : 0),
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
  for (;;) {
    {
      std::unique_lock lock(impl_->event_mutex);
      if (impl_->cuda_ipc_answered.wait_for(lock, kWakeInterval, [&] { return impl_->cuda_ipc_reply.has_value(); })) {
        error = *impl_->cuda_ipc_reply;
        break;
      }
    }
    impl_->CheckHealthy();
  }
  if (error.empty()) {  // the GPU holds none of the job's weights until the daemon pushes them
    std::lock_guard lock(impl_->mutex);
    impl_->staging_busy.assign(exported.grad_ready_events.size(), 0);
    std::fill(impl_->params_ready.begin(), impl_->params_ready.end(), -1);
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
  impl_->WaitUntil([&] { return impl_->staging_busy[slot] == 0; });
}

void RankSession::WaitWeightsWantedWaits(uint64_t count) {
  impl_->WaitUntil([&] { return impl_->view.header->weights_wanted_waits.load() >= count; });
}

void RankSession::SendLoadState(uint64_t step) {
  {
    std::lock_guard lock(impl_->mutex);
    std::fill(impl_->params_ready.begin(), impl_->params_ready.end(), -1);
  }
  impl_->Push(shm::Message{.kind = shm::MessageKind::kLoadState, .step = step});
}

void RankSession::SendRaw(const shm::Message& message) {
  impl_->Push(message);
}

void RankSession::WaitParamsReady(uint32_t bucket, uint64_t step) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  impl_->WaitUntil([&] { return impl_->params_ready[bucket] >= static_cast<int64_t>(step); });
}

void RankSession::WaitSlotFree(uint32_t bucket) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  impl_->WaitUntil([&] { return impl_->outstanding[bucket] == 0; });
}

bool RankSession::ParamsReady(uint32_t bucket, uint64_t step) {
  TS_CHECK(bucket < impl_->layout.buckets.size(), Code::kInvalidArgument, "bucket {} out of range", bucket);
  std::lock_guard lock(impl_->mutex);
  impl_->Drain();
  return impl_->params_ready[bucket] >= static_cast<int64_t>(step);
}

void RankSession::CheckHealthy() {
  impl_->CheckHealthy();
}

std::vector<std::string> RankSession::TakeWarnings() {
  std::lock_guard lock(impl_->event_mutex);
  return std::exchange(impl_->warnings, {});
}

void RankSession::Close() {
  if (!impl_->closing.exchange(true)) {
    impl_->context.TryCancel();
    if (impl_->reader.joinable()) impl_->reader.join();
  }
}

}  // namespace trainstream
