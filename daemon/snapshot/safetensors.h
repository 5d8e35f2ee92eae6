// The safetensors file format (the one Hugging Face's `safetensors` package reads): an 8-byte
// little-endian header length N, N bytes of JSON
//   {"<tensor>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>", ...}}
// then the tensors' bytes, their offsets counted from the end of the header.
//
// Invariants of what EncodeHeader writes and DecodeHeader accepts: the tensors' byte ranges tile the
// data area exactly (no gap, no overlap, nothing after the last), each range holds exactly its shape's
// elements of its dtype, and the header is padded with spaces so that the data starts 8-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trainstream::daemon {

struct TensorEntry {
  static TensorEntry Of(std::string name, std::string dtype, std::vector<int64_t> shape) {
    TensorEntry entry;
    entry.name = std::move(name);
    entry.dtype = std::move(dtype);
    entry.shape = std::move(shape);
    return entry;
  }
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "I64"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data area
  [[nodiscard]] uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // in the order of their data
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data area
  uint64_t data_bytes = 0;
};

// Bytes per element of a safetensors dtype this daemon writes; 0 for any other.
size_t SafetensorsDTypeSize(const std::string& dtype);

// Places `tensors` one after another in their order (filling in their offsets) and returns the file's
// first header.data_start bytes: the length word and the JSON, padded to at least `json_bytes`.
std::string EncodeHeader(SafetensorsHeader& header, uint64_t json_bytes = 0);

// Checks the first bytes of a file of `file_size` bytes and returns its header; kInvalidArgument
// saying what is wrong otherwise (too short, truncated, not JSON, a bad entry, gaps or overlaps).
SafetensorsHeader DecodeHeader(const std::byte* file, uint64_t file_size);

}  // namespace trainstream::daemon
