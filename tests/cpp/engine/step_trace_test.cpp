// Tests of the step trace (daemon/engine/step_trace.h): what it keeps once full, what it writes, and
// that a file it cannot write, or a directory that is no place for it, is logged, not thrown.
#include "daemon/engine/step_trace.h"

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace trainstream::daemon {
namespace {

// A directory of this process's own, removed at the end.
class StepTraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("ts-step-trace-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    std::filesystem::permissions(dir_, std::filesystem::perms::owner_all);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  [[nodiscard]] TraceFile File() const { return {dir_.string(), "trace.json", getuid()}; }
  [[nodiscard]] nlohmann::json Written() const {
    std::ifstream file(dir_ / "trace.json");
    return nlohmann::json::parse(file);
  }
  std::filesystem::path dir_;
};

TEST_F(StepTraceTest, KeepsTheFirstSpansUpToItsCapacityAndCountsTheRest) {
  {
    StepTrace trace(File(), 2);
    trace.Record({SpanKind::kPull, 3, 1, 0, 10, 20});
    trace.Record({SpanKind::kUpdateBlock, 3, 1, 77, 20, 30});
    trace.Record({SpanKind::kPush, 3, 1, 4096, 30, 40});
  }  // written here
  const nlohmann::json written = Written();
  EXPECT_EQ(written["pid"], getpid());
  EXPECT_EQ(written["dropped"], 1);
  EXPECT_EQ(written["spans"], nlohmann::json({{0, 3, 1, 0, 10, 20}, {1, 3, 1, 77, 20, 30}}));
}

TEST_F(StepTraceTest, AnEmptyTraceIsValidJson) {
  ASSERT_TRUE(StepTrace(File(), 4).Write());
  EXPECT_TRUE(Written()["spans"].empty());
}

TEST_F(StepTraceTest, AFileItCannotWriteIsLoggedNotThrown) {
  spdlog::set_level(spdlog::level::off);
  StepTrace trace(File(), 1);
  std::filesystem::remove(dir_);  // the directory it holds open is gone
  EXPECT_FALSE(trace.Write());
}

TEST_F(StepTraceTest, ADirectoryThatIsNoPlaceForItMeansNoTrace) {
  spdlog::set_level(spdlog::level::off);
  EXPECT_EQ(TraceInDir("", "key", getuid()), nullptr);
  EXPECT_EQ(TraceInDir("/nonexistent-dir", "key", getuid()), nullptr);
  std::filesystem::permissions(dir_, std::filesystem::perms::all);  // 0777: anyone may plant its name
  EXPECT_EQ(TraceInDir(dir_.string(), "key", getuid()), nullptr);
  std::filesystem::permissions(dir_, std::filesystem::perms::owner_all);
  EXPECT_NE(TraceInDir(dir_.string(), "key", getuid()), nullptr);
}

}  // namespace
}  // namespace trainstream::daemon
