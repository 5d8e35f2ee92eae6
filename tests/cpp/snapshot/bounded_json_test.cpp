// JSON inside a snapshot's metadata (daemon/snapshot/bounded_json.h): parsed to eight levels, refused
// past them without recursion, described in messages without being printed.
#include "daemon/snapshot/bounded_json.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

std::string Nested(size_t depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

TEST(BoundedJson, ParsesUpToEightLevelsAndRefusesDeeper) {
  EXPECT_EQ(ParseBoundedJson(Nested(8), "layout metadata").size(), 1u);
  TS_EXPECT_ERROR(ParseBoundedJson(Nested(9), "layout metadata"), Code::kInvalidArgument,
                  "its layout metadata is nested deeper than 8 levels");
  // 100k levels: refused before the parser builds any of them (dump() of them overflowed the stack).
  TS_EXPECT_ERROR(ParseBoundedJson(Nested(100'000), "layout metadata"), Code::kInvalidArgument, "nested deeper");
  TS_EXPECT_ERROR(ParseBoundedJson(std::string(100'000, '['), "layout metadata"), Code::kInvalidArgument,
                  "nested deeper");
  TS_EXPECT_ERROR(ParseBoundedJson("{\"a\":", "hparams metadata"), Code::kInvalidArgument,
                  "its hparams metadata is not valid JSON");
}

// Brackets inside strings, escaped quotes among them, are no nesting.
TEST(BoundedJson, BracketsInStringsDoNotCount) {
  const std::string text = R"({"name":"[[[[[[[[[[ \"[[[[[[[[[[ \\", "shape":[[1]]})";
  EXPECT_EQ(ParseBoundedJson(text, "layout metadata").at("shape").size(), 1u);
}

TEST(BoundedJson, DescriptionsAreShort) {
  EXPECT_EQ(Describe(nlohmann::json::parse("[1,[2],3]")), "an array of 3 items");
  EXPECT_EQ(Describe(nlohmann::json::parse(R"({"a":1})")), "an object of 1 entries");
  EXPECT_EQ(Describe(-1), "-1");
  EXPECT_EQ(Describe("Q4"), "\"Q4\"");
  const std::string described = Describe(std::string(1 << 20, 'x'));
  EXPECT_LT(described.size(), 100u);
  EXPECT_NE(described.find("(1048576 bytes)"), std::string::npos);
  EXPECT_NO_THROW(Describe(std::string(59, 'x') + "\xc3\xa9xx"));  // cut inside a UTF-8 character
  EXPECT_EQ(Excerpt("short"), "short");
  EXPECT_NE(Excerpt(std::string(1000, 'n')).find("(1000 bytes)"), std::string::npos);
}

}  // namespace
}  // namespace trainstream::daemon
