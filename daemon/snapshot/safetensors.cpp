#include "daemon/snapshot/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the safetensors package's own limit

uint64_t ElementsOf(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

TensorEntry DecodeEntry(const std::string& name, const nlohmann::json& value) {
  TS_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") && value.contains("data_offsets"),
           Code::kInvalidArgument, "tensor '{}' needs dtype, shape and data_offsets", name);
  TensorEntry entry;
  entry.name = name;
  const nlohmann::json& dtype = value["dtype"];
  TS_CHECK(dtype.is_string() && SafetensorsDTypeSize(dtype.get<std::string>()) != 0, Code::kInvalidArgument,
           "tensor '{}' has dtype {} (expected F32, BF16, F16 or I64)", name, dtype.dump());
  entry.dtype = dtype.get<std::string>();
  const nlohmann::json& shape = value["shape"];
  TS_CHECK(shape.is_array() && shape.size() <= 16, Code::kInvalidArgument, "tensor '{}' has shape {}", name,
           shape.dump());
  for (const nlohmann::json& d : shape) {
    TS_CHECK(d.is_number_unsigned() && d.get<uint64_t>() < (1ull << 40), Code::kInvalidArgument,
             "tensor '{}' has shape {}", name, shape.dump());
    entry.shape.push_back(d.get<int64_t>());
  }
  const nlohmann::json& offsets = value["data_offsets"];
  TS_CHECK(
      offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
      Code::kInvalidArgument, "tensor '{}' has data_offsets {}", name, offsets.dump());
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  const uint64_t elements = ElementsOf(entry.shape);
  TS_CHECK(entry.end >= entry.begin && elements <= (1ull << 40) &&
               entry.bytes() == elements * SafetensorsDTypeSize(entry.dtype),
           Code::kInvalidArgument, "tensor '{}' ({} {}) has data_offsets {}, which do not hold its elements", name,
           entry.dtype, shape.dump(), offsets.dump());
  return entry;
}

std::map<std::string, std::string> DecodeMetadata(const nlohmann::json& value) {
  TS_CHECK(value.is_object(), Code::kInvalidArgument, "__metadata__ must be an object of strings");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    TS_CHECK(item.is_string(), Code::kInvalidArgument, "__metadata__ entry '{}' is not a string", key);
    metadata[key] = item.get<std::string>();
  }
  return metadata;
}

}  // namespace

size_t SafetensorsDTypeSize(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "I64") return 8;
  return 0;
}

std::string EncodeHeader(SafetensorsHeader& header, uint64_t json_bytes) {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  if (!header.metadata.empty()) json["__metadata__"] = header.metadata;
  uint64_t offset = 0;
  for (TensorEntry& tensor : header.tensors) {
    tensor.begin = offset;
    tensor.end = offset + ElementsOf(tensor.shape) * SafetensorsDTypeSize(tensor.dtype);
    offset = tensor.end;
    json[tensor.name] = {
        {"dtype", tensor.dtype}, {"shape", tensor.shape}, {"data_offsets", {tensor.begin, tensor.end}}};
  }
  std::string text = json.dump();
  if (text.size() < json_bytes) text.append(json_bytes - text.size(), ' ');
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  header.data_start = 8 + length;
  header.data_bytes = offset;
  return bytes + text;
}

SafetensorsHeader DecodeHeader(const std::byte* file, uint64_t file_size) {
  TS_CHECK(file_size >= 8, Code::kInvalidArgument, "the file has {} bytes, fewer than a safetensors header needs",
           file_size);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(std::to_integer<uint8_t>(file[i])) << (8 * i);
  TS_CHECK(length <= kMaxHeaderBytes && length <= file_size - 8, Code::kInvalidArgument,
           "its header length is {} bytes, but the file has {} bytes (truncated, or not a safetensors file)", length,
           file_size);
  nlohmann::json json = nlohmann::json::parse(reinterpret_cast<const char*>(file + 8),
                                              reinterpret_cast<const char*>(file + 8 + length), nullptr, false);
  TS_CHECK(!json.is_discarded() && json.is_object(), Code::kInvalidArgument, "its header is not a JSON object");
  SafetensorsHeader header;
  header.data_start = 8 + length;
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") {
      header.metadata = DecodeMetadata(value);
    } else {
      header.tensors.push_back(DecodeEntry(name, value));
    }
  }
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  for (const TensorEntry& tensor : header.tensors) {
    TS_CHECK(tensor.begin == header.data_bytes, Code::kInvalidArgument,
             "tensor '{}' starts at byte {} of the data, expected {} (a gap or an overlap)", tensor.name, tensor.begin,
             header.data_bytes);
    header.data_bytes = tensor.end;
  }
  TS_CHECK(header.data_start + header.data_bytes == file_size, Code::kInvalidArgument,
           "its header describes {} bytes of tensors, but the file holds {} after the header (truncated?)",
           header.data_bytes, file_size - header.data_start);
  return header;
}

}  // namespace trainstream::daemon
