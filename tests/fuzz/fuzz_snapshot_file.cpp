// libFuzzer harness: a snapshot file a client controls (daemon/snapshot/snapshot_format.h). The fuzzer's
// bytes are written to a file, which is opened and checked as a restore does (header, metadata, layout,
// step counts); when that succeeds and its layout is small, it is restored into a real state segment,
// non-finite values allowed or not as the last byte says. Whatever the bytes, the result is an Error or
// a restored state: no crash, no sanitizer report, no segment left behind.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "daemon/snapshot/snapshot_format.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/segment.h"

namespace ts = trainstream;

namespace {

constexpr uint64_t kMaxStateBytes = uint64_t{64} << 20;  // larger layouts are only checked, not restored

const std::string& FilePath() {
  static const std::string path = "/tmp/trainstream-fuzz-snapshot-" + std::to_string(getpid());
  return path;
}

void Restore(const ts::daemon::SnapshotFile& file) {
  const ts::shm::LayoutSpec& spec = file.meta().spec;
  const ts::shm::JobLayout layout = ts::shm::ComputeLayout(spec);
  if (layout.state_bytes > kMaxStateBytes) return;
  const std::string name = "trainstream.fuzz." + std::to_string(getpid()) + ".state";
  ts::shm::Segment::Remove(name);
  ts::shm::Segment segment = ts::shm::Segment::Create(name, layout.state_bytes);
  segment.RemoveOnDestroy();
  ts::shm::InitStateSegment(segment.data(), layout);
  file.RestoreInto(ts::daemon::CommittedState(ts::shm::ViewState(segment.data(), layout, spec), layout, spec));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  std::ofstream(FilePath(), std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(bytes), static_cast<std::streamsize>(size));
  try {
    const ts::daemon::SnapshotFile file(
        FilePath(),
        ts::daemon::RestoreOptions{.allow_nonfinite = size > 0 && (bytes[size - 1] & 1) != 0, .cancelled = {}});
    Restore(file);
  } catch (const ts::Error&) {  // refused: what a bad file must come to
  }
  return 0;
}
