// The safetensors header as written and as checked on the way in (daemon/snapshot/safetensors.h).
#include "daemon/snapshot/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

// A whole file: header, then the data area filled with `fill`.
std::string FileOf(SafetensorsHeader& header, uint64_t json_bytes = 0) {
  std::string file = EncodeHeader(header, json_bytes);
  file.append(header.data_bytes, '\x7f');
  return file;
}

SafetensorsHeader Decode(const std::string& file) {
  return DecodeHeader(reinterpret_cast<const std::byte*>(file.data()), file.size());
}

SafetensorsHeader TwoTensors() {
  SafetensorsHeader header;
  header.tensors = {TensorEntry::Of("a", "F32", {2, 3}), TensorEntry::Of("b", "BF16", {5}),
                    TensorEntry::Of("empty", "I64", {0})};
  header.metadata = {{"format", "test"}};
  return header;
}

TEST(Safetensors, RoundTrip) {
  SafetensorsHeader written = TwoTensors();
  const std::string file = FileOf(written);
  EXPECT_EQ(written.data_start % 8, 0u);
  EXPECT_EQ(written.data_bytes, 2 * 3 * 4 + 5 * 2u);
  const SafetensorsHeader read = Decode(file);
  EXPECT_EQ(read.data_start, written.data_start);
  EXPECT_EQ(read.metadata.at("format"), "test");
  ASSERT_EQ(read.tensors.size(), 3u);
  EXPECT_EQ(read.tensors[0].name, "a");
  EXPECT_EQ(read.tensors[0].end, 24u);
  EXPECT_EQ(read.tensors[1].shape, std::vector<int64_t>{5});
  EXPECT_EQ(read.tensors[2].bytes(), 0u);
}

TEST(Safetensors, ReservedRoomKeepsTheDataWhereItWas) {
  SafetensorsHeader small = TwoTensors();
  const std::string padded = FileOf(small, 4096);
  EXPECT_GE(small.data_start, 8u + 4096);
  EXPECT_EQ(Decode(padded).data_start, small.data_start);  // trailing spaces are JSON whitespace
}

TEST(Safetensors, TruncatedFilesAreRefused) {
  SafetensorsHeader header = TwoTensors();
  const std::string file = FileOf(header);
  TS_EXPECT_ERROR(Decode(file.substr(0, file.size() - 1)), Code::kInvalidArgument, "truncated");
  TS_EXPECT_ERROR(Decode(file.substr(0, 20)), Code::kInvalidArgument, "header length");
  TS_EXPECT_ERROR(Decode(file.substr(0, 5)), Code::kInvalidArgument, "fewer than a safetensors header needs");
  TS_EXPECT_ERROR(Decode(file + "x"), Code::kInvalidArgument, "the file holds");
}

TEST(Safetensors, CorruptHeadersAreRefused) {
  SafetensorsHeader header = TwoTensors();
  std::string file = FileOf(header);
  std::string huge = file;
  file[8] = '[';  // the JSON is no longer an object
  TS_EXPECT_ERROR(Decode(file), Code::kInvalidArgument, "not a JSON object");
  std::memset(huge.data(), 0xff, 8);
  TS_EXPECT_ERROR(Decode(huge), Code::kInvalidArgument, "header length");
}

std::string FileWithJson(const std::string& json, uint64_t data_bytes) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return file + json + std::string(data_bytes, '\0');
}

TEST(Safetensors, EntriesThatDoNotTileTheDataAreRefused) {
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4)),
                  Code::kInvalidArgument, "do not hold its elements");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
                  Code::kInvalidArgument, "a gap or an overlap");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                      4)),
                  Code::kInvalidArgument, "a gap or an overlap");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", 1)),
                  Code::kInvalidArgument, "dtype \"Q4\"");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0)),
                  Code::kInvalidArgument, "has shape");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32"}})", 0)), Code::kInvalidArgument,
                  "needs dtype, shape and data_offsets");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"__metadata__":{"k":1}})", 0)), Code::kInvalidArgument,
                  "'k' is not a string");
}

}  // namespace
}  // namespace trainstream::daemon
