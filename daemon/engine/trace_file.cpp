#include "daemon/engine/trace_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <utility>

#include "shm/error.h"

namespace trainstream::daemon {
namespace {

int OpenDirectory(int parent, const char* name) {
  return openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

// Why the directory `fd` (`shown`) is no place for a trace of `owner`'s job; "" if it is one.
std::string Unsafe(int fd, const std::string& shown, uint32_t owner) {
  struct stat info {};
  if (fstat(fd, &info) != 0) return fmt::format("{} cannot be examined: {}", shown, std::strerror(errno));
  const bool trusted = info.st_uid == 0 || info.st_uid == geteuid() || info.st_uid == owner;
  if (!trusted) return fmt::format("{} belongs to uid {}", shown, info.st_uid);
  if ((info.st_mode & S_ISVTX) != 0) return "";
  if ((info.st_mode & S_IWOTH) != 0) return fmt::format("{} is writable by every user, without the sticky bit", shown);
  if ((info.st_mode & S_IWGRP) != 0) {
    return fmt::format("{} is writable by its group (gid {}), without the sticky bit", shown, info.st_gid);
  }
  return "";
}

[[noreturn]] void Refuse(const std::string& dir, const std::string& why, uint32_t owner) {
  Throw(Code::kFailedPrecondition,
        "trace directory {}: {}; a trace of uid {}'s job goes only where no other user can change the path (each "
        "directory on it owned by root, the daemon's uid or the job's, writable by others only with the sticky bit; "
        "no symbolic links)",
        dir, why, owner);
}

// `dir` opened component by component and checked for `owner`'s job (the header): its descriptor.
int OpenChecked(const std::string& dir, uint32_t owner) {
  const std::filesystem::path path = std::filesystem::path(dir).lexically_normal();
  TS_CHECK(path.is_absolute(), Code::kInvalidArgument, "trace directory '{}' must be an absolute path", dir);
  std::filesystem::path reached = "/";
  int fd = OpenDirectory(AT_FDCWD, "/");
  int error = errno;
  auto check = [&] {
    std::string why;
    if (fd < 0) {
      why = error == ELOOP || error == ENOTDIR
                ? fmt::format("{} is a symbolic link or not a directory", reached.string())
                : fmt::format("cannot open {}: {}", reached.string(), std::strerror(error));
    } else {
      why = Unsafe(fd, reached.string(), owner);
    }
    if (why.empty()) return;
    if (fd >= 0) close(fd);
    Refuse(dir, why, owner);
  };
  for (const std::filesystem::path& component : path.relative_path()) {
    if (component.empty()) continue;  // a trailing separator
    check();
    reached /= component;
    const int parent = fd;
    fd = OpenDirectory(parent, component.c_str());
    error = errno;
    close(parent);
  }
  check();
  return fd;
}

// A temporary file's name in a directory, removed unless it was renamed.
struct Temporary {
  Temporary(int dir, std::string name) : dir(dir), name(std::move(name)) {}
  ~Temporary() {
    if (!renamed) unlinkat(dir, name.c_str(), 0);
  }
  Temporary(const Temporary&) = delete;
  Temporary& operator=(const Temporary&) = delete;
  const int dir;
  const std::string name;
  bool renamed = false;
};

struct CloseFile {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

}  // namespace

TraceFile::TraceFile(const std::string& dir, std::string name, uint32_t owner)
    : dir_path_(dir),
      path_(fmt::format("{}/{}", dir, name)),
      name_(std::move(name)),
      owner_(owner),
      dir_(OpenChecked(dir, owner)) {}

TraceFile::~TraceFile() {
  if (dir_ >= 0) close(dir_);
}

TraceFile::TraceFile(TraceFile&& other) noexcept
    : dir_path_(std::move(other.dir_path_)),
      path_(std::move(other.path_)),
      name_(std::move(other.name_)),
      owner_(other.owner_),
      dir_(std::exchange(other.dir_, -1)) {}

void TraceFile::Write(const std::function<void(std::FILE*)>& body) const {
  if (const std::string why = Unsafe(dir_, dir_path_, owner_); !why.empty()) Refuse(dir_path_, why, owner_);
  std::random_device random;
  const std::string name = fmt::format(".{}.tmp-{:08x}", name_, random());
  const int fd = openat(dir_, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  TS_CHECK(fd >= 0, Code::kFailedPrecondition, "cannot create a file in {}: {}", dir_path_, std::strerror(errno));
  Temporary temporary(dir_, name);
  std::unique_ptr<std::FILE, CloseFile> file(fdopen(fd, "w"));
  if (file == nullptr) close(fd);
  TS_CHECK(file != nullptr, Code::kInternal, "cannot write {}: {}", path_, std::strerror(errno));
  TS_CHECK(geteuid() != 0 || owner_ == 0 || fchown(fd, owner_, static_cast<gid_t>(-1)) == 0, Code::kFailedPrecondition,
           "cannot give {} to uid {}: {}", path_, owner_, std::strerror(errno));
  body(file.get());
  const bool written = std::ferror(file.get()) == 0;
  TS_CHECK(std::fclose(file.release()) == 0 && written, Code::kFailedPrecondition, "cannot write {}: {}", path_,
           std::strerror(errno));
  TS_CHECK(renameat(dir_, name.c_str(), dir_, name_.c_str()) == 0, Code::kFailedPrecondition,
           "cannot rename {} to {}: {}", name, path_, std::strerror(errno));
  temporary.renamed = true;
}

}  // namespace trainstream::daemon
