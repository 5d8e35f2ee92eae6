// Resume: what each bucket does when a rank attaches (StepEngine::Resume), decided from the steps the
// buckets' states committed. The job resumes from its completed step (every bucket committed it), each
// bucket collecting the next. A bucket one step ahead (its update of the resume step committed before
// the step was abandoned: a trainer died in its backward) is rolled back with two halves (its other half
// holds the resume step), and with one half it keeps its step and takes the replayed step's gradients
// without applying them again. The engine acts on the plan: it stores the rolled-back commits,
// restarts those buckets and rewrites the upload regions the plan and UploadSuspect name.
//
// Invariants: by the skew bound (step_protocol.h) no bucket is more than one step past the completed
// step, so with two halves the other half of a bucket ahead holds the completed step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainstream::daemon {

struct ResumePlan {
  // `committed`: each bucket's committed step; `halves`: the job's state halves.
  static ResumePlan Of(const std::vector<uint64_t>& committed, uint32_t halves);

  // What the log says of the buckets that did not simply resume, naming `job` (empty: none did).
  [[nodiscard]] std::string Describe(const std::string& job) const;

  uint64_t completed = 0;             // the step the job resumes after
  std::vector<uint32_t> rolled_back;  // two halves: their commit goes back to `completed`, in the other half
  std::vector<uint32_t> kept;         // one half: they keep their step and skip its replay
};

// A bucket's upload region may hold weights of no committed step at a resume: the dead daemon of an
// `adopted` job may have been writing it, and a trainer that went away its gradients into it
// (`grads_in_upload`, once the job is `initialized`).
[[nodiscard]] inline bool UploadSuspect(bool adopted, bool grads_in_upload, bool initialized) {
  return adopted || (grads_in_upload && initialized);
}

}  // namespace trainstream::daemon
