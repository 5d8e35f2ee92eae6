#include "daemon/snapshot/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

Code CodeOf(int error) {
  if (error == ENOENT || error == ENOTDIR) return Code::kNotFound;
  if (error == EACCES || error == EPERM || error == EROFS) return Code::kPermissionDenied;
  if (error == ENOSPC || error == EDQUOT) return Code::kResourceExhausted;
  return Code::kInvalidArgument;
}

std::string TemporaryBeside(const std::filesystem::path& path) {
  std::random_device device;
  return (path.parent_path() / fmt::format(".{}.tmp-{:08x}", path.filename().string(), device())).string();
}

}  // namespace

AtomicFile::AtomicFile(std::string path, std::optional<uint32_t> owner) : path_(std::move(path)) {
  const std::filesystem::path target(path_);
  TS_CHECK(target.is_absolute() && target.has_filename(), Code::kInvalidArgument,
           "snapshot path '{}' must be an absolute path to a file", path_);
  temporary_ = TemporaryBeside(target);
  fd_ = open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0) {
    const int error = errno;
    Throw(CodeOf(error), "cannot create a file in {}: {}", target.parent_path().string(), strerror(error));
  }
  if (owner && fchown(fd_, *owner, static_cast<gid_t>(-1)) != 0) {
    const int error = errno;
    Discard();
    Throw(CodeOf(error), "cannot give {} to uid {}: {}", temporary_, *owner, strerror(error));
  }
}

AtomicFile::~AtomicFile() {
  Discard();
}

void AtomicFile::Discard() noexcept {
  if (fd_ < 0) return;
  close(fd_);
  fd_ = -1;
  unlink(temporary_.c_str());
}

void AtomicFile::WriteAt(uint64_t offset, std::span<const std::byte> bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    TS_CHECK(n > 0, CodeOf(errno), "cannot write {}: {}", temporary_, strerror(errno));
    done += static_cast<size_t>(n);
  }
}

uint64_t AtomicFile::Commit() {
  struct stat status {};
  TS_CHECK(fsync(fd_) == 0 && fstat(fd_, &status) == 0, CodeOf(errno), "cannot write {}: {}", temporary_,
           strerror(errno));
  TS_CHECK(rename(temporary_.c_str(), path_.c_str()) == 0, CodeOf(errno), "cannot rename {} to {}: {}", temporary_,
           path_, strerror(errno));
  close(fd_);
  fd_ = -1;
  // The rename is durable once the directory is.
  const int directory = open(std::filesystem::path(path_).parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory >= 0) {
    fsync(directory);
    close(directory);
  }
  return static_cast<uint64_t>(status.st_size);
}

}  // namespace trainstream::daemon
