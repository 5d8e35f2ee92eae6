// A file a client names and controls (a snapshot to restore), read without trusting it to stay what it
// was when it was checked:
// - opened without following a last symlink and without blocking (O_NONBLOCK: the open of a FIFO
//   otherwise waits for a writer, and 20 restores of one held 20 daemon threads forever, after which
//   the daemon could not shut down), then refused unless it is a regular file (fstat of what was
//   opened, so nothing can be swapped in between);
// - read with pread into the caller's memory, never mapped: a mapped file truncated by its owner while
//   the daemon copies from it kills the daemon with SIGBUS (issue 46); a read that comes back short is
//   an error naming the file and the offset (kFailedPrecondition: the file changed, nothing in the
//   request was wrong), and the caller keeps what it checked, not the file;
// - read in chunks, with a hook after each (to check the bytes while they are in cache, and to stop:
//   a cancelled call or a daemon shutting down waits for one chunk at most, not for the whole file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace trainstream::daemon {

class UntrustedFile {
 public:
  // Bytes read at once: a hook runs at least this often, and cancels within the time of one read.
  static constexpr size_t kChunkBytes = size_t{8} << 20;

  // Opens `path` with the calling thread's file identity (daemon/snapshot/file_identity.h).
  // kNotFound / kPermissionDenied if it cannot be opened, kInvalidArgument if it is no regular file;
  // the message names the path.
  explicit UntrustedFile(std::string path);
  ~UntrustedFile();
  UntrustedFile(const UntrustedFile&) = delete;
  UntrustedFile& operator=(const UntrustedFile&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] uint64_t size() const { return size_; }  // when it was opened

  // Called after each chunk with the bytes just read into `out` and their offset in `out`; may throw.
  using ChunkHook = std::function<void(std::span<const std::byte> chunk, uint64_t offset)>;
  // Fills `out` with the file's bytes from `offset` on. kFailedPrecondition if the file ends before
  // (truncated since it was opened), kInvalidArgument if it cannot be read.
  void ReadAt(uint64_t offset, std::span<std::byte> out, const ChunkHook& each_chunk = {}) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

}  // namespace trainstream::daemon
