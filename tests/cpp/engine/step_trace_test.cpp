// Tests of the step trace (daemon/engine/step_trace.h): what it keeps once full, what it writes, and
// that a path it cannot write is logged, not thrown.
#include "daemon/engine/step_trace.h"

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace trainstream::daemon {
namespace {

std::string TempPath() {
  return (std::filesystem::temp_directory_path() / ("ts-step-trace-" + std::to_string(getpid()) + ".json")).string();
}

TEST(StepTrace, KeepsTheFirstSpansUpToItsCapacityAndCountsTheRest) {
  const std::string path = TempPath();
  {
    StepTrace trace(path, 2);
    trace.Record({SpanKind::kPull, 3, 1, 0, 10, 20});
    trace.Record({SpanKind::kUpdateBlock, 3, 1, 77, 20, 30});
    trace.Record({SpanKind::kPush, 3, 1, 4096, 30, 40});
  }  // written here
  std::ifstream file(path);
  const nlohmann::json written = nlohmann::json::parse(file);
  std::filesystem::remove(path);
  EXPECT_EQ(written["pid"], getpid());
  EXPECT_EQ(written["dropped"], 1);
  EXPECT_EQ(written["spans"], nlohmann::json({{0, 3, 1, 0, 10, 20}, {1, 3, 1, 77, 20, 30}}));
}

TEST(StepTrace, AnEmptyTraceIsValidJson) {
  const std::string path = TempPath();
  ASSERT_TRUE(StepTrace(path, 4).Write());
  std::ifstream file(path);
  const nlohmann::json written = nlohmann::json::parse(file);
  std::filesystem::remove(path);
  EXPECT_TRUE(written["spans"].empty());
}

TEST(StepTrace, APathItCannotWriteIsLoggedNotThrown) {
  spdlog::set_level(spdlog::level::off);
  StepTrace trace("/nonexistent-dir/trace.json", 1);
  EXPECT_FALSE(trace.Write());
}

TEST(StepTrace, NoDirectoryMeansNoTrace) {
  EXPECT_EQ(TraceInDir("", "key"), nullptr);
}

}  // namespace
}  // namespace trainstream::daemon
