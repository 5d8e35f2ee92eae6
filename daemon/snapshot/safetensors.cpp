#include "daemon/snapshot/safetensors.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>
#include <string_view>

#include "daemon/snapshot/bounded_json.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {

uint64_t ElementsOf(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Reads a header's JSON event by event straight into the header, never into a JSON document: a
// document took 13 bytes of memory per byte of header (210 MB for 16 MiB), which glibc then kept in the
// arena of the gRPC thread that parsed it. The structure is fixed, so nothing nests deeper than three
// levels: an object of tensor entries {"dtype": "F32", "shape": [...], "data_offsets": [b, e]} and one
// "__metadata__" object of strings; anything else is refused where it appears. Errors are thrown from
// the callbacks (nlohmann's parser lets them through).
class HeaderReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderReader(SafetensorsHeader& header) : header_(header) {}

  bool null() override { return Value(nullptr); }
  bool boolean(bool value) override { return Value(value); }
  bool number_integer(number_integer_t value) override { return Value(value); }
  bool number_unsigned(number_unsigned_t value) override;
  bool number_float(number_float_t value, const string_t&) override { return Value(value); }
  bool string(string_t& value) override;
  bool binary(binary_t&) override { return Value("binary data"); }  // not in JSON text
  bool start_object(std::size_t) override;
  bool key(string_t& key) override;
  bool end_object() override;
  bool start_array(std::size_t) override;
  bool end_array() override;
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception&) override {
    Throw(Code::kInvalidArgument, "its header is not a JSON object: invalid JSON at byte {}", position);
  }

 private:
  enum class At { kStart, kTop, kMetadata, kEntry, kShape, kOffsets, kDone };
  enum Field : uint8_t { kDType = 1, kShape = 2, kOffsets = 4 };

  [[nodiscard]] std::string Name() const { return Excerpt(entry_.name); }
  // A value where the structure wants another kind of value.
  [[noreturn]] void Unexpected(const std::string& what) const;
  bool Value(const nlohmann::json& scalar) { Unexpected(Describe(scalar)); }
  void EndEntry();

  SafetensorsHeader& header_;
  At at_ = At::kStart;
  bool metadata_next_ = false;  // at the top, the key just read was "__metadata__"
  std::string key_;             // the metadata key, or the entry's field, just read
  TensorEntry entry_;
  uint8_t fields_ = 0;  // of entry_, those read
  std::vector<uint64_t> offsets_;
};

void HeaderReader::Unexpected(const std::string& what) const {
  switch (at_) {
    case At::kStart:
    case At::kDone: Throw(Code::kInvalidArgument, "its header is not a JSON object");
    case At::kTop:
      TS_CHECK(!metadata_next_, Code::kInvalidArgument, "__metadata__ must be an object of strings, not {}", what);
      Throw(Code::kInvalidArgument, "tensor '{}' needs dtype, shape and data_offsets (it is {})", Name(), what);
    case At::kMetadata:
      Throw(Code::kInvalidArgument, "__metadata__ entry '{}' is not a string (it is {})", Excerpt(key_), what);
    case At::kEntry:
      if (key_ == "dtype")
        Throw(Code::kInvalidArgument, "tensor '{}' has dtype {} (expected F32, BF16, F16 or I64)", Name(), what);
      Throw(Code::kInvalidArgument, "tensor '{}' has {} {} (expected an array of whole numbers)", Name(), key_, what);
    case At::kShape:
      Throw(Code::kInvalidArgument, "tensor '{}' has dimension {} (expected a whole number below 2^40)", Name(), what);
    case At::kOffsets:
      Throw(Code::kInvalidArgument, "tensor '{}' has data_offsets holding {} (expected [begin, end])", Name(), what);
  }
  Throw(Code::kInternal, "unexpected header state");
}

bool HeaderReader::number_unsigned(number_unsigned_t value) {
  if (at_ == At::kShape) {
    TS_CHECK(value < (uint64_t{1} << 40) && entry_.shape.size() < 16, Code::kInvalidArgument,
             "tensor '{}' has dimension {} (expected at most 16 dimensions, each a whole number below 2^40)", Name(),
             value);
    entry_.shape.push_back(static_cast<int64_t>(value));
    return true;
  }
  if (at_ == At::kOffsets) {
    TS_CHECK(offsets_.size() < 2, Code::kInvalidArgument, "tensor '{}' has more than two data_offsets", Name());
    offsets_.push_back(value);
    return true;
  }
  return Value(value);
}

bool HeaderReader::string(string_t& value) {
  if (at_ == At::kMetadata) {
    header_.metadata[key_] = std::move(value);
    return true;
  }
  if (at_ == At::kEntry && key_ == "dtype") {
    TS_CHECK(SafetensorsDTypeSize(value) != 0, Code::kInvalidArgument,
             "tensor '{}' has dtype {} (expected F32, BF16, F16 or I64)", Name(), Describe(value));
    entry_.dtype = std::move(value);
    return true;
  }
  return Value(value);
}

bool HeaderReader::start_object(std::size_t) {
  if (at_ == At::kStart) {
    at_ = At::kTop;
  } else if (at_ == At::kTop) {
    at_ = metadata_next_ ? At::kMetadata : At::kEntry;
  } else {
    Unexpected("an object");
  }
  return true;
}

bool HeaderReader::key(string_t& key) {
  if (at_ == At::kTop) {
    metadata_next_ = key == "__metadata__";
    if (!metadata_next_) {
      entry_ = TensorEntry::Of(std::move(key), "", {});
      fields_ = 0;
    }
    return true;
  }
  if (at_ == At::kEntry) {
    const uint8_t field = key == "dtype" ? kDType : key == "shape" ? kShape : key == "data_offsets" ? kOffsets : 0;
    TS_CHECK(field != 0 && (fields_ & field) == 0, Code::kInvalidArgument,
             "tensor '{}' has {} field '{}' (expected dtype, shape and data_offsets, once each)", Name(),
             field == 0 ? "an unknown" : "a second", Excerpt(key));
    fields_ |= field;
  }
  key_ = std::move(key);
  return true;
}

