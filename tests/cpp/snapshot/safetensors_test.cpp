// The safetensors header as written and as checked on the way in (daemon/snapshot/safetensors.h).
#include "daemon/snapshot/safetensors.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

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
  TS_EXPECT_ERROR(Decode(huge), Code::kInvalidArgument, "the limit is");
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
                  Code::kInvalidArgument, "has dimension -1");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32"}})", 0)), Code::kInvalidArgument,
                  "needs dtype, shape and data_offsets");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"__metadata__":{"k":1}})", 0)), Code::kInvalidArgument,
                  "'k' is not a string");
}

std::string Nested(size_t depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

// Issue 46: 100k levels (200 KB) in a shape crashed the daemon in the recursive dump() of the error
// message. The header's structure is fixed: wherever an array or object nests where none belongs, it is
// refused there, with a message that describes it.
TEST(Safetensors, DeeplyNestedJsonIsRefusedWhereItStarts) {
  const std::string deep = Nested(100'000);
  for (const auto& [json, why] : std::vector<std::pair<std::string, std::string>>{
           {R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,4]}})",
            "tensor 'a' has dimension an array"},
           {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":)" + deep + "}}", "data_offsets holding an array"},
           {R"({"__metadata__":)" + deep + "}", "__metadata__ must be an object of strings, not an array"},
           {R"({"__metadata__":{"k":)" + deep + "}}", "__metadata__ entry 'k' is not a string (it is an array)"},
           {deep, "not a JSON object"},
           {R"({"a":{"dtype":)" + deep + "}}", "tensor 'a' has dtype an array"},
           {R"({"a":)" + deep + "}", "tensor 'a' needs dtype, shape and data_offsets (it is an array)"}}) {
    TS_EXPECT_ERROR(Decode(FileWithJson(json, 4)), Code::kInvalidArgument, why);
  }
}

TEST(Safetensors, EntriesHoldTheirThreeFieldsOnce) {
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4)),
                  Code::kInvalidArgument, "tensor 'a' has a second field 'dtype'");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4)),
                  Code::kInvalidArgument, "tensor 'a' has an unknown field 'x'");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                      8)),
                  Code::kInvalidArgument, "tensor 'a' is in its header twice");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 4)),
                  Code::kInvalidArgument, "more than two data_offsets");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4)),
                  Code::kInvalidArgument, "has 1 data_offsets");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],)"
                                      R"("data_offsets":[0,4]}})",
                                      4)),
                  Code::kInvalidArgument, "at most 16 dimensions");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1099511627775,1099511627775],)"
                                      R"("data_offsets":[0,4]}})",
                                      4)),
                  Code::kInvalidArgument, "which do not hold its elements");
  TS_EXPECT_ERROR(Decode(FileWithJson(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x)", 4)),
                  Code::kInvalidArgument, "invalid JSON at byte");
}

std::array<std::byte, 8> LengthWord(uint64_t length) {
  std::array<std::byte, 8> word{};
  for (int i = 0; i < 8; ++i) word[i] = static_cast<std::byte>((length >> (8 * i)) & 0xff);
  return word;
}

// A header over the limit is refused by its length word, before a byte of it is read.
TEST(Safetensors, AHeaderOverTheLimitIsRefusedByItsLength) {
  const uint64_t length = kMaxHeaderBytes + 8;
  TS_EXPECT_ERROR(HeaderLength(LengthWord(length), uint64_t{1} << 40), Code::kInvalidArgument,
                  fmt::format("its header is {} bytes; the limit is {}", length, kMaxHeaderBytes));
  EXPECT_EQ(HeaderLength(LengthWord(kMaxHeaderBytes), kMaxHeaderBytes + 8), kMaxHeaderBytes);
  TS_EXPECT_ERROR(HeaderLength(LengthWord(100), 107), Code::kInvalidArgument, "but the file has 107 bytes");
}

// What a client wrote is described in messages, never printed whole: they stay short.
TEST(Safetensors, MessagesDescribeLongValuesWithoutPrintingThem) {
  const std::string long_text(1 << 20, 'n');
  std::string long_shape = "[1";
  for (int i = 0; i < 100'000; ++i) long_shape += ",1";
  long_shape += "]";
  for (const std::string& json : {R"({")" + long_text + R"(":{"dtype":"F32"}})",
                                  R"({"a":{"dtype":")" + long_text + R"(","shape":[1],"data_offsets":[0,4]}})",
                                  R"({"a":{"dtype":"F32","shape":)" + long_shape + R"(,"data_offsets":[0,4]}})",
                                  R"({"__metadata__":{")" + long_text + R"(":1}})"}) {
    try {
      Decode(FileWithJson(json, 4));
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_LT(std::string(e.what()).size(), 300u) << std::string(e.what()).substr(0, 300);
    }
  }
}

}  // namespace
}  // namespace trainstream::daemon
