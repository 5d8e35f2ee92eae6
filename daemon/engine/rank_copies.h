// What the engine knows of a cuda-ipc rank's copies: the gradient pieces announced and copied to the
// host for each bucket's micro-batch, and which weights the rank's GPU holds or is being sent. The
// fields of RankChannel that the GPU copies (daemon/engine/gpu_copies.h) decide from, apart from the
// rings and the mapping, so that those decisions are testable without a rank's segment.
//
// Invariants: pushed[b] and speculated[b] name a step or are -1; speculated weights count as pushed
// once their step commits, and are forgotten (with pushed, where the GPU holds nothing committed) when
// the update that wrote them is redone or abandoned; a state load makes every copy in flight stale
// (push_generation).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace trainstream::daemon {

struct RankCopies {
  explicit RankCopies(size_t buckets)
      : staged(buckets, 0),
        pulled(buckets, 0),
        pushing(buckets, 0),
        streamed(buckets, 0),
        pushed(buckets, -1),
        speculated(buckets, -1) {}

  // The GPU's copies of bucket b's speculated weights are void (redone, abandoned): the next commit
  // pushes again where the GPU holds weights of no committed step.
  void ForgetSpeculated(uint32_t b) {
    if (speculated[b] < 0) return;
    if (speculated[b] > pushed[b]) pushed[b] = -1;
    speculated[b] = -1;
  }
  // A state load of `step` completed, loaded by rank `loader`: the GPU's copies of the weights are stale,
  // except the loader's where it said its GPU holds what it loaded.
  void Reloaded(uint32_t rank, uint32_t loader, uint64_t step) {
    ++push_generation;
    std::fill(pushed.begin(), pushed.end(), -1);
    std::fill(speculated.begin(), speculated.end(), -1);
    on_gpu = rank == loader && claims_on_gpu == static_cast<int64_t>(step) ? static_cast<int64_t>(step) : -1;
  }

  // Per bucket, for the micro-batch it collects: pieces announced (GRAD_READY) and copied to the host.
  std::vector<uint32_t> staged, pulled;
  std::vector<uint32_t> pushing;   // per bucket: copies of its weights to the GPU in flight
  std::vector<uint32_t> streamed;  // per bucket: pieces of its running update pushed
  std::vector<int64_t> pushed;     // per bucket: the step whose weights the GPU holds (-1: none)
  // Per bucket: the step whose speculated weights (written, not committed: speculative clipping) the GPU
  // holds, -1 when none or when they were redone; they count as pushed once the step commits.
  std::vector<int64_t> speculated;
  int64_t weights_wanted = -1;   // the latest step whose weights the rank asked for (kWeightsWanted)
  int64_t claims_on_gpu = -1;    // kWeightsOnGpu: the step the rank says its GPU holds (its own load)
  int64_t on_gpu = -1;           // the step whose weights the GPU holds without a push (claim checked)
  uint64_t push_generation = 0;  // a state load makes pushes still in flight stale
};

}  // namespace trainstream::daemon