bool HeaderReader::end_object() {
  if (at_ == At::kEntry) {
    EndEntry();
    at_ = At::kTop;
  } else {
    at_ = at_ == At::kMetadata ? At::kTop : At::kDone;
  }
  return true;
}

bool HeaderReader::start_array(std::size_t) {
  if (at_ != At::kEntry || key_ == "dtype") Unexpected("an array");
  at_ = key_ == "shape" ? At::kShape : At::kOffsets;
  return true;
}

bool HeaderReader::end_array() {
  TS_CHECK(at_ == At::kShape || offsets_.size() == 2, Code::kInvalidArgument,
           "tensor '{}' has {} data_offsets (expected [begin, end])", Name(), offsets_.size());
  at_ = At::kEntry;
  return true;
}

void HeaderReader::EndEntry() {
  TS_CHECK(fields_ == (kDType | kShape | kOffsets), Code::kInvalidArgument,
           "tensor '{}' needs dtype, shape and data_offsets", Name());
  entry_.begin = offsets_[0];
  entry_.end = offsets_[1];
  offsets_.clear();
  uint64_t elements = 1;
  bool overflow = false;
  for (int64_t d : entry_.shape) overflow |= __builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements);
  TS_CHECK(!overflow && entry_.end >= entry_.begin && elements <= (uint64_t{1} << 40) &&
               entry_.bytes() == elements * SafetensorsDTypeSize(entry_.dtype),
           Code::kInvalidArgument, "tensor '{}' ({} [{}]) has data_offsets [{}, {}], which do not hold its elements",
           Name(), entry_.dtype, fmt::join(entry_.shape, ", "), entry_.begin, entry_.end);
  header_.tensors.push_back(std::move(entry_));
}

}  // namespace

size_t SafetensorsDTypeSize(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "I64") return 8;
  return 0;
}

// Written entry by entry: an ordered_json object looks each new key up among those before it, which
// took 10 s for the 56k entries of an 18.8k-parameter job (and a restore encodes its expected header).
std::string EncodeHeader(SafetensorsHeader& header, uint64_t json_bytes) {
  std::string text = "{";
  if (!header.metadata.empty()) text += R"("__metadata__":)" + nlohmann::json(header.metadata).dump();
  uint64_t offset = 0;
  for (TensorEntry& tensor : header.tensors) {
    tensor.begin = offset;
    tensor.end = offset + ElementsOf(tensor.shape) * SafetensorsDTypeSize(tensor.dtype);
    offset = tensor.end;
    if (text.size() > 1) text += ',';
    fmt::format_to(std::back_inserter(text), R"({}:{{"dtype":{},"shape":[{}],"data_offsets":[{},{}]}})",
                   nlohmann::json(tensor.name).dump(), nlohmann::json(tensor.dtype).dump(),
                   fmt::join(tensor.shape, ","), tensor.begin, tensor.end);
  }
  text += '}';
  if (text.size() < json_bytes) text.append(json_bytes - text.size(), ' ');
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  header.data_start = 8 + length;
  header.data_bytes = offset;
  return bytes + text;
}

uint64_t HeaderLength(std::span<const std::byte, 8> length_word, uint64_t file_size) {
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(std::to_integer<uint8_t>(length_word[i])) << (8 * i);
  TS_CHECK(length <= kMaxHeaderBytes, Code::kInvalidArgument,
           "its header is {} bytes; the limit is {} (a snapshot of 10B parameters needs well under 1 MiB)", length,
           kMaxHeaderBytes);
  TS_CHECK(length <= file_size - 8, Code::kInvalidArgument,
           "its header length is {} bytes, but the file has {} bytes (truncated, or not a safetensors file)", length,
           file_size);
  return length;
}

SafetensorsHeader DecodeHeader(const std::byte* file, uint64_t file_size) {
  TS_CHECK(file_size >= 8, Code::kInvalidArgument, "the file has {} bytes, fewer than a safetensors header needs",
           file_size);
  const uint64_t length = HeaderLength(std::span<const std::byte, 8>(file, 8), file_size);
  return DecodeHeader(std::string_view(reinterpret_cast<const char*>(file + 8), length), file_size);
}

SafetensorsHeader DecodeHeader(std::string_view text, uint64_t file_size) {
  SafetensorsHeader header;
  header.data_start = 8 + text.size();
  HeaderReader reader(header);
  nlohmann::json::sax_parse(text.begin(), text.end(), &reader);
  std::set<std::string_view> names;
  for (const TensorEntry& tensor : header.tensors) {
    TS_CHECK(names.insert(tensor.name).second, Code::kInvalidArgument, "tensor '{}' is in its header twice",
             Excerpt(tensor.name));
  }
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  for (const TensorEntry& tensor : header.tensors) {
    TS_CHECK(tensor.begin == header.data_bytes, Code::kInvalidArgument,
             "tensor '{}' starts at byte {} of the data, expected {} (a gap or an overlap)", Excerpt(tensor.name),
             tensor.begin, header.data_bytes);
    header.data_bytes = tensor.end;
  }
  const uint64_t held = file_size - std::min(file_size, header.data_start);
  TS_CHECK(header.data_bytes == held, Code::kInvalidArgument,
           "its header describes {} bytes of tensors, but the file holds {} after the header (truncated?)",
           header.data_bytes, held);
  return header;
}

}  // namespace trainstream::daemon
