// The copies between a cuda-ipc rank's GPU and the host, as decisions: which weights go to the rank's
// GPU now (NextPush), what a finished push leaves the GPU holding (PushEnded), how a bucket's gradients
// are staged (PiecesOf), and what host memory a rank's copies touch (CopiedHostRanges). The engine
// issues the copies (RankTransfer) and posts the messages; these read the rank's RankCopies and the
// bucket's BucketLifecycle and change only the RankCopies they are given.
//
// A bucket is never updated while a push reads it, nor pushed while it updates, except for the pieces of
// its update already written (BucketLifecycle::Writing): a step that does not clip then has its weights
// on the GPU when it commits, as without clipping: waiting for the commit, every bucket's push would
// start after the last bucket's update (1.86B GPT, fp32 weights, 24 GiB cap on the H200: 604 ms a step
// with max_grad_norm against 425 ms without; the pushes of 7.5 GB take about 136 ms at 55 GB/s). A
// bucket updated in pieces goes piece by piece.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "daemon/engine/bucket_lifecycle.h"
#include "daemon/engine/host_range.h"
#include "daemon/engine/rank_channel.h"
#include "daemon/engine/rank_copies.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

struct PushOrder {
  enum class Kind {
    kNone,       // nothing to send now
    kReady,      // PARAMS_READY without a copy: the GPU holds these weights already, or keeps the bucket off it
    kCommitted,  // the bucket's committed weights, whole
    kWritten,    // bytes [begin, end) of the weights its running or speculated update wrote
  };
  Kind kind = Kind::kNone;
  int64_t step = -1;
  uint64_t begin = 0, end = 0;
};

// What goes to the rank's GPU for bucket b now, if the rank wants the step's weights (kWeightsWanted)
// and they are final and not there yet, or written by an update before its commit. `committed`: the
// bucket's committed step; `offset`: where the rank's parameter buffer holds the bucket (none: the rank
// keeps it off the GPU); `bytes`: the bucket's size.
[[nodiscard]] PushOrder NextPush(const RankCopies& rank, uint32_t b, const BucketLifecycle& bucket, int64_t committed,
                                 std::optional<uint64_t> offset, uint64_t bytes);

// A push of bucket b's weights of `step` ended (`ok`: without error). `written`: weights not committed
// when sent; `last`: the push held the bucket's end, so the GPU holds all of it now (pushes of a rank
// complete in submission order); `holds`: those weights still stand (written and awaiting the norm or
// the update's end, or committed as they are). Returns whether the push is current (not overtaken by
// a state load): committed weights then count as pushed once PARAMS_READY goes.
bool PushEnded(RankCopies& rank, uint32_t b, uint64_t step, uint64_t generation, bool written, bool last, bool ok,
               bool holds);

// The pieces a bucket's gradients are staged in, in slots of `slot_bytes`.
[[nodiscard]] uint32_t PiecesOf(const shm::BucketLayout& bucket, uint64_t slot_bytes);

// What a cuda-ipc rank's copies touch on the host, in the order of its first two steps: each bucket on
// its GPU, in backward order, its gradients and the weights the first update writes; then the other
// state half's fp32 master weights (the second update's).
[[nodiscard]] std::vector<HostRange> CopiedHostRanges(const shm::JobLayout& layout, const shm::StateView& state,
                                                      const RankChannel& channel);

// Where bucket b's weights of `half` lie: its master weights there (fp32), else the upload region.
[[nodiscard]] const std::byte* WeightsIn(const shm::JobLayout& layout, const shm::StateView& state, uint32_t b,
                                         const shm::StateHalf& half);

}  // namespace trainstream::daemon
