// The safetensors file format (the one Hugging Face's `safetensors` package reads): an 8-byte
// little-endian header length N, N bytes of JSON
//   {"<tensor>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>", ...}}
// then the tensors' bytes, their offsets counted from the end of the header.
//
// Invariants of what EncodeHeader writes and DecodeHeader accepts: the tensors' byte ranges tile the
// data area exactly (no gap, no overlap, nothing after the last), each range holds exactly its shape's
// elements of its dtype, and the header is padded with spaces so that the data starts 8-byte aligned.
// DecodeHeader reads a header a client controls: its JSON is at most kMaxHeaderBytes, read event by
// event into the structure above (no JSON document, nothing nested deeper than that structure), and
// its errors never print a value whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainstream::daemon {

// The longest header JSON a daemon reads (and writes: a snapshot it could not restore is refused).
// Its size grows with the number of parameters, about 440 bytes each (three tensor entries and the
// layout's entry); a 10.1B GPT (297 parameters) has a 0.13 MiB header, an MoE of 128 experts per layer
// over 48 layers (18.5k parameters) 8.2 MiB (tests/cpp/snapshot/snapshot_file_test.cpp computes both).
// The limit also bounds what one restore can make the daemon allocate while it reads the header (the
// safetensors package's own limit, 100 MiB, let a 44 MiB header cost the daemon 632 MB).
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{16} << 20;

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

// The length of the header JSON that a file's first 8 bytes give; kInvalidArgument if the file (of
// `file_size` bytes) cannot hold it or it is over kMaxHeaderBytes, before anything is read.
uint64_t HeaderLength(std::span<const std::byte, 8> length_word, uint64_t file_size);
// Decodes a file's header JSON (the HeaderLength bytes after the length word) and checks it against
// the file's size; kInvalidArgument saying what is wrong otherwise (not JSON, nested too deep, a bad
// entry, gaps or overlaps, more or fewer bytes of tensors than the file holds).
SafetensorsHeader DecodeHeader(std::string_view json, uint64_t file_size);
// Both, for a whole file in memory.
SafetensorsHeader DecodeHeader(const std::byte* file, uint64_t file_size);

}  // namespace trainstream::daemon
