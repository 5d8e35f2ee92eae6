// What each ring message from a rank may say, given where the job is: the checks the engine makes
// before it acts on a message. Each throws kInvalidArgument (kFailedPrecondition where the message may
// be right later) naming what was wrong and what is allowed; the engine fails that rank's session with
// it (StepEngine::DrainRequests) and the job goes on.
//
// Invariants: a check reads, never changes, what it is given; a message that passes its checks can be
// acted on without a further check of the same thing.
#pragma once

#include <cstdint>
#include <vector>

#include "daemon/engine/bucket_lifecycle.h"
#include "shm/job_layout.h"
#include "shm/message.h"

namespace trainstream::daemon {

// GRAD_READY of `rank` (which staged `staged` pieces of the bucket's micro-batch) while `loading` or not.
// Returns whether it carries the rest of a bucket whose update started with its first piece.
bool CheckGradReady(const shm::LayoutSpec& spec, const std::vector<BucketLifecycle>& buckets, bool loading,
                    uint32_t rank, uint32_t staged, const shm::Message& message);
// A cuda-ipc rank's GRAD_READY: its staging slot (of `slots`) and its piece (of `pieces`, `staged` so far).
void CheckGradPiece(uint32_t slots, uint32_t pieces, uint32_t rank, uint32_t staged, const shm::Message& message);
// The step the ranks are in: the one after the job's completed step (the buckets of a later step wait
// for it to complete before they update). `what` names the message.
void CheckCurrentStep(const shm::Message& message, uint64_t completed, uint32_t rank, const char* what);
// STEP_TERMS against the job's options, and against what each bucket has of the step already.
void CheckStepTerms(const shm::LayoutSpec& spec, uint64_t completed, uint32_t rank, const shm::Message& message);
void CheckTermsAgainstBuckets(const std::vector<BucketLifecycle>& buckets, const shm::Message& message);
// MORE_MICRO against the job's options; then against its step's terms (`terms_micro_batches`, 0: none).
void CheckMoreMicro(const shm::LayoutSpec& spec, uint64_t completed, uint32_t rank, const shm::Message& message);
void CheckMoreAfterTerms(uint32_t terms_micro_batches, uint32_t rank, const shm::Message& message);
void CheckDiscard(const shm::LayoutSpec& spec, uint64_t completed, uint32_t rank, const shm::Message& message);
// WEIGHTS_WANTED of a rank that registered `events` events (`cuda_ipc`: it registered at all).
void CheckWeightsWanted(bool cuda_ipc, uint32_t events, uint32_t rank, const shm::Message& message);
// LOAD_STATE: no load in progress, no bucket mid-step.
void CheckLoadState(const std::vector<BucketLifecycle>& buckets, bool loading, uint32_t rank,
                    const shm::Message& message);
// A group's hyperparameters as a rank wrote them.
void CheckHParams(const shm::HParams& h, uint32_t group);

}  // namespace trainstream::daemon
