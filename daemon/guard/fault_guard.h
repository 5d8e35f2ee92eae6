// Faults from memory a client can take away from under the daemon.
//
// A client may truncate the shared memory segments it owns at any time: the daemon's next access to a
// page past the new end is a SIGBUS, which by default kills the daemon and every user's job with it.
// gRPC cannot pass descriptors (sealed memfds), and a restarted daemon re-adopts jobs from their named
// files, so the segments stay files their owner may resize and the daemon's accesses are made
// fault-safe instead. (The snapshot files a client names are read, never mapped:
// daemon/snapshot/untrusted_file.h.)
//
// InstallFaultGuard() installs a process-wide SIGBUS handler once; a GuardedRange registers the
// address range of one mapping of such memory. A SIGBUS at an address inside a registered range, of
// the kind a page no file backs raises (BUS_ADRERR), is absorbed: the handler maps private zero pages
// over the whole range (MAP_FIXED, as Wayland compositors do with client buffers), marks the range lost
// and returns, so the faulting access (an update kernel on a worker, the engine's ring read, a driver's
// copy) completes on harmless memory. The owner of the range reads lost() and drops what the memory
// served. Any other SIGBUS goes to the disposition found at installation; by default it kills the
// process as before (a fault in the daemon's own memory is a bug, never swallowed).
//
// Invariants: the handler allocates nothing, takes no lock and logs nothing (async-signal-safe: it
// reads a fixed table of slots, each a seqlock of atomics, and calls mmap). A range is registered
// before anything touches its mapping and unregistered after the last access, before its munmap: a
// fault inside a registered range is therefore always in a live mapping of that range.
#pragma once

#include <cstddef>
#include <cstdint>

namespace trainstream::daemon {

// Installs the SIGBUS handler, once per process (later calls return at once). Thread-safe.
void InstallFaultGuard();

// Faults absorbed since the process started, in every range.
[[nodiscard]] uint64_t AbsorbedFaults();

// One registered range. Move-only; unregisters on destruction.
class GuardedRange {
 public:
  GuardedRange() = default;
  // Registers [data, data + bytes) (`data` page-aligned), installing the handler if it is not yet.
  // kResourceExhausted when every slot of the table is taken.
  GuardedRange(const void* data, size_t bytes);
  GuardedRange(GuardedRange&& other) noexcept;
  GuardedRange& operator=(GuardedRange&& other) noexcept;
  GuardedRange(const GuardedRange&) = delete;
  GuardedRange& operator=(const GuardedRange&) = delete;
  ~GuardedRange();

  // Whether a fault was absorbed in the range: its pages now hold zeros, not the shared memory.
  [[nodiscard]] bool lost() const;
  [[nodiscard]] bool registered() const { return slot_ >= 0; }

 private:
  int slot_ = -1;
};

}  // namespace trainstream::daemon
