// The caps on restores under way (daemon/control/restores_in_progress.h): one per uid, two in all;
// a slot is free again when its restore ends, whether it succeeded or threw.
#include "daemon/control/restores_in_progress.h"

#include <gtest/gtest.h>

#include <optional>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

TEST(RestoresInProgress, OnePerUidAndTwoInAll) {
  RestoresInProgress restores;
  std::optional<RestoresInProgress::Entry> alice(std::in_place, restores, 1000);
  TS_EXPECT_ERROR(RestoresInProgress::Entry(restores, 1000), Code::kResourceExhausted,
                  "uid 1000 has a restore under way already (at most 1 per uid at once)");
  const RestoresInProgress::Entry bob(restores, 1001);
  TS_EXPECT_ERROR(RestoresInProgress::Entry(restores, 0), Code::kResourceExhausted,
                  "2 restores are under way (at most 2 at once)");
  alice.reset();  // ended: her slot is free for anyone
  const RestoresInProgress::Entry root(restores, 0);
  TS_EXPECT_ERROR(RestoresInProgress::Entry(restores, 1000), Code::kResourceExhausted, "at most 2 at once");
}

TEST(RestoresInProgress, AFailedRestoreFreesItsSlot) {
  RestoresInProgress restores;
  for (int i = 0; i < 3; ++i) {
    try {
      const RestoresInProgress::Entry restoring(restores, 1000);
      Throw(Code::kInvalidArgument, "the snapshot is not valid");
    } catch (const Error&) {
    }
  }
  const RestoresInProgress::Entry again(restores, 1000);
}

}  // namespace
}  // namespace trainstream::daemon
