#include "daemon/engine/resume_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>

namespace trainstream::daemon {

ResumePlan ResumePlan::Of(const std::vector<uint64_t>& committed, uint32_t halves) {
  ResumePlan plan;
  plan.completed =
      committed.empty() ? std::numeric_limits<uint64_t>::max() : *std::min_element(committed.begin(), committed.end());
  for (uint32_t b = 0; b < committed.size(); ++b) {
    if (committed[b] == plan.completed) continue;
    (halves == 2 ? plan.rolled_back : plan.kept).push_back(b);  // one half: StartUpdate skips its replayed step
  }
  return plan;
}

std::string ResumePlan::Describe(const std::string& job) const {
  if (rolled_back.empty() && kept.empty()) return {};
  return fmt::format("job '{}' resumes after step {}: bucket(s) [{}] rolled back from step {}{}", job, completed,
                     fmt::join(rolled_back, ", "), completed + 1,
                     kept.empty() ? std::string()
                                  : fmt::format(", bucket(s) [{}] keep step {} and skip its replay (one state half)",
                                                fmt::join(kept, ", "), completed + 1));
}

}  // namespace trainstream::daemon
