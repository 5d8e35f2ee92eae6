// Where a job's step trace goes (trainstreamd --trace-dir, daemon/engine/step_trace.h), and how a
// daemon, root on a shared node, writes it there without another user steering the write. Issue 46:
// a planted trace-<key>.json symlink made a root daemon overwrite a root-owned file, and every trace
// was 0644, each job's timeline readable by all.
//
// The directory is opened once, when the job starts: component by component from "/", following no
// symbolic link (O_NOFOLLOW), and refused unless only root, the daemon's uid and the job's uid can
// change what it holds and what leads to it: every component owned by one of them, and writable by its
// group or by others only with the sticky bit (as /tmp), where nobody may rename or remove another's
// entries. The file is then written through that descriptor: under a temporary name created
// exclusively (O_CREAT | O_EXCL | O_NOFOLLOW), mode 0600, given to the job's uid (by a root daemon),
// and renamed over the final name; a rename replaces whatever was planted there, a link itself and
// never what it points to.
//
// Invariants: nothing is opened by a path that was not checked; a directory that fails the check, when
// the job starts or (its own mode and owner) when the file is written, gets no file. Errors name the
// component and why.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

namespace trainstream::daemon {

class TraceFile {
 public:
  // `name` in the absolute directory `dir`, for a job of `owner`. kFailedPrecondition (or the errno's
  // code) if `dir` cannot be opened or fails the check above.
  TraceFile(const std::string& dir, std::string name, uint32_t owner);
  ~TraceFile();
  TraceFile(TraceFile&& other) noexcept;
  TraceFile& operator=(TraceFile&&) = delete;
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

  // Writes the file: `body` prints its contents. Throws Error naming the path and why; nothing is
  // left under the temporary name then.
  void Write(const std::function<void(std::FILE*)>& body) const;
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string dir_path_, path_;  // for messages: the directory as it was named, and the file in it
  std::string name_;
  uint32_t owner_ = 0;
  int dir_ = -1;
};

}  // namespace trainstream::daemon
