#include "daemon/guard/fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

// One registered range. `version` is odd while `begin` and `bytes` change, so that the handler, which
// may run while another thread registers or unregisters a range, never matches a half-written one.
struct Slot {
  std::atomic<bool> taken{false};
  std::atomic<uint64_t> version{0};
  std::atomic<std::byte*> begin{nullptr};
  std::atomic<size_t> bytes{0};
  std::atomic<bool> lost{false};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<std::byte*>::is_always_lock_free &&
                  std::atomic<bool>::is_always_lock_free && sizeof(size_t) == sizeof(uint64_t),
              "the handler reads the slots: lock-free atomics only");

// Every mapping of a client's memory the daemon holds: a job's state and one segment per attached rank
// (max_jobs 64 by default, at most 256 ranks each). Pages of the table that
// were never used are never touched: the handler scans only up to the highest slot taken so far.
constexpr size_t kSlots = size_t{1} << 16;
Slot g_slots[kSlots];
std::atomic<size_t> g_used{0};  // slots [0, g_used) have been taken at some time
std::atomic<uint64_t> g_absorbed{0};
struct sigaction g_previous {};  // written once, before the handler is installed

struct Match {
  Slot* slot;
  std::byte* begin;
  size_t bytes;
};

Match Find(const void* address) {
  const size_t used = g_used.load();
  for (size_t i = 0; i < used; ++i) {
    Slot& slot = g_slots[i];
    const uint64_t version = slot.version.load();
    if (version % 2 != 0) continue;  // changing: never a live mapping that faults (see the header)
    std::byte* const begin = slot.begin.load();
    const size_t bytes = slot.bytes.load();
    if (slot.version.load() != version || bytes == 0) continue;
    if (reinterpret_cast<uintptr_t>(address) - reinterpret_cast<uintptr_t>(begin) < bytes) {
      return {&slot, begin, bytes};
    }
  }
  return {nullptr, nullptr, 0};
}

// What the process did with a SIGBUS before: its handler, else the default action (terminate with a
// core dump). A fault returns to the faulting access, which faults again under the default action; a
// SIGBUS that was sent (kill) is sent again, to be delivered once the handler returns.
void PassOn(int signal, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    return g_previous.sa_sigaction(signal, info, context);
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    return g_previous.sa_handler(signal);
  }
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(SIGBUS, &default_action, nullptr);
  if (info == nullptr || info->si_code <= 0) raise(SIGBUS);
}

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  if (info != nullptr && info->si_code == BUS_ADRERR) {
    const Match match = Find(info->si_addr);
    if (match.slot != nullptr && mmap(match.begin, match.bytes, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      match.slot->lost.store(true);
      g_absorbed.fetch_add(1);
      errno = saved_errno;
      return;
    }
  }
  errno = saved_errno;
  PassOn(signal, info, context);
}

int Claim(std::byte* begin, size_t bytes) {
  for (size_t i = 0; i < kSlots; ++i) {
    bool free = false;
    if (!g_slots[i].taken.compare_exchange_strong(free, true)) continue;
    Slot& slot = g_slots[i];
    slot.version.fetch_add(1);
    slot.begin.store(begin);
    slot.bytes.store(bytes);
    slot.lost.store(false);
    slot.version.fetch_add(1);
    size_t used = g_used.load();
    while (used < i + 1 && !g_used.compare_exchange_weak(used, i + 1)) {
    }
    return static_cast<int>(i);
  }
  Throw(Code::kResourceExhausted, "trainstreamd maps {} ranges of its clients' memory already, the most it guards",
        kSlots);
}

void Release(int index) {
  Slot& slot = g_slots[index];
  slot.version.fetch_add(1);
  slot.bytes.store(0);
  slot.begin.store(nullptr);
  slot.version.fetch_add(1);
  slot.taken.store(false);
}

}  // namespace

void InstallFaultGuard() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    struct sigaction previous {};
    TS_CHECK(sigaction(SIGBUS, nullptr, &previous) == 0, Code::kInternal, "cannot read the SIGBUS disposition: {}",
             std::strerror(errno));
    g_previous = previous;
    TS_CHECK(sigaction(SIGBUS, &action, nullptr) == 0, Code::kInternal, "cannot install the SIGBUS handler: {}",
             std::strerror(errno));
  });
}

uint64_t AbsorbedFaults() {
  return g_absorbed.load();
}

GuardedRange::GuardedRange(const void* data, size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  TS_CHECK(reinterpret_cast<uintptr_t>(data) % page == 0, Code::kInternal, "a guarded range must start on a page ({})",
           data);
  InstallFaultGuard();
  // The handler maps over it: the memory is the caller's to give up (const: read-only mappings too).
  slot_ = Claim(static_cast<std::byte*>(const_cast<void*>(data)), (bytes + page - 1) / page * page);
}

GuardedRange::GuardedRange(GuardedRange&& other) noexcept : slot_(std::exchange(other.slot_, -1)) {}

GuardedRange& GuardedRange::operator=(GuardedRange&& other) noexcept {
  if (this != &other) {
    if (slot_ >= 0) Release(slot_);
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

GuardedRange::~GuardedRange() {
  if (slot_ >= 0) Release(slot_);
}

bool GuardedRange::lost() const {
  return slot_ >= 0 && g_slots[slot_].lost.load(std::memory_order_relaxed);
}

}  // namespace trainstream::daemon
