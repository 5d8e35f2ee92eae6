#include "daemon/engine/micro_batches.h"

#include <spdlog/spdlog.h>

#include "shm/error.h"
#include "shm/message.h"

namespace trainstream::daemon {

// A fixed count says it; else what the step's ranks said (its terms' count, another backward pass),
// else what the micro-batch's ranks expect.
MicroBatches::Last MicroBatches::LastOf(const BucketLifecycle& bucket, const StepGate* gate) const {
  if (accumulation_steps_ != 0) return bucket.micro + 1 == accumulation_steps_ ? Last::kYes : Last::kNo;
  if (more_step_ == bucket.step && bucket.micro < more_micros_) return Last::kNo;
  if (gate != nullptr && gate->terms().micro_batches != 0) {
    return bucket.micro + 1 == gate->terms().micro_batches ? Last::kYes : Last::kNo;
  }
  if ((bucket.flags & shm::kUncertainMicro) != 0) return Last::kUnknown;
  return (bucket.flags & shm::kFinalMicro) != 0 ? Last::kYes : Last::kNo;
}

bool MicroBatches::AllAccumulated(const BucketLifecycle& bucket, const StepGate* gate) {
  if (gate == nullptr || gate->terms().micro_batches == 0) return false;
  return bucket.phase == BucketLifecycle::Phase::kCollecting && bucket.accumulated && bucket.delivered_count == 0 &&
         bucket.micro == gate->terms().micro_batches;
}

void MicroBatches::CheckTerms(uint64_t step, uint32_t micro_batches) const {
  TS_CHECK(more_step_ != step || micro_batches > more_micros_, Code::kInvalidArgument,
           "step {} summed {} backward passes, but rank(s) said another came after the {}th", step, micro_batches,
           more_micros_);
}

bool MicroBatches::More(uint64_t step, uint32_t micro) {
  if (more_step_ != step) more_micros_ = 0;
  more_step_ = step;
  if (micro + 1 <= more_micros_) return false;  // another rank said so already
  more_micros_ = micro + 1;
  return true;
}

// Every rank of a data-parallel job discards alike: the first rank's kDiscard of the step's nth discard
// drops it, the others' find it dropped.
MicroBatches::Discard MicroBatches::OnDiscard(uint64_t step, uint32_t number, uint32_t rank) {
  const uint32_t before = discarded_step_ == step ? discards_ : 0;
  if (number <= before) return discarding_ ? Discard::kBeingDropped : Discard::kDropped;
  TS_CHECK(number == before + 1, Code::kInvalidArgument,
           "DISCARD number {} of step {} from rank {}, but {} came before", number, step, rank, before);
  discarded_step_ = step;
  discards_ = number;
  more_step_ = 0;
  return Discard::kDrop;
}

// A job that counts its micro-batches maps its accumulator when the first step sums several.
float* MicroBatches::Accumulator(const std::string& job) {
  if (accumulator_ != nullptr) return accumulator_;
  own_ = std::make_unique<AccumulatorMemory>(elements_);
  accumulator_ = own_->data();
  spdlog::info("job '{}': {} bytes of gradient accumulator mapped (a step sums several backward passes)", job,
               own_->bytes());
  return accumulator_;
}

}  // namespace trainstream::daemon
