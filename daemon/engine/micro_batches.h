// Accumulation: which micro-batch is a step's last, what the ranks said of it (kMoreMicro: another
// backward pass follows; kDiscard: zero_grad() dropped the step's gradients), and the fp32 accumulator
// the earlier micro-batches of a step are summed into. The engine tells it of these messages and asks
// it about a bucket; it returns what the bucket's micro-batch is, or what a message means.
//
// A job with a fixed accumulation_steps knows its last micro-batch; one that counts them (0) learns it
// from the step's terms (its gate), or earlier from kMoreMicro, else from what the micro-batch's ranks
// expect (kFinalMicro, or kUncertainMicro: held until known). Such a job maps its own accumulator when a
// step first sums several backward passes (AccumulatorMemory); a job without the room fails that step
// (every rank hears why) and keeps its state.
//
// Invariants: once a rank said micro-batch m of step s was not its last, no micro-batch below m+1 of s
// is; the discards of a step are numbered from 1 without gaps, and the ranks hear kDiscarded once per
// discard, after the step's passes ended.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "daemon/engine/accumulator_memory.h"
#include "daemon/engine/bucket_lifecycle.h"
#include "daemon/engine/step_gate.h"

namespace trainstream::daemon {

class MicroBatches {
 public:
  // Whether the micro-batch a bucket collects is its step's last.
  enum class Last { kNo, kYes, kUnknown };
  // What a rank's kDiscard means.
  enum class Discard {
    kDrop,          // the step's gradients are dropped now (Dropping, then FinishDiscard)
    kDropped,       // another rank's came first and the drop is done: this rank hears kDiscarded now
    kBeingDropped,  // another rank's came first: every rank hears kDiscarded when the passes end
  };

  // `accumulation_steps`: the job's fixed count (0: counted); `accumulator`: the state segment's (nullptr:
  // none yet); `elements`: the job's, for one of its own.
  MicroBatches(uint32_t accumulation_steps, float* accumulator, uint64_t elements)
      : accumulation_steps_(accumulation_steps), accumulator_(accumulator), elements_(elements) {}

  // `gate`: the bucket's step's (nullptr: none yet).
  [[nodiscard]] Last LastOf(const BucketLifecycle& bucket, const StepGate* gate) const;
  // The step's terms say it summed as many micro-batches as the bucket has accumulated: its last
  // gradients are all in the accumulator.
  [[nodiscard]] static bool AllAccumulated(const BucketLifecycle& bucket, const StepGate* gate);

  // kStepTerms of `step` saying it summed `micro_batches`: throws kInvalidArgument where a rank said
  // another backward pass came after more.
  void CheckTerms(uint64_t step, uint32_t micro_batches) const;
  // kMoreMicro: micro-batch `micro` of `step` was not its last. Returns whether that is news (another
  // rank may have said it already).
  bool More(uint64_t step, uint32_t micro);
  // kDiscard number `number` of `step` from `rank`; throws kInvalidArgument out of sequence.
  Discard OnDiscard(uint64_t step, uint32_t number, uint32_t rank);
  void Dropping(uint64_t step) { discarding_ = step; }
  // Once no pass of the dropped step runs: the step to tell the ranks of (then forgotten), if any.
  std::optional<uint64_t> FinishDiscard() { return std::exchange(discarding_, std::nullopt); }
  [[nodiscard]] bool discarding() const { return discarding_.has_value(); }
  [[nodiscard]] uint32_t discards() const { return discards_; }
  // The step in flight is dropped (a rank left, a discard): what ranks said of it is void.
  void Forget() { more_step_ = 0; }
  void ForgetDiscard() { discarding_.reset(); }

  // The job's accumulator, mapping one of its own where it has none; logs why, naming `job`.
  float* Accumulator(const std::string& job);
  [[nodiscard]] float* accumulator() const { return accumulator_; }
  [[nodiscard]] uint64_t own_bytes() const { return own_ == nullptr ? 0 : own_->bytes(); }

 private:
  const uint32_t accumulation_steps_;
  uint64_t more_step_ = 0;  // kMoreMicro said: this step's micro-batches below more_micros_ are not its last
  uint32_t more_micros_ = 0;
  std::optional<uint64_t> discarding_;  // kDiscard of this step: kDiscarded once its passes ended
  uint64_t discarded_step_ = 0;         // the step the last kDiscard dropped, and how many times
  uint32_t discards_ = 0;
  float* accumulator_;  // the segment's or own_'s
  const uint64_t elements_;
  std::unique_ptr<AccumulatorMemory> own_;  // jobs that count their micro-batches
};

}  // namespace trainstream::daemon
