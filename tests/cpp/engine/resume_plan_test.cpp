// ResumePlan alone (daemon/engine/resume_plan.h): from the steps the buckets committed, the step a job
// resumes after, and which buckets are rolled back (two halves) or keep their step (one half).
#include "daemon/engine/resume_plan.h"

#include <gtest/gtest.h>

#include <vector>

namespace trainstream::daemon {
namespace {

TEST(ResumePlan, BucketsThatCommittedTheCompletedStepResumeAsTheyAre) {
  const ResumePlan plan = ResumePlan::Of({4, 4, 4}, 2);
  EXPECT_EQ(plan.completed, 4u);
  EXPECT_TRUE(plan.rolled_back.empty());
  EXPECT_TRUE(plan.kept.empty());
  EXPECT_EQ(plan.Describe("job"), "");
}

TEST(ResumePlan, ABucketAStepAheadIsRolledBackWithTwoHalvesAndKeepsItsStepWithOne) {
  const ResumePlan two = ResumePlan::Of({5, 4, 5}, 2);
  EXPECT_EQ(two.completed, 4u);
  EXPECT_EQ(two.rolled_back, (std::vector<uint32_t>{0, 2}));
  EXPECT_TRUE(two.kept.empty());
  EXPECT_EQ(two.Describe("job"), "job 'job' resumes after step 4: bucket(s) [0, 2] rolled back from step 5");
  const ResumePlan one = ResumePlan::Of({5, 4, 5}, 1);
  EXPECT_TRUE(one.rolled_back.empty());
  EXPECT_EQ(one.kept, (std::vector<uint32_t>{0, 2}));
  EXPECT_NE(one.Describe("job").find("bucket(s) [0, 2] keep step 5 and skip its replay"), std::string::npos);
}

TEST(ResumePlan, AnUploadRegionIsSuspectInAnAdoptedJobOrWhereGradientsWentIntoIt) {
  EXPECT_TRUE(UploadSuspect(true, false, false));
  EXPECT_TRUE(UploadSuspect(false, true, true));
  EXPECT_FALSE(UploadSuspect(false, true, false));  // no trainer wrote into it yet
  EXPECT_FALSE(UploadSuspect(false, false, true));
}

}  // namespace
}  // namespace trainstream::daemon
