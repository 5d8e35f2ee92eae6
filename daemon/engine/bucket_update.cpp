#include "daemon/engine/bucket_update.h"

#include <algorithm>

namespace trainstream::daemon {

std::shared_ptr<UpdatePlan> PlanUpdate(const shm::LayoutSpec& spec, const shm::JobLayout& layout,
                                       const shm::StateView& state, uint32_t bucket, uint64_t step, uint32_t from,
                                       uint32_t to, const shm::HParams* hparams, const std::vector<uint8_t>& had_grad) {
  auto plan = std::make_shared<UpdatePlan>();
  plan->step = step;
  plan->from = from;
  plan->to = to;
  plan->scalars.resize(spec.params.size());
  plan->updated.assign(spec.params.size(), 0);
  const shm::StateHalf& read = state.halves[from];
  const shm::StateHalf& written = state.halves[to];
  const bool decoupled = spec.optimizer == shm::OptimizerKind::kAdamW;
  for (uint32_t p : layout.buckets[bucket].params) {
    const uint64_t steps = read.param_state[p].step + (had_grad[p] != 0 ? 1 : 0);
    written.param_state[p].step = steps;
    if (!had_grad[p]) continue;
    plan->updated[p] = 1;
    const shm::HParams& h = hparams[spec.params[p].group];
    plan->scalars[p] = optimizer::AdamWStep::For(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, decoupled, steps);
  }
  return plan;
}

std::vector<std::pair<size_t, uint64_t>> SplitIntoPieces(const shm::JobLayout& layout, uint32_t bucket,
                                                         const std::vector<Block>& blocks, uint64_t piece_bytes) {
  const shm::BucketLayout& b = layout.buckets[bucket];
  std::vector<std::pair<size_t, uint64_t>> pieces;
  const uint64_t element = SizeOf(b.dtype);
  size_t first = 0;  // the first block of the piece being filled
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& block = blocks[i];
    const uint64_t begin = (layout.params[block.param].offset_in_bucket + block.begin) * element;
    // A piece ends before the block that would take it past the next multiple of a slot, so that it
    // reads no gradients of the slot after: its update can run once the slots up to its end are in.
    if (i > first && begin + block.count * element > (pieces.size() + 1) * piece_bytes) {
      pieces.emplace_back(i, begin);
      first = i;
    }
  }
  pieces.emplace_back(blocks.size(), b.bytes());
  return pieces;
}

std::pair<uint32_t, uint32_t> RunningUpdate::TakeReady(uint64_t gradient_bytes) {
  const uint32_t first = scheduled;
  while (scheduled < pieces.size() && pieces[scheduled].second <= gradient_bytes) {
    ++scheduled;
    ++unfinished;
  }
  return {first, scheduled};
}

// The update ends with its last piece, or, abandoned while waiting for gradients, with the last piece
// that was running.
RunningUpdate::PieceEnd RunningUpdate::MarkWritten(uint32_t k) {
  piece_written[k] = 1;
  while (written < pieces.size() && piece_written[written] != 0) ++written;
  --unfinished;
  if (unfinished > 0) return PieceEnd::kRunning;
  if (scheduled < pieces.size()) return PieceEnd::kWaitsForGradients;
  return PieceEnd::kDone;
}

}  // namespace trainstream::daemon
