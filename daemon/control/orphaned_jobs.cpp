#include "daemon/control/orphaned_jobs.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "daemon/guard/client_segment.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/segment.h"

namespace trainstream::daemon {

namespace {

constexpr const char* kShmDir = "/dev/shm";

// The low 32 bits of a process's start time (clock ticks since boot), or nullopt if it is gone.
std::optional<uint32_t> StartTimeOf(int64_t pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const size_t comm_end = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (comm_end == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(comm_end + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return static_cast<uint32_t>(std::stoull(field));
  }
  return std::nullopt;
}

uint64_t Fnv1a(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : text) hash = (hash ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return hash;
}

uint64_t OwnerWord(int64_t pid, uint32_t start) {
  return (uint64_t{start} << 32) | static_cast<uint32_t>(pid);
}

bool OwnerAlive(uint64_t owner) {
  const auto pid = static_cast<int64_t>(owner & 0xffffffffu);
  if (pid == 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  const auto start = StartTimeOf(pid);
  return !start || *start == static_cast<uint32_t>(owner >> 32);  // a reused pid is another process
}

// "trainstream.<uid>.<key>.state" -> key; nullopt for other names.
std::optional<std::string> StateSegmentKey(const std::string& file, uint32_t uid) {
  const std::string prefix = shm::SegmentName(uid, "", "");  // "trainstream.<uid>.."
  const std::string head = prefix.substr(0, prefix.size() - 1);
  const std::string tail = ".state";
  if (!file.starts_with(head) || !file.ends_with(tail) || file.size() <= head.size() + tail.size()) return std::nullopt;
  return file.substr(head.size(), file.size() - head.size() - tail.size());
}

// Makes this daemon the owner of the job in `segment` if its daemon listened on `socket_hash`'s socket
// and is gone; false if it is not one of those, or another daemon took it first.
bool TakeOver(const ClientSegment& segment, uint64_t socket_hash) {
  if (segment.size() < sizeof(shm::StateHeader)) return false;
  auto* header = static_cast<shm::StateHeader*>(segment.data());
  if (header->magic != shm::StateHeader::kMagic || header->version != shm::kSegmentVersion ||
      header->daemon_socket != socket_hash) {
    return false;
  }
  uint64_t owner = header->owner.load();
  return !OwnerAlive(owner) && header->owner.compare_exchange_strong(owner, SelfAsOwner());
}

// Runs `visit(file, uid, key)` for every state segment in /dev/shm named for the uid that owns it.
template <typename Visit>
void ForEachStateSegment(Visit&& visit) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(kShmDir, error)) {
    const std::string file = entry.path().filename().string();
    struct stat info {};
    if (!file.starts_with("trainstream.") || stat(entry.path().c_str(), &info) != 0) continue;
    const auto key = StateSegmentKey(file, info.st_uid);
    if (!key) continue;
    try {
      visit(file, info.st_uid, *key);
    } catch (const Error& e) {  // not ours to open: another user's, while not running as root
      spdlog::debug("leaving {} alone: {}", file, e.what());
    }
  }
}

std::optional<OrphanedJob> Claim(const std::string& file, uint32_t uid, const std::string& key, uint64_t socket_hash) {
  const ClientSegment segment = ClientSegment::Open(file, uid);
  if (!TakeOver(segment, socket_hash)) return std::nullopt;
  auto* header = static_cast<shm::StateHeader*>(segment.data());
  const std::string name(header->job_name, strnlen(header->job_name, sizeof(header->job_name)));
  if (segment.lost()) {  // what was read may be the zeros in its place: the job is its owner's no more
    spdlog::warn("removing the segments of a job (uid {}, key {}) left by a dead trainstreamd: {}", uid, key,
                 segment.LostMessage());
    RemoveJobSegments(uid, key);
    return std::nullopt;
  }
  if (name.empty()) return std::nullopt;
  return OrphanedJob{
      .name = name,
      .uid = uid,
      .key = key,
      .state_segment = file,
      .completed_step = header->completed_step.load(),
      .layout_hash = header->layout_hash,
      .state_bytes = segment.size(),
      .state_halves = header->state_halves,
      .speculative_clipping = header->speculative_clipping == static_cast<uint32_t>(shm::Speculation::kOn)};
}

}  // namespace

uint64_t SocketHash(const std::string& socket_path) {
  return Fnv1a(std::filesystem::absolute(socket_path).lexically_normal().string());
}

uint64_t PrivateDaemonSocket() {
  static const uint64_t word = [] {
    std::error_code error;
    const std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid", error).string();  // "pid:[N]"
    return Fnv1a("private trainstreamd in " + (error ? std::string("an unknown pid namespace") : ns));
  }();
  return word;
}

uint64_t SelfAsOwner() {
  static const uint64_t self = OwnerWord(getpid(), StartTimeOf(getpid()).value_or(0));
  return self;
}

std::vector<OrphanedJob> ClaimOrphanedJobs(uint64_t socket_hash) {
  std::vector<OrphanedJob> orphans;
  ForEachStateSegment([&](const std::string& file, uint32_t uid, const std::string& key) {
    if (auto orphan = Claim(file, uid, key, socket_hash)) orphans.push_back(std::move(*orphan));
  });
  return orphans;
}

size_t RemoveDeadPrivateJobs() {
  size_t removed = 0;
  ForEachStateSegment([&](const std::string& file, uint32_t uid, const std::string& key) {
    const ClientSegment segment = ClientSegment::Open(file, uid);
    if (!TakeOver(segment, PrivateDaemonSocket())) return;
    spdlog::warn(
        "removing the segments of a job (uid {}, key {}, {} bytes of state) left by a private trainstreamd "
        "that died without removing them (killed, e.g. by the kernel's OOM killer)",
        uid, key, segment.size());
    RemoveJobSegments(uid, key);
    ++removed;
  });
  return removed;
}

void RemoveJobSegments(uint32_t uid, const std::string& key) {
  const std::string prefix = shm::SegmentName(uid, key, "");
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(kShmDir, error)) {
    const std::string file = entry.path().filename().string();
    if (file.starts_with(prefix)) shm::Segment::Remove(file);
  }
}

}  // namespace trainstream::daemon
