#include "daemon/engine/ring_checks.h"

#include <cmath>
#include <string>

#include "shm/error.h"

namespace trainstream::daemon {

bool CheckGradReady(const shm::LayoutSpec& spec, const std::vector<BucketLifecycle>& buckets, bool loading,
                    uint32_t rank, uint32_t staged, const shm::Message& message) {
  const uint32_t b = message.bucket;
  TS_CHECK(b < buckets.size(), Code::kInvalidArgument, "GRAD_READY for bucket {}, but the job has {} buckets", b,
           buckets.size());
  const BucketLifecycle& progress = buckets[b];
  TS_CHECK(!loading, Code::kFailedPrecondition, "GRAD_READY for bucket {} while a state load is in progress", b);
  TS_CHECK(message.step == progress.step, Code::kInvalidArgument,
           "GRAD_READY for bucket {} of step {}, but that bucket expects step {}", b, message.step, progress.step);
  // The rest of a bucket whose update started with its first piece (StepProtocol::StreamsGradients).
  const bool rest = progress.streaming && staged > 0;
  const bool collecting = progress.phase == BucketLifecycle::Phase::kCollecting;
  TS_CHECK((rest || collecting) && message.micro == progress.micro, Code::kInvalidArgument,
           "GRAD_READY for bucket {} micro-batch {} of step {}, but that bucket is {}", b, message.micro, message.step,
           collecting || rest ? fmt::format("collecting micro-batch {}", progress.micro)
                              : std::string("still being processed (slot not yet released)"));
  TS_CHECK(rest || !progress.delivered[rank], Code::kInvalidArgument,
           "rank {} delivered bucket {} of step {} micro-batch {} twice", rank, b, message.step, message.micro);
  const bool final_micro = (message.flags & shm::kFinalMicro) != 0;
  const bool uncertain = (message.flags & shm::kUncertainMicro) != 0;
  if (spec.accumulation_steps != 0) {
    TS_CHECK(final_micro == (message.micro + 1 == spec.accumulation_steps) && !uncertain, Code::kInvalidArgument,
             "GRAD_READY micro-batch {} marked {}, but accumulation_steps is {}", message.micro,
             uncertain     ? "uncertain"
             : final_micro ? "final"
                           : "not final",
             spec.accumulation_steps);
  }
  TS_CHECK(!(final_micro && uncertain), Code::kInvalidArgument,
           "GRAD_READY micro-batch {} marked both final and uncertain", message.micro);
  return rest;
}

void CheckGradPiece(uint32_t slots, uint32_t pieces, uint32_t rank, uint32_t staged, const shm::Message& message) {
  TS_CHECK(message.slot < slots, Code::kInvalidArgument,
           "GRAD_READY for bucket {} names staging slot {}, but rank {} registered {}", message.bucket, message.slot,
           rank, slots);
  TS_CHECK(message.piece == staged && message.piece < pieces, Code::kInvalidArgument,
           "GRAD_READY for piece {} of bucket {} ({} pieces), but piece {} is the next one", message.piece,
           message.bucket, pieces, staged);
}

void CheckCurrentStep(const shm::Message& message, uint64_t completed, uint32_t rank, const char* what) {
  TS_CHECK(message.step == completed + 1, Code::kInvalidArgument,
           "{} from rank {} for step {}, but the job is in step {}", what, rank, message.step, completed + 1);
}

void CheckStepTerms(const shm::LayoutSpec& spec, uint64_t completed, uint32_t rank, const shm::Message& message) {
  TS_CHECK(spec.step_terms, Code::kInvalidArgument,
           "step terms from rank {}, but the job was attached without them (LayoutSpec::step_terms)", rank);
  CheckCurrentStep(message, completed, rank, "step terms");
  TS_CHECK(spec.accumulation_steps == 0 || message.micro == spec.accumulation_steps, Code::kInvalidArgument,
           "step {} summed {} backward passes, but the job's accumulation_steps is {}", message.step, message.micro,
           spec.accumulation_steps);
}

void CheckTermsAgainstBuckets(const std::vector<BucketLifecycle>& buckets, const shm::Message& message) {
  for (uint32_t b = 0; b < buckets.size(); ++b) {
    const uint32_t seen = buckets[b].MicrosSeen();
    TS_CHECK(buckets[b].step != message.step || seen <= message.micro, Code::kInvalidArgument,
             "step {} summed {} backward passes, but bucket {} has {} already", message.step, message.micro, b, seen);
  }
}

void CheckMoreMicro(const shm::LayoutSpec& spec, uint64_t completed, uint32_t rank, const shm::Message& message) {
  TS_CHECK(spec.step_terms && spec.accumulation_steps == 0, Code::kInvalidArgument,
           "MORE_MICRO from rank {}, but the job's accumulation_steps is {}", rank, spec.accumulation_steps);
  CheckCurrentStep(message, completed, rank, "MORE_MICRO");
}

void CheckMoreAfterTerms(uint32_t terms_micro_batches, uint32_t rank, const shm::Message& message) {
  TS_CHECK(terms_micro_batches == 0, Code::kInvalidArgument,
           "rank {} began backward pass {} of step {} after its terms said {} (backward after clip_grad_norm_, a "
           "GradScaler's unscale_ or optimizer.step())",
           rank, message.micro + 2, message.step, terms_micro_batches);
}

void CheckDiscard(const shm::LayoutSpec& spec, uint64_t completed, uint32_t rank, const shm::Message& message) {
  TS_CHECK(spec.step_terms && spec.nodes() == 1, Code::kInvalidArgument,
           "DISCARD from rank {}: a job spanning nodes cannot drop a step's gradients (they were all-reduced)", rank);
  CheckCurrentStep(message, completed, rank, "DISCARD");
}

void CheckWeightsWanted(bool cuda_ipc, uint32_t events, uint32_t rank, const shm::Message& message) {
  TS_CHECK(cuda_ipc, Code::kInvalidArgument,
           "WEIGHTS_WANTED from rank {}, which copies its weights itself (no cuda-ipc registration)", rank);
  TS_CHECK(message.slot < events, Code::kInvalidArgument, "WEIGHTS_WANTED names event {}, but rank {} registered {}",
           message.slot, rank, events);
  TS_CHECK(message.step < (uint64_t{1} << 62), Code::kInvalidArgument, "WEIGHTS_WANTED step {} out of range",
           message.step);
}

void CheckLoadState(const std::vector<BucketLifecycle>& buckets, bool loading, uint32_t rank,
                    const shm::Message& message) {
  TS_CHECK(!loading, Code::kFailedPrecondition, "LOAD_STATE while another load is in progress");
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketLifecycle& progress = buckets[b];
    TS_CHECK(progress.phase == BucketLifecycle::Phase::kCollecting && !progress.MidStep(), Code::kFailedPrecondition,
             "LOAD_STATE from rank {} while bucket {} is in the middle of step {}; call synchronize() first", rank, b,
             progress.step);
  }
  TS_CHECK(message.step < (uint64_t{1} << 62), Code::kInvalidArgument, "LOAD_STATE step {} out of range", message.step);
}

void CheckHParams(const shm::HParams& h, uint32_t group) {
  const bool ok = std::isfinite(h.lr) && h.lr >= 0 && std::isfinite(h.beta1) && h.beta1 >= 0 && h.beta1 < 1 &&
                  std::isfinite(h.beta2) && h.beta2 >= 0 && h.beta2 < 1 && std::isfinite(h.eps) && h.eps >= 0 &&
                  std::isfinite(h.weight_decay) && h.weight_decay >= 0;
  TS_CHECK(ok, Code::kInvalidArgument,
           "invalid hyperparameters for group {}: lr={} betas=({}, {}) eps={} weight_decay={}", group, h.lr, h.beta1,
           h.beta2, h.eps, h.weight_decay);
}

}  // namespace trainstream::daemon
