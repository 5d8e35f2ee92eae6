// A file replaced crash-safely: its bytes go to a temporary file beside it (".<name>.tmp-<random>",
// created exclusively, mode 0600), which Commit fsyncs and renames over the target, then fsyncs the
// directory. A crash (or SIGKILL) at any point leaves the target as it was or complete with the new
// bytes, never in between; the temporary file of a crash stays behind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace trainstream::daemon {

class AtomicFile {
 public:
  // Creates the temporary file with the calling thread's file identity (daemon/snapshot/file_identity.h);
  // with `owner`, gives it to that uid (a root daemon writing a job's periodic snapshot).
  // kNotFound / kPermissionDenied / kInvalidArgument name the path and the reason.
  AtomicFile(std::string path, std::optional<uint32_t> owner);
  ~AtomicFile();  // removes the temporary file unless committed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void WriteAt(uint64_t offset, std::span<const std::byte> bytes);
  // Makes the bytes the target's: fsync, rename, fsync of the directory. Returns the file's size.
  uint64_t Commit();
  [[nodiscard]] const std::string& temporary_path() const { return temporary_; }

 private:
  void Discard() noexcept;  // closes and removes the temporary file

  std::string path_, temporary_;
  int fd_ = -1;
};

}  // namespace trainstream::daemon
