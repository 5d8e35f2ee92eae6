#include "daemon/snapshot/untrusted_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

Code CodeOf(int error) {
  if (error == ENOENT || error == ENOTDIR) return Code::kNotFound;
  if (error == EACCES || error == EPERM) return Code::kPermissionDenied;
  return Code::kInvalidArgument;
}

const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a file of another kind";
}

}  // namespace

UntrustedFile::UntrustedFile(std::string path) : path_(std::move(path)) {
  fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) {
    const int error = errno;
    Throw(CodeOf(error), "cannot open snapshot '{}': {}", path_, strerror(error));
  }
  struct stat status {};
  const bool examined = fstat(fd_, &status) == 0;
  const int error = errno;
  if (!examined || !S_ISREG(status.st_mode)) {
    close(fd_);
    fd_ = -1;
    TS_CHECK(examined, Code::kInvalidArgument, "cannot examine snapshot '{}': {}", path_, strerror(error));
    Throw(Code::kInvalidArgument, "snapshot '{}' is not a regular file (it is {})", path_, KindOf(status.st_mode));
  }
  size_ = static_cast<uint64_t>(status.st_size);
  // Reads of a regular file never block for O_NONBLOCK's sake; cleared so that none is ever refused.
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
}

UntrustedFile::~UntrustedFile() {
  if (fd_ >= 0) close(fd_);
}

void UntrustedFile::ReadAt(uint64_t offset, std::span<std::byte> out, const ChunkHook& each_chunk) const {
  uint64_t done = 0;
  while (done < out.size()) {
    const size_t want = std::min<uint64_t>(kChunkBytes, out.size() - done);
    size_t got = 0;
    while (got < want) {
      const ssize_t n = pread(fd_, out.data() + done + got, want - got, static_cast<off_t>(offset + done + got));
      if (n < 0 && errno == EINTR) continue;
      TS_CHECK(n >= 0, Code::kInvalidArgument, "cannot read snapshot '{}' at byte {}: {}", path_, offset + done + got,
               strerror(errno));
      TS_CHECK(n > 0, Code::kFailedPrecondition,
               "snapshot '{}' was truncated while trainstreamd read it: it ended at byte {}, {} bytes short of the {} "
               "it had when it was opened; nothing was restored",
               path_, offset + done + got, out.size() - done - got, size_);
      got += static_cast<size_t>(n);
    }
    if (each_chunk) each_chunk(out.subspan(done, want), done);
    done += want;
  }
}

}  // namespace trainstream::daemon
