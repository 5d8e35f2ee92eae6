// One bucket's update of one step: its plan (the per-parameter AdamW scalars, which half it reads and
// which it writes) and, while it runs, its pieces.
//
// An update runs in pieces of about a staging slot (a bucket larger than one: a GPT's tied embedding):
// a piece goes to the pool once the gradients it reads are in (TakeReady), and may go to the GPUs once
// it and every piece before it are written (`written`). A bucket no larger than a slot, or a job
// without cuda-ipc ranks, is one piece.
//
// Invariants: pieces are contiguous and in bucket order, the last one ends at the bucket's end; a piece
// reads no gradients past its end byte, so it may run once the gradients up to that byte are in;
// `written` counts written pieces from the first without a gap; scheduled >= unfinished.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "daemon/engine/bucket_passes.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

// An update and its per-parameter scalars, kept from a speculation to its redo.
struct UpdatePlan {
  uint64_t step = 0;
  uint32_t from = 0, to = 0;                  // state halves
  std::vector<optimizer::AdamWStep> scalars;  // by parameter
  std::vector<uint8_t> updated;               // by parameter: had a gradient (else carried)
  float multiplier = 1.0f;                    // of the averaged gradients, in the update written last
  bool with_norm = false;                     // that update summed the squares of what it read
};

// The update of bucket `bucket`'s `step`, from state half `from` into `to`: scalars per parameter with a
// gradient (`had_grad`, by parameter), whose step counts are written into `to` (the parameters without
// one carry theirs). `hparams` is the table of `step` ([num_groups], validated).
[[nodiscard]] std::shared_ptr<UpdatePlan> PlanUpdate(const shm::LayoutSpec& spec, const shm::JobLayout& layout,
                                                     const shm::StateView& state, uint32_t bucket, uint64_t step,
                                                     uint32_t from, uint32_t to, const shm::HParams* hparams,
                                                     const std::vector<uint8_t>& had_grad);

// Where an update of `bucket` over `blocks` splits: before each block that would reach past the next
// multiple of `piece_bytes`, as (end block, end byte) pairs; one piece where the bucket is no larger.
[[nodiscard]] std::vector<std::pair<size_t, uint64_t>> SplitIntoPieces(const shm::JobLayout& layout, uint32_t bucket,
                                                                       const std::vector<Block>& blocks,
                                                                       uint64_t piece_bytes);

// An update as it runs, piece by piece.
struct RunningUpdate {
  // What the end of a piece means for the update.
  enum class PieceEnd {
    kRunning,            // other pieces still run
    kWaitsForGradients,  // none runs, and the rest wait for gradients (which a rank that left never sends)
    kDone,               // every piece is written
  };

  // The pieces whose gradients are within the first `gradient_bytes`, not given to the pool yet, as
  // [first, end); they count as scheduled and unfinished from now on.
  std::pair<uint32_t, uint32_t> TakeReady(uint64_t gradient_bytes);
  // The first block of piece k (its end is pieces[k].first).
  [[nodiscard]] size_t FirstBlock(uint32_t k) const { return k == 0 ? 0 : pieces[k - 1].first; }
  // The bucket's bytes covered by its first `piece_count` pieces.
  [[nodiscard]] uint64_t EndByte(uint32_t piece_count) const {
    return piece_count == 0 ? 0 : pieces[piece_count - 1].second;
  }
  PieceEnd MarkWritten(uint32_t k);

  std::shared_ptr<std::vector<Block>> blocks;
  std::vector<std::pair<size_t, uint64_t>> pieces;  // (end block, end byte in the bucket)
  std::function<void(size_t, const Block&)> work;   // one block; dropped at the end (it holds the ranks)
  std::function<void()> finish;                     // once every piece is written
  std::vector<uint8_t> piece_written;
  uint32_t scheduled = 0;   // pieces given to the pool
  uint32_t unfinished = 0;  // of those, the ones still running
  uint32_t written = 0;     // pieces written, counted from the first (those may go to the GPUs)
};

}  // namespace trainstream::daemon
